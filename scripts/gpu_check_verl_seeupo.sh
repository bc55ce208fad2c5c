#!/usr/bin/env bash
# GPU check of SeeUPO on verl (run it when a GPU is lent; NOT RUN on this project's CPU machines):
# one verl training step end to end on one GPU: vLLM generation through our `seeupo_env` agent loop
# on TurnBandit, verl's rewards and log-probs, then SeeUPO's pools on verl's FSDP actor.
# Needs the verl GPU recipe (scripts/verl_gpu_requirements.txt). Passes when the step logs SeeUPO's
# figures. scripts/gpu_check.sh runs it when vllm is importable; without a GPU the launcher says so in
# one line and exits 2.
set -euo pipefail
PY=${PYTHON:-.venv/bin/python}
work=${1:-runs/gpu-check-verl}
mkdir -p "$work"
"$PY" - "$work" <<'EOF2'
import sys
from seeupo_gym.agents.models import load_model
from seeupo_gym.integrations.verl import build_dataset, write_parquet
work = sys.argv[1]
model, tokenizer = load_model("tiny")
model.save_pretrained(f"{work}/tiny"); tokenizer.save_pretrained(f"{work}/tiny")
rows = build_dataset("seeupo/TurnBandit-v0", variant="follow", action_format="tools")
write_parquet(rows, f"{work}/train.parquet"); write_parquet(rows, f"{work}/val.parquet")
EOF2
set +e
timeout ${SEEUPO_VERL_CHECK_TIMEOUT:-900} "$PY" -m seeupo_gym.integrations.verl \
  data.train_files="$work/train.parquet" data.val_files="$work/val.parquet" data.train_batch_size=4 \
  data.max_prompt_length=1024 data.max_response_length=512 data.return_raw_chat=True \
  actor_rollout_ref.model.path="$work/tiny" actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.mode=async \
  actor_rollout_ref.rollout.n=2 actor_rollout_ref.rollout.prompt_length=1024 actor_rollout_ref.rollout.response_length=512 \
  actor_rollout_ref.rollout.gpu_memory_utilization=0.3 actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
  actor_rollout_ref.rollout.multi_turn.enable=True \
  actor_rollout_ref.rollout.agent.agent_loop_config_path=pkg://seeupo_gym.integrations.verl/config/agent_loops.yaml \
  +actor_rollout_ref.model.override_config.attn_implementation=sdpa \
  actor_rollout_ref.actor.ppo_mini_batch_size=4 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2 \
  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2 actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2 \
  actor_rollout_ref.actor.use_kl_loss=True actor_rollout_ref.actor.kl_loss_coef=0.002 \
  trainer.n_gpus_per_node=1 trainer.nnodes=1 trainer.total_training_steps=1 trainer.test_freq=-1 trainer.save_freq=-1 \
  trainer.val_before_train=False trainer.logger='[console]' "${@:2}" 2>&1 | tee "$work/log.txt"
rc=${PIPESTATUS[0]}
set -e
[ "$rc" = 0 ] || { echo "gpu check: verl step failed (exit $rc), log in $work/log.txt"; exit 1; }
grep -q "seeupo/turn_pools" "$work/log.txt" && echo "gpu check: SeeUPO step ran (seeupo/turn_pools logged)"
