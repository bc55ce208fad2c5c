#!/usr/bin/env bash
# The project on one NVIDIA GPU, with no network, in one command (docs/performance.md, "GPU check"):
# installs the wheels it carries (scripts/gpu_check_wheels.sh builds them where there is network),
# then runs each part under its own time limit, the whole within 8 minutes on an H200, and prints one
# table: part, status, seconds, key figure. A part that fails does not stop the next.
#
#   bash scripts/gpu_check.sh                   # on the GPU machine, from the repository root
#   bash scripts/gpu_check.sh --dry-run         # the same parts on CPU at toy sizes (needs .venv)
#   bash scripts/gpu_check.sh --parts install,imports,tests    # a subset
#
# Options: --wheels DIR (default gpu-wheels, or $GPU_CHECK_WHEELS), --out DIR (default /tmp/gpu-check,
# or $OUT: logs, the table as table.md), --budget S (default 480: a part that would start with less
# than 20 s left is skipped). PY=... picks the interpreter (default python3). The dry run takes the
# real path: it builds this tree's wheel, installs it (with the bundle's other wheels, if built) into a
# fresh --target, and runs every part from the repository root with PY, by default .venv's packages
# without the project (a venv of .venv's interpreter that reads .venv's site-packages through a .pth
# line, so the editable install's finder never loads). Exit status 0 when no part failed or ran out of time.
set -u
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
dry=0; wheels=${GPU_CHECK_WHEELS:-$root/gpu-wheels}; out=${OUT:-/tmp/gpu-check}; budget=480
parts=install,imports,generate,tests,smoke,update-1.5b,update-7b-lora,vllm,verl
while [ $# -gt 0 ]; do
  case $1 in
    --dry-run) dry=1 ;;
    --wheels) wheels=${2:?--wheels needs a folder}; shift ;;
    --out) out=${2:?--out needs a folder}; shift ;;
    --budget) budget=${2:?--budget needs seconds}; shift ;;
    --parts) parts=${2:?--parts needs a comma list}; shift ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown option '$1' (--help)" >&2; exit 2 ;;
  esac
  shift
done
case ",$parts," in *,install,*) ;; *) parts=install,$parts ;; esac  # every other part needs the install
mkdir -p "$out"; out=$(cd "$out" && pwd); rm -f "$out"/*.log "$out/table.tsv"
cd "$root"  # the real run's directory: parts that import the project do it from the repository root
if [ $dry = 1 ] && [ -z "${PY:-}" ]; then
  [ -x "$root/.venv/bin/python" ] || { echo "gpu check: the dry run needs .venv (make venv), or PY=<a python with torch, transformers, accelerate>" >&2; exit 2; }
  # .venv's packages without the project: its editable finder is started by a .pth that a path line
  # in another .pth does not run.
  rm -rf "$out/python" && "$root/.venv/bin/python" -m venv --without-pip "$out/python" &&
    "$root/.venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' > \
      "$("$out/python/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/venv-without-project.pth" ||
    { echo "gpu check: could not make a project-free view of .venv in $out/python" >&2; exit 2; }
  PY=$out/python/bin/python
  (cd / && "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('seeupo_gym') is not None)") ||
    { echo "gpu check: $PY still imports seeupo_gym outside the checkout" >&2; exit 2; }
fi
PY=${PY:-python3}
export PY out
T0=$(date +%s)

if [ $dry = 1 ]; then
  echo "gpu check: dry run on CPU at toy sizes ($PY)"
else
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null || {
    echo "gpu check: no CUDA device visible to $PY (torch.cuda.is_available() is False); --dry-run runs on CPU"; exit 2; }
fi

figure() {  # the key figure of a part, from its log
  local name=$1 log=$out/$1.log
  case $name in
    install) grep -o "installed .*" "$log" | tail -1 ;;
    imports) tail -1 "$log" ;;
    tests) grep -E "[0-9]+ (passed|failed)" "$log" | tail -1 | sed 's/=//g; s/^ *//' ;;
    smoke) grep "^RESULT" "$log" | tail -1 | cut -c8- ;;
    update-*) grep "^RESULT" "$log" | tail -1 | cut -c8- | "$PY" -c "
import json, sys
r = json.loads(sys.stdin.read() or '{}'); g, s = r.get('grpo'), r.get('seeupo')
if g and s:
    print(f\"{r['shape']}{' LoRA' if r['lora'] else ''}, {r['trajectories']} traj, {r['packed_tokens']} tok: grpo {g['seconds']:.1f} s, seeupo {s['seconds']:.1f} s \"
          f\"({s['seconds'] / g['seconds']:.2f}x), peak {max(g['peak_gib'], s['peak_gib']):.1f} GiB\")" 2>/dev/null ;;
    generate) grep -E "^\| engine \|" "$log" | head -1 | awk -F'|' '{ gsub(/ /, "", $5); printf "engine %s plain; ", $5 }'
              grep "^verdict:" "$log" | tail -1 | cut -c10- ;;
    vllm) grep "^RESULT" "$log" | tail -1 | cut -c8- | "$PY" -c "
import json, sys; r = json.loads(sys.stdin.read() or '{}')
print(f\"{r['shape']}: {r['tokens']} tokens in {r['seconds']} s = {r['tokens_per_s']:,} tokens/s\") if r else None" 2>/dev/null ;;
    verl) grep "^gpu check:" "$log" | tail -1 ;;
  esac
}

# part NAME LIMIT_S COMMAND...: run it under timeout (capped by what is left of the budget), log it,
# and add a row (status ok / FAIL rc / TIMEOUT / skip) to the table.
part() {
  local name=$1 limit=$2; shift 2
  case ",$parts," in *",$name,"*) ;; *) return 0 ;; esac
  local left=$(( budget - ($(date +%s) - T0) ))
  if [ $left -lt 20 ]; then row "$name" skip 0 "out of budget (${budget} s)"; return 0; fi
  [ $limit -gt $left ] && limit=$left
  echo "=== [$(( $(date +%s) - T0 )) s] $name (limit ${limit} s)"
  local start=$(date +%s) rc status
  if declare -F "$1" >/dev/null; then  # a function of this script: timeout runs programs, so in a bash
    export -f "$1"
    timeout --kill-after=10 "$limit" bash -c "$*" > "$out/$name.log" 2>&1
  else
    timeout --kill-after=10 "$limit" "$@" > "$out/$name.log" 2>&1
  fi
  rc=$?
  case $rc in 0) status=ok ;; 124|137) status=TIMEOUT ;; *) status="FAIL($rc)" ;; esac
  [ $rc = 0 ] || tail -5 "$out/$name.log" | sed 's/^/    /'
  row "$name" "$status" $(( $(date +%s) - start )) "$(figure "$name")"
}
row() { printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$(printf '%s' "$4" | tr '|\t\n' '/  ')" >> "$out/table.tsv"; }
skip() {
  case ",$parts," in *",$1,"*) row "$1" skip 0 "$2" ;; esac
}

# install: the carried wheels into a fresh private site folder, nothing from the network. The dry run
# builds this tree's wheel (offline, from a copy: nothing is written into the checkout) and installs it
# with the bundle's other pure-Python wheels when there is a bundle, .venv's packages standing in for the rest.
site=$out/site; rm -rf "$site"; export site wheels
if [ $dry = 1 ]; then
  bundle=$out/wheels; rm -rf "$bundle" "$out/src"; mkdir -p "$bundle" "$out/src"
  tar -C "$root" --exclude=__pycache__ -cf - seeupo_gym agents algorithms pyproject.toml README.md LICENSE | tar -C "$out/src" -xf - &&
    "$root/.venv/bin/python" -m pip wheel -q --no-deps --no-build-isolation --disable-pip-version-check -w "$bundle" "$out/src" \
      > "$out/build.log" 2>&1 ||
    { tail -5 "$out/build.log" >&2; echo "gpu check: building this tree's wheel failed (log: $out/build.log)" >&2; exit 2; }
  # the bundle's pure-Python wheels (its compiled ones are for the GPU image's CPython 3.12)
  for w in "$wheels"/*-none-any.whl; do case $w in */seeupo_gym-*|*"/*-none-any.whl") ;; *) cp "$w" "$bundle/" ;; esac; done
  wheels=$bundle
elif ! ls "$wheels"/*.whl >/dev/null 2>&1; then
  echo "gpu check: no wheels in $wheels; build them where there is network (bash scripts/gpu_check_wheels.sh) and carry that folder" >&2
  exit 2
fi
install_wheels() {
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check --target "$site" "$wheels"/*.whl &&
    echo "installed $(ls "$wheels"/*.whl | wc -l) wheels, $(du -sm "$wheels" | cut -f1) MiB"
}
part install 120 install_wheels
export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}

part imports 60 "$PY" -c "
import importlib.util, torch, transformers, accelerate, peft, gymnasium, seeupo_gym, seeupo_gym.algorithms, seeupo_gym.training.cli
from seeupo_gym.agents.backends import HFBackend
optional = [m for m in ('vllm', 'verl', 'pytest_timeout', 'xdist') if importlib.util.find_spec(m) is None]
print(f'torch {torch.__version__} cuda={torch.cuda.is_available()} transformers {transformers.__version__} '
      f'accelerate {accelerate.__version__} peft {peft.__version__}; missing: {optional or \"none\"}')"

# The tests run from a copy of tests/ and scripts/, so that the installed package (not the checkout's
# top-level seeupo_gym/) is what they import on the GPU machine.
project=$out/project
rm -rf "$project"; mkdir -p "$project"; cp -r "$root/tests" "$root/scripts" "$root/pyproject.toml" "$project/"
if [ $dry = 1 ]; then
  S1=tiny; S7=tiny; L7=4; TOY="--tasks 1 --group 2 --turns 2 --context 64 --response 16 --observation 8"
  tests="tests/test_learner_temperature.py"; workers="-n 0"; smoke_steps="train.steps=2"
  generate_args="--diagnose --quick"; gen_limit=240; export smoke_steps
else
  S1=1.5b; S7=7b; L7=32; TOY=""
  tests="tests/test_learner.py tests/test_learner_trunk.py tests/test_learner_temperature.py tests/test_seeupo_shared_pass.py
    tests/test_trainer.py tests/test_algorithms.py tests/test_core.py tests/test_sequence_losses.py tests/test_backend_hf.py
    tests/test_prefix_cache.py tests/test_agent.py"
  workers="-n 8"; smoke_steps=""; export smoke_steps; generate_args="--diagnose --model 0.5b --prompt 256 --repeats 2"; gen_limit=180
fi
# generate runs before the tests: its diagnosis of the engine's fixed cost is what a first GPU run is for,
# and it must not be the part the budget skips.
if [ -f "$project/scripts/bench_generate.py" ]; then
  device=cuda; [ $dry = 1 ] && device=cpu
  ( cd "$project" && part generate $gen_limit "$PY" scripts/bench_generate.py --device $device $generate_args )
else
  skip generate "scripts/bench_generate.py absent"
fi
( cd "$project" && part tests 200 "$PY" -m pytest -q -rfE -p no:cacheprovider $workers -o "addopts=-m 'not slow'" \
    --timeout 150 $tests )
smoke() {
  "$PY" -c 'import sys; from seeupo_gym.training.cli import train_main; sys.argv[0] = "seeupo-train"; sys.exit(train_main())' \
    --config smoke log.output_dir="$out/smoke" log.trackers=[] log.progress_bars=false $smoke_steps || return
  "$PY" -c "
import json, torch; rows = [json.loads(l) for l in open('$out/smoke/metrics.jsonl')]
key = 'rollout/reward_mean'
print('RESULT', len(rows), 'steps on', 'cuda' if torch.cuda.is_available() else 'cpu', '; reward', round(rows[0].get(key, float('nan')), 2), '->', round(rows[-1].get(key, float('nan')), 2))"
}
rm -rf "$out/smoke"; part smoke 120 smoke
( cd "$project" && part update-1.5b 150 "$PY" scripts/bench_gpu.py update --shape $S1 --gc --tasks 2 --group 8 $TOY )
( cd "$project" && part update-7b-lora 170 "$PY" scripts/bench_gpu.py update --shape $S7 --lora $L7 --gc --tasks 1 --group 8 $TOY )
if "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)" 2>/dev/null; then
  ( cd "$project" && part vllm 150 "$PY" scripts/bench_gpu.py vllm --shape 0.5b )
  if "$PY" -c "import verl" 2>/dev/null; then
    ( cd "$project" && SEEUPO_VERL_CHECK_TIMEOUT=600 PYTHON=$PY part verl 300 bash scripts/gpu_check_verl_seeupo.sh "$out/verl" )
  else
    skip verl "verl not importable (scripts/verl_gpu_requirements.txt)"
  fi
else
  skip vllm "vllm not importable"; skip verl "vllm not importable"
fi

total=$(( $(date +%s) - T0 ))
load=$(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null)
echo
echo "gpu check ($([ $dry = 1 ] && echo "dry run, CPU" || echo GPU)): ${total} s in all, load ${load}"
{ echo "| part | status | seconds | key figure |"; echo "|---|---|---|---|"
  awk -F'\t' '{ printf "| %s | %s | %s | %s |\n", $1, $2, $3, $4 }' "$out/table.tsv"; } > "$out/table.md"
awk -F'\t' '{ printf "%-15s %-9s %5s  %s\n", $1, $2, $3, $4 }' "$out/table.tsv"
! grep -qE $'\t(FAIL|TIMEOUT)' "$out/table.tsv"
