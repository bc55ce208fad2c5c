#!/usr/bin/env bash
# The SeeUPO paper's run (arXiv 2602.06554) on stock verl 0.9.1: Qwen3-14B, 8 GPUs on one node,
# 32 tasks x 8 rollouts per step, at most 10 turns, temperature 0.9, lr 1e-6, clip 0.2/0.2,
# KL in the loss 0.002 (low_var_kl), batch-normalized advantages, reverse order (as the authors'
# launch files set it; see seeupo_gym/training/presets/paper-*.yaml for each knob's source).
#
#   scripts/verl_seeupo_paper.sh bfcl                # BFCL v4 multi_turn_base, paper-train / paper-test
#   SEEUPO_APPWORLD_DATA=~/appworld/data scripts/verl_seeupo_paper.sh appworld   # official train / dev
#   scripts/verl_seeupo_paper.sh bfcl trainer.total_training_steps=10   # extra verl overrides last
#
# Needs GPUs, vLLM and flash-attn in the venv (pip install "vllm==0.11.*" flash-attn). NOT RUN HERE:
# this project's machines have no GPU; its CPU tests run the same trainer step on verl's actor worker.
set -euo pipefail
task=${1:?usage: verl_seeupo_paper.sh bfcl|appworld [verl overrides...]}
shift
PY=${PYTHON:-.venv/bin/python}
out=${SEEUPO_VERL_DATA:-data/verl}
mkdir -p "$out"

case $task in
  bfcl)
    env_id=seeupo/BFCL-v4-v0
    train_kwargs='categories=["base"], split="paper-train", max_turns=10, action_format="tools"'
    val_kwargs='categories=["base"], split="paper-test", max_turns=10, action_format="tools"'
    prompt_length=8192     # BFCL's tools prompt is ~4.7k tokens
    response_length=14000  # 10 responses of up to 4000 tokens and the env's replies, within 18000 in all
    ;;
  appworld)
    : "${SEEUPO_APPWORLD_DATA:?set SEEUPO_APPWORLD_DATA to the official data folder (appworld download data)}"
    env_id=seeupo/AppWorld-v0
    train_kwargs='split="train", max_turns=10, action_format="tools"'
    val_kwargs='split="dev", max_turns=10, action_format="tools"'
    prompt_length=6144
    response_length=10000  # contexts up to 16000
    ;;
  *) echo "verl_seeupo_paper.sh: task must be bfcl or appworld, got '$task'" >&2; exit 2 ;;
esac

"$PY" - "$env_id" "$out/$task" <<EOF
import sys
from seeupo_gym.integrations.verl import build_dataset, write_parquet
env_id, stem = sys.argv[1], sys.argv[2]
write_parquet(build_dataset(env_id, $train_kwargs), stem + "_train.parquet")
write_parquet(build_dataset(env_id, $val_kwargs), stem + "_val.parquet")
EOF

cat > "$out/seeupo_agent_loops.yaml" <<'EOF'
- name: seeupo_env
  _target_: seeupo_gym.integrations.verl.SeeupoAgentLoop
  max_tokens_per_turn: 4000
EOF

exec "$PY" -m seeupo_gym.integrations.verl \
  data.train_files="$out/${task}_train.parquet" data.val_files="$out/${task}_val.parquet" \
  data.train_batch_size=32 data.max_prompt_length=$prompt_length data.max_response_length=$response_length \
  data.return_raw_chat=True \
  actor_rollout_ref.model.path=Qwen/Qwen3-14B \
  actor_rollout_ref.model.enable_gradient_checkpointing=True actor_rollout_ref.model.use_remove_padding=True \
  actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.mode=async \
  actor_rollout_ref.rollout.n=8 actor_rollout_ref.rollout.temperature=0.9 \
  actor_rollout_ref.rollout.prompt_length=$prompt_length actor_rollout_ref.rollout.response_length=$response_length \
  actor_rollout_ref.rollout.tensor_model_parallel_size=2 actor_rollout_ref.rollout.gpu_memory_utilization=0.5 \
  actor_rollout_ref.rollout.multi_turn.enable=True \
  actor_rollout_ref.rollout.agent.default_agent_loop=seeupo_env \
  actor_rollout_ref.rollout.agent.agent_loop_config_path="$out/seeupo_agent_loops.yaml" \
  actor_rollout_ref.rollout.val_kwargs.temperature=0 actor_rollout_ref.rollout.val_kwargs.n=4 \
  actor_rollout_ref.actor.optim.lr=1e-6 actor_rollout_ref.actor.clip_ratio_low=0.2 actor_rollout_ref.actor.clip_ratio_high=0.2 \
  actor_rollout_ref.actor.use_kl_loss=True actor_rollout_ref.actor.kl_loss_coef=0.002 actor_rollout_ref.actor.kl_loss_type=low_var_kl \
  actor_rollout_ref.actor.entropy_coeff=0 actor_rollout_ref.actor.ppo_mini_batch_size=32 \
  actor_rollout_ref.actor.use_dynamic_bsz=True actor_rollout_ref.actor.ppo_max_token_len_per_gpu=20000 \
  actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=20000 \
  actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=20000 \
  actor_rollout_ref.actor.fsdp_config.optimizer_offload=True actor_rollout_ref.ref.fsdp_config.param_offload=True \
  algorithm.seeupo.order=reverse algorithm.seeupo.normalization=batch algorithm.use_kl_in_reward=False \
  trainer.n_gpus_per_node=8 trainer.nnodes=1 trainer.total_epochs=50 trainer.test_freq=15 trainer.save_freq=15 \
  trainer.project_name=seeupo trainer.experiment_name="qwen3-14b-$task" trainer.logger='[console]' \
  "$@"
