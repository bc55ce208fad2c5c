#!/usr/bin/env bash
# The SeeUPO paper's run on stock verl 0.9.1 (Qwen3-14B, 8 GPUs on one node): builds the task's parquet
# files, then runs the shipped config. Every setting lives in
# seeupo_gym/integrations/verl/config/experiment/paper*.yaml; this script is the command.
#
#   scripts/verl_seeupo_paper.sh bfcl                # BFCL v4 multi_turn_base, paper-train / paper-test
#   SEEUPO_APPWORLD_DATA=~/appworld/data scripts/verl_seeupo_paper.sh appworld   # official train / dev
#   scripts/verl_seeupo_paper.sh bfcl trainer.total_training_steps=10   # extra overrides last
#   scripts/verl_seeupo_paper.sh bfcl --print-config  # the full config, checked; starts nothing
#
# Install: pip install -r scripts/verl_gpu_requirements.txt '.[verl]' (docs/install.md, "verl on GPUs").
# Without the GPUs the config asks for, the launcher says so in one line and exits 2.
set -euo pipefail
task=${1:?usage: verl_seeupo_paper.sh bfcl|appworld [verl overrides...]}
shift
PY=${PYTHON:-.venv/bin/python}
export SEEUPO_VERL_DATA=${SEEUPO_VERL_DATA:-data/verl}  # where the experiment configs read the data

case $task in
  bfcl)
    env_id=seeupo/BFCL-v4-v0
    train_kwargs='categories=["base"], split="paper-train", max_turns=10, action_format="tools"'
    val_kwargs='categories=["base"], split="paper-test", max_turns=10, action_format="tools"' ;;
  appworld)
    : "${SEEUPO_APPWORLD_DATA:?set SEEUPO_APPWORLD_DATA to the official data folder (appworld download data)}"
    env_id=seeupo/AppWorld-v0
    train_kwargs='split="train", max_turns=10, action_format="tools"'
    val_kwargs='split="dev", max_turns=10, action_format="tools"' ;;
  *) echo "verl_seeupo_paper.sh: task must be bfcl or appworld, got '$task'" >&2; exit 2 ;;
esac

"$PY" - "$env_id" "$SEEUPO_VERL_DATA/$task" <<PYEOF
import sys
from seeupo_gym.integrations.verl import build_dataset, write_parquet
env_id, stem = sys.argv[1], sys.argv[2]
write_parquet(build_dataset(env_id, $train_kwargs), stem + "_train.parquet")
write_parquet(build_dataset(env_id, $val_kwargs), stem + "_val.parquet")
PYEOF

exec "$PY" -m seeupo_gym.integrations.verl +experiment="paper_$task" "$@"
