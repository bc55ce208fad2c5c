"""verl's launcher as Hydra: the shipped configs (seeupo_trainer, +experiment=paper_bfcl / paper_appworld),
`--cfg job`, a full `--print-config`, `--config-path` / `--config-name`, and a one-line refusal on a
machine without the GPUs (or vLLM) the config asks for."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytest.importorskip("verl")

from seeupo_gym.integrations.verl.__main__ import compose, flat, main  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

# The paper script's overrides before its settings moved into config/experiment/paper*.yaml (the BFCL
# task, data under D): the reference the shipped configs must reproduce key for key.
D = "/data/verl"
SCRIPT_OVERRIDES = [
    f"data.train_files={D}/bfcl_train.parquet", f"data.val_files={D}/bfcl_val.parquet",
    "data.train_batch_size=32", "data.max_prompt_length=8192", "data.max_response_length=14000",
    "data.return_raw_chat=True", "actor_rollout_ref.model.path=Qwen/Qwen3-14B",
    "actor_rollout_ref.model.enable_gradient_checkpointing=True", "actor_rollout_ref.model.use_remove_padding=True",
    "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.mode=async", "actor_rollout_ref.rollout.n=8",
    "actor_rollout_ref.rollout.temperature=0.9", "actor_rollout_ref.rollout.prompt_length=8192",
    "actor_rollout_ref.rollout.response_length=14000", "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.5", "actor_rollout_ref.rollout.multi_turn.enable=True",
    "actor_rollout_ref.rollout.agent.default_agent_loop=seeupo_env",
    "actor_rollout_ref.rollout.agent.agent_loop_config_path=LOOPS",
    "actor_rollout_ref.rollout.val_kwargs.temperature=0", "actor_rollout_ref.rollout.val_kwargs.n=4",
    "actor_rollout_ref.actor.optim.lr=1e-6", "actor_rollout_ref.actor.clip_ratio_low=0.2",
    "actor_rollout_ref.actor.clip_ratio_high=0.2", "actor_rollout_ref.actor.use_kl_loss=True",
    "actor_rollout_ref.actor.kl_loss_coef=0.002", "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
    "actor_rollout_ref.actor.entropy_coeff=0", "actor_rollout_ref.actor.ppo_mini_batch_size=32",
    "actor_rollout_ref.actor.use_dynamic_bsz=True", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=20000",
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True",
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=20000",
    "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True", "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=20000",
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload=True", "actor_rollout_ref.ref.fsdp_config.param_offload=True",
    "algorithm.seeupo.order=reverse", "algorithm.seeupo.normalization=batch", "algorithm.use_kl_in_reward=False",
    "trainer.n_gpus_per_node=8", "trainer.nnodes=1", "trainer.total_epochs=50", "trainer.test_freq=15",
    "trainer.save_freq=15", "trainer.project_name=seeupo", "trainer.experiment_name=qwen3-14b-bfcl",
    "trainer.logger=[console]",
]


def resolved(config) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(config, resolve=True)


def leaves(node, prefix=""):
    if isinstance(node, dict) and node:
        for key, value in node.items():
            yield from leaves(value, f"{prefix}.{key}" if prefix else key)
    else:
        yield prefix, node


def test_the_paper_experiment_is_the_old_scripts_overrides_key_for_key(monkeypatch):
    monkeypatch.setenv("SEEUPO_VERL_DATA", D)
    shipped = resolved(compose(["+experiment=paper_bfcl"]))
    loops = shipped["actor_rollout_ref"]["rollout"]["agent"]["agent_loop_config_path"]
    script = resolved(compose([o.replace("LOOPS", loops) for o in SCRIPT_OVERRIDES]))
    ours, theirs = dict(leaves(shipped)), dict(leaves(script))
    diff = {k: (ours.get(k, "?"), theirs.get(k, "?")) for k in ours.keys() | theirs.keys() if ours.get(k, "?") != theirs.get(k, "?")}
    # the one deliberate difference: sdpa attention, so that the recipe needs no flash-attn build
    assert diff == {"actor_rollout_ref.model.override_config.attn_implementation": ("sdpa", "?"),
                    "actor_rollout_ref.model.override_config": ("?", {})}
    # the agent-loop file shipped in the package, its pkg:// value made a path verl can open
    assert Path(loops).is_file() and yaml.safe_load(Path(loops).read_text())[0]["max_tokens_per_turn"] == 4000


def test_the_appworld_experiment_differs_from_bfcl_only_in_its_task(monkeypatch):
    monkeypatch.setenv("SEEUPO_VERL_DATA", D)
    bfcl = dict(leaves(resolved(compose(["+experiment=paper_bfcl"]))))
    appworld = dict(leaves(resolved(compose(["+experiment=paper_appworld"]))))
    changed = {k for k in bfcl if bfcl[k] != appworld.get(k)}
    assert appworld["data.train_files"] == f"{D}/appworld_train.parquet" and appworld["data.max_response_length"] == 10000
    assert {"data.train_files", "data.val_files", "trainer.experiment_name"} <= changed
    assert all(k.startswith("data.") or k.endswith(("experiment_name", "local_dir")) or "prompt_length" in k or "response_length" in k
               for k in changed), sorted(changed)


def test_cfg_job_prints_the_composed_yaml_as_hydra_does(capsys, monkeypatch):
    monkeypatch.setenv("SEEUPO_VERL_DATA", "/elsewhere")
    assert main(["--cfg", "job", "+experiment=paper_bfcl", "actor_rollout_ref.rollout.n=4"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["data"]["train_files"] == "${oc.env:SEEUPO_VERL_DATA,data/verl}/bfcl_train.parquet"  # unresolved
    assert printed["actor_rollout_ref"]["rollout"]["n"] == 4 and printed["trainer"]["v1"]["trainer_mode"] == "seeupo"
    assert printed["algorithm"]["seeupo"] == {"order": "reverse", "normalization": "batch", "m_clip": None,
                                              "old_policy": "step_start", "seed": 0, "variant": "paper",
                                              "m_alignment": "rollout", "max_steps": None, "balance_world_size": 1}
    assert main(["--cfg=job", "--resolve", "+experiment=paper_bfcl"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["data"]["train_files"] == "/elsewhere/bfcl_train.parquet"
    assert printed["actor_rollout_ref"]["rollout"]["prompt_length"] == 8192


def test_cfg_job_prints_before_the_checks_and_print_config_checks(capsys):
    # Hydra's --cfg shows what was composed even when a run would be refused; --print-config refuses.
    assert main(["--cfg", "job", "actor_rollout_ref.rollout.n=1"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["actor_rollout_ref"]["rollout"]["n"] == 1
    assert main(["--print-config", "actor_rollout_ref.rollout.n=1"]) == 2
    assert "rollout.n >= 2" in capsys.readouterr().err


def test_print_config_prints_every_key_resolved(capsys, monkeypatch):
    monkeypatch.setenv("SEEUPO_VERL_DATA", D)
    assert main(["--print-config", "+experiment=paper_bfcl"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("SeeUPO: VerlSeeUPOConfig(order='reverse'")
    printed = dict(line.split("=", 1) for line in out[1:])
    config = compose(["+experiment=paper_bfcl"])
    expected = dict(leaves(resolved(config)))
    assert set(printed) == set(expected) and len(printed) > 500  # the old summary had 11
    for key, text in printed.items():  # each value reads back (YAML, as Hydra reads an override) as the config's
        value = expected[key]
        read = float(text) if isinstance(value, float) else yaml.safe_load(text)  # YAML 1.1 reads 1e-06 as text
        assert read == value, (key, text, value)
    assert printed["trainer.total_epochs"] == "50" and printed["data.train_files"] == f"{D}/bfcl_train.parquet"


def test_flat_writes_leaves_as_overrides():
    assert flat({"a": {"b": 1, "c": [1, "x"], "d": None, "e": True, "f": {}}, "g": 1e-6, "h": "true", "i": "",
                 "j": "x y", "k": "7"}) == [
        "a.b=1", 'a.c=[1, "x"]', "a.d=null", "a.e=true", "a.f={}", "g=1e-06", 'h="true"', 'i=""', "j=x y", 'k="7"']


def test_a_users_own_config_composes_seeupo_trainer_and_verls_plain_one_is_refused(tmp_path, capsys):
    (tmp_path / "my_run.yaml").write_text("defaults:\n  - seeupo_trainer\n  - _self_\n"
                                          "data:\n  train_batch_size: 7\nactor_rollout_ref:\n  rollout:\n    n: 3\n")
    assert main(["--print-config", "--config-path", str(tmp_path), "--config-name", "my_run",
                 "algorithm.seeupo.order=natural"]) == 0
    out = capsys.readouterr().out
    assert "data.train_batch_size=7" in out.splitlines() and "trainer.v1.trainer_mode=seeupo" in out.splitlines()
    assert "order='natural'" in out
    # a config on verl's plain ppo_trainer composes, and the checks refuse it
    (tmp_path / "plain.yaml").write_text("defaults:\n  - ppo_trainer\n  - _self_\n")
    assert main(["--print-config", "--config-path", str(tmp_path), "--config-name=plain", "actor_rollout_ref.rollout.n=8"]) == 2
    assert "must stay seeupo" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--cfg", "hydra"], "only `--cfg job`"),
    (["--cfg"], "--cfg needs a value"),
    (["--resolve"], "--resolve goes with --cfg job"),
    (["--config-name"], "--config-name needs a value"),
    (["--config-path", "/no/such/folder", "--print-config"], "no such folder"),
    (["+experiment=paper_nope", "--print-config"], "paper_nope"),
    (["--cfg", "job", "--frob"], "unknown flag"),
    (["--cfg", "job", "actor_rollout_ref.rollout.agent.agent_loop_config_path=pkg://seeupo_gym.integrations.verl/../"
      "__init__.py"], "no such file in seeupo_gym.integrations.verl"),
    (["--cfg", "job", "actor_rollout_ref.rollout.agent.agent_loop_config_path=pkg://seeupo_gym.integrations.verl/"
      "config/nope.yaml"], "no such file in seeupo_gym.integrations.verl"),
])
def test_bad_flags_are_refused_in_one_line(args, message, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("seeupo verl:")]
    assert len(lines) == 1 and message in lines[0], err[-1500:]
    assert "Traceback" not in err


def test_a_run_without_the_gpus_it_asks_for_is_refused_in_one_line_before_verl_starts(capsys, monkeypatch):
    import torch

    import verl.trainer.main_ppo as main_ppo

    monkeypatch.setattr(main_ppo, "run_ppo", lambda *a, **k: pytest.fail("run_ppo reached"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert main(["+experiment=paper_bfcl"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("seeupo verl: this run needs 8 GPU(s) (trainer.n_gpus_per_node=8 x trainer.nnodes=1) and this "
                       "machine has 2; set trainer.n_gpus_per_node to what it has, or check the config without GPUs "
                       "with --print-config")
    # enough GPUs, no vLLM: the install to run, in one line
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    assert main(["+experiment=paper_bfcl", "trainer.n_gpus_per_node=2"]) == 2
    assert "rollout.name=vllm but vllm is not installed here: pip install -r scripts/verl_gpu_requirements.txt" in \
        capsys.readouterr().err.strip().splitlines()[-1]


def test_the_gpu_check_script_says_in_one_line_that_this_machine_has_no_gpu(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the script would run")
    env = {**os.environ, "PYTHON": sys.executable}
    result = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check_verl_seeupo.sh"), str(tmp_path / "w")],
                            capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert result.returncode == 1
    lines = result.stdout.strip().splitlines()
    assert lines[-2].startswith("seeupo verl: this run needs 1 GPU(s)") and lines[-1].startswith("gpu check: verl step failed")


@pytest.mark.slow
def test_the_paper_script_builds_its_data_then_refuses_a_machine_without_gpus_in_one_line(tmp_path):
    import torch

    if torch.cuda.device_count() >= 8:
        pytest.skip("this machine has the 8 GPUs: the script would start the run")
    env = {**os.environ, "PYTHON": sys.executable, "SEEUPO_VERL_DATA": str(tmp_path)}
    result = subprocess.run(["bash", str(ROOT / "scripts" / "verl_seeupo_paper.sh"), "bfcl"], capture_output=True,
                            text=True, env=env, timeout=600, cwd=ROOT)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("seeupo verl: this run needs 8 GPU(s)")
    assert (tmp_path / "bfcl_train.parquet").is_file() and (tmp_path / "bfcl_val.parquet").is_file()


def test_seeupo_trainer_yaml_sets_seeupos_place_in_verls_config():
    from omegaconf import OmegaConf

    from seeupo_gym.integrations.verl.__main__ import DEFAULTS

    config = compose([])
    for item in DEFAULTS:
        key, value = item.split("=", 1)
        assert str(OmegaConf.select(config, key)) == ("None" if value == "null" else value), item
    # and verl's own defaults stay under it (a key SeeUPO does not touch)
    assert config.actor_rollout_ref.actor.clip_ratio_low == 0.2 and config.trainer.use_v1


def test_composing_prints_none_of_hydras_own_deprecation_warnings():
    # hydra-core 1.3 beside omegaconf 2.4 warned four times per compose (17 lines in a training run) before
    # the launcher's first line; a user's own warnings still show (only these messages are filtered).
    result = subprocess.run([sys.executable, "-m", "seeupo_gym.integrations.verl", "--cfg", "job"],
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "register_new_resolver" not in result.stderr and "Implicit conversion" not in result.stderr, result.stderr
