"""The embedded model's responses on BFCL multi-turn entries, for the bfcl-eval parity test.

    OMP_NUM_THREADS=2 nice -n 19 python scripts/bfcl_parity_responses.py [--out tests/data/bfcl_embedded_responses.jsonl]

Greedy, through the project's own agent (`VectorAgent` over `HFBackend`, the env's ReAct prompt
and chat template, token contexts extended turn by turn so the prefix cache serves the prompt).
Every entry reaches all its user turns, so bfcl-eval's checker judges every one: the model may
give `RESPONSES_PER_TURN` responses per user turn (a response that ends the turn, plain text,
ends it early); when it is still calling functions after them, a scripted closer ("Done.",
plain text) ends the turn. One JSON line per entry: its responses in order, the closers marked.

Cost (2 shared CPU cores, niced, load average 2-4.5): about 1 s per decoded token and 100 s per
fresh ~2,850-token prompt, so one response per user turn and 64 new tokens: the model's call
lists take 6-20; of its 168 responses, 53 prose answers are cut (they end the turn all the same)
and 14 are cut inside an unclosed <think> block. The 40 entries took 31 min, 8 episodes decoded
together.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import gymnasium as gym

VERSION = 1
MODEL = "embedded"
CATEGORIES = ("base", "miss_func", "miss_param", "long_context")
ENTRIES = [f"multi_turn_{category}_{index}" for category in CATEGORIES for index in range(10)]
# Generated index by index: the categories' variants of an entry share most of their prompt,
# which the backend's prefix cache then prefills once.
ORDER = [f"multi_turn_{category}_{index}" for index in range(10) for category in CATEGORIES]
RESPONSES_PER_TURN = 1
MAX_NEW_TOKENS = 64
CLOSER = "Done."
# Room for every response and closer of the longest entry (6 user turns), so none is truncated.
ENV_KWARGS = {"split": "all", "max_turns": 30}
MAX_CONTEXT_TOKENS = 32768  # the model's window: long_context's observations are long


class TurnBudget(gym.Wrapper):
    """Ends a user turn with the scripted closer after `k` model responses that did not end it.
    The closer is stepped here, so the agent sees one step; `info["responses"]` lists every
    response of the episode as (text, scripted); `on_end(task_id, responses, reward, end)` is
    called as an episode ends."""

    def __init__(self, env: gym.Env, k: int, on_end: Callable[..., None] | None = None, log: bool = False) -> None:
        super().__init__(env)
        self.k = k
        self.on_end = on_end
        self.log = log

    def reset(self, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
        self._responses: list[tuple[str, bool]] = []
        self._in_turn = 0
        self._start = time.perf_counter()
        observation, info = self.env.reset(**kwargs)
        self._user_turn = info["user_turn"]
        return observation, {**info, "responses": []}

    def step(self, action: str) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        self._responses.append((action, False))
        outcome = self.env.step(action)
        ended = outcome[4]["user_turn"] != self._user_turn
        self._in_turn = 0 if ended else self._in_turn + 1
        if self._in_turn >= self.k and not (outcome[2] or outcome[3]):
            self._responses.append((CLOSER, True))
            outcome = self.env.step(CLOSER)
            self._in_turn = 0
        observation, reward, terminated, truncated, info = outcome
        self._user_turn = info["user_turn"]
        if self.log:
            print(f"  {info['task_id']} response {len(self._responses)} at {time.perf_counter() - self._start:.0f} s: "
                  f"{action[:80]!r}", file=sys.stderr, flush=True)
        if (terminated or truncated) and self.on_end is not None:
            self.on_end(info["task_id"], list(self._responses), float(reward), "terminated" if terminated else "truncated")
        return observation, reward, terminated, truncated, {**info, "responses": list(self._responses)}


def record(task_id: str, responses: Sequence[tuple[str, bool]], reward: float, end: str | None,
           settings: dict[str, Any]) -> dict[str, Any]:
    """One fixture line: the episode's responses, closers marked, and how they were made."""
    return {
        "task_id": task_id,
        "responses": [{"text": text, "scripted": True} if scripted else {"text": text} for text, scripted in responses],
        "reward": reward,
        "end": end,
        "model": MODEL,
        "sampling": settings,
        "env_kwargs": ENV_KWARGS,
        "made_by": f"scripts/bfcl_parity_responses.py v{VERSION}",
    }


def generate(task_ids: Sequence[str], backend: Any, tokenizer: Any, *, max_new_tokens: int = MAX_NEW_TOKENS,
             k: int = RESPONSES_PER_TURN, num_envs: int = 1, on_line: Callable[[dict], None] | None = None,
             log: bool = False) -> list[dict[str, Any]]:
    """The fixture lines of `task_ids` (`on_line` gets each as its episode ends): greedy episodes of
    `backend`'s model under the turn budget, `num_envs` at once (their decoding batched)."""
    from seeupo_gym.agents.backends import SamplingParams
    from seeupo_gym.agents.vector import VectorAgent
    from seeupo_gym.bfcl.env import BFCLEnv

    sampling = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
    settings = {"temperature": 0.0, "max_new_tokens": max_new_tokens, "responses_per_turn": k}

    def on_end(task_id: str, responses: list, reward: float, end: str) -> None:
        if on_line is not None:
            on_line(record(task_id, responses, reward, end, settings))

    agent = VectorAgent(
        "seeupo/BFCL-v4-v0", backend, tokenizer, num_envs=num_envs, sampling=sampling,
        max_context_tokens=MAX_CONTEXT_TOKENS, env_factory=lambda: TurnBudget(BFCLEnv(**ENV_KWARGS), k, on_end, log),
    )
    with agent:
        batch = agent.collect(list(task_ids), group_size=1, seed=0)
    return [record(t.task_id, t.info.get("env_info", {}).get("responses", []), t.reward, t.info.get("end"), settings)
            for t in batch.trajectories]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="tests/data/bfcl_embedded_responses.jsonl")
    parser.add_argument("--tasks", help="comma-separated ids (default: entries 0-9 of each category)")
    parser.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS)
    parser.add_argument("--responses-per-turn", type=int, default=RESPONSES_PER_TURN)
    parser.add_argument("--num-envs", type=int, default=8, help="episodes decoded together")
    parser.add_argument("--resume", action="store_true", help="keep the entries --out already holds")
    args = parser.parse_args(argv)
    import torch

    from seeupo_gym.agents.backends import HFBackend
    from seeupo_gym.agents.models import load_model

    out = Path(args.out)
    lines = [json.loads(line) for line in out.read_text().splitlines()] if args.resume and out.exists() else []
    done = {line["task_id"] for line in lines}
    tasks = [t for t in (args.tasks.split(",") if args.tasks else ORDER) if t not in done]
    torch.manual_seed(0)
    model, tokenizer = load_model(MODEL)
    backend = HFBackend(model, tokenizer)
    out.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    order = {task_id: index for index, task_id in enumerate(ENTRIES)}

    def save(line: dict[str, Any]) -> None:  # as each episode ends, so an interrupted run keeps what it made
        lines.append(line)
        lines.sort(key=lambda item: order.get(item["task_id"], len(order)))
        out.write_text("".join(json.dumps(item, ensure_ascii=False) + "\n" for item in lines))
        print(f"{line['task_id']}: {len(line['responses'])} responses ({sum('scripted' in r for r in line['responses'])} "
              f"closers), reward {line['reward']}, {line['end']}, at {time.perf_counter() - start:.0f} s",
              file=sys.stderr, flush=True)

    generate(tasks, backend, tokenizer, max_new_tokens=args.max_new_tokens, k=args.responses_per_turn,
             num_envs=args.num_envs, on_line=save, log=True)
    print(f"{len(tasks)} entries in {time.perf_counter() - start:.0f} s -> {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
