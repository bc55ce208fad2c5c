#!/usr/bin/env bash
# GPU check of SeeUPO on verl (run it when a GPU is lent; NOT RUN on this project's CPU machines):
# one verl training step end to end on one GPU: vLLM generation through our `seeupo_env` agent loop
# on TurnBandit, verl's rewards and log-probs, then SeeUPO's pools on verl's FSDP actor.
# Needs vllm and a CUDA torch in the venv. Passes when the step logs SeeUPO's figures.
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
printf -- '- name: seeupo_env\n  _target_: seeupo_gym.integrations.verl.SeeupoAgentLoop\n' > "$work/loops.yaml"
timeout 900 "$PY" -m seeupo_gym.integrations.verl \
  data.train_files="$work/train.parquet" data.val_files="$work/val.parquet" data.train_batch_size=4 \
  data.max_prompt_length=1024 data.max_response_length=512 data.return_raw_chat=True \
  actor_rollout_ref.model.path="$work/tiny" actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.mode=async \
  actor_rollout_ref.rollout.n=2 actor_rollout_ref.rollout.prompt_length=1024 actor_rollout_ref.rollout.response_length=512 \
  actor_rollout_ref.rollout.gpu_memory_utilization=0.3 actor_rollout_ref.rollout.multi_turn.enable=True \
  actor_rollout_ref.rollout.agent.agent_loop_config_path="$work/loops.yaml" \
  actor_rollout_ref.actor.ppo_mini_batch_size=4 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2 \
  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2 actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2 \
  actor_rollout_ref.actor.use_kl_loss=True actor_rollout_ref.actor.kl_loss_coef=0.002 \
  trainer.n_gpus_per_node=1 trainer.nnodes=1 trainer.total_training_steps=1 trainer.test_freq=-1 trainer.save_freq=-1 \
  trainer.val_before_train=False trainer.logger='[console]' "${@:2}" 2>&1 | tee "$work/log.txt"
grep -q "seeupo/turn_pools" "$work/log.txt" && echo "gpu check: SeeUPO step ran (seeupo/turn_pools logged)"
