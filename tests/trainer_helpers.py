"""Shared builders for the trainer / learner tests (not a test module)."""

from __future__ import annotations

import math
import random

import gymnasium as gym

from pathlib import Path

from seeupo_gym.training.config import PRESETS_DIR

ROOT = Path(__file__).resolve().parent.parent

import torch

from seeupo_gym.training.config import Config, load_config
from seeupo_gym.algorithms.rollout import RolloutBatch, Trajectory, Turn


def synthetic_batch(
    num_tasks: int = 2, group_size: int = 2, max_turns: int = 3, seed: int = 0, vocab: int = 1000
) -> RolloutBatch:
    """A RolloutBatch of random token ids: turn t's context extends turn t-1's context and response.

    Trajectories have 1..max_turns turns and rewards in [0, 1], so groups have spread and
    turn pools differ in size (what SeeUPO's schedule depends on).
    """
    rng = random.Random(seed)
    trajectories = []
    for task in range(num_tasks):
        for g in range(group_size):
            context = [rng.randrange(vocab) for _ in range(rng.randint(3, 8))]
            turns = []
            for _ in range(rng.randint(1, max_turns)):
                response = [rng.randrange(vocab) for _ in range(rng.randint(1, 6))]
                turns.append(Turn(list(context), response, [0.0] * len(response)))
                context = context + response + [rng.randrange(vocab) for _ in range(rng.randint(1, 4))]
            trajectories.append(
                Trajectory(
                    task_id=f"task{task}",
                    group_id=f"task{task}",
                    rollout_id=f"task{task}-{g}",
                    turns=turns,
                    reward=rng.random(),
                    success=False,
                )
            )
    return RolloutBatch(trajectories)


# --------------------------------------------------------------------------- a shaped BFCL env

SHAPED_BFCL_ID = "test/BFCL-v4-length-shaped-v0"


class LengthShapedReward(gym.Wrapper):
    """The real BFCL env with a small bonus for longer responses added to the final reward.

    The tiny random model never solves a BFCL task, so every reward would be 0 and every
    advantage 0; the bonus (at most 0.1) gives rollouts of one task different rewards, so an
    update has a signal. Everything else (data, tools, checker, messages) is the real env.
    """

    def reset(self, **kwargs):
        self._chars = 0
        return self.env.reset(**kwargs)

    def step(self, action):
        self._chars += len(action)
        observation, reward, terminated, truncated, info = self.env.step(action)
        if terminated or truncated:
            reward = float(reward) + 0.1 * math.tanh(self._chars / 100)
        return observation, reward, terminated, truncated, info


def make_shaped_bfcl(**kwargs) -> gym.Env:
    import seeupo_gym  # noqa: F401

    return LengthShapedReward(gym.make("seeupo/BFCL-v4-v0", **kwargs))


if SHAPED_BFCL_ID not in gym.registry:
    gym.register(SHAPED_BFCL_ID, entry_point=make_shaped_bfcl)


# --------------------------------------------------------------------------- trainer configs

# The BFCL tasks with the shortest prompts (~1.5k tokens), to keep the CPU tests fast.
SHORT_TASKS = ["multi_turn_miss_func_146", "multi_turn_miss_func_121"]


def tiny_config(tmp_path: Path, *overrides: str) -> Config:
    """The tiny-cpu preset on the length-shaped BFCL env, 1 task x 2 rollouts, 4 new tokens."""
    return load_config(
        PRESETS_DIR / "tiny-cpu.yaml",
        [
            f"log.output_dir={tmp_path / 'run'}",
            "log.trackers=[]",
            "log.progress_bars=false",
            f"env.id={SHAPED_BFCL_ID}",
            f"plugins=[{__file__}]",
            f"env.train_tasks=[{', '.join(SHORT_TASKS)}]",
            "env.kwargs={max_turns: 2}",
            "train.tasks_per_step=1",
            "train.group_size=2",
            "sampling.max_new_tokens=4",
            "train.save_every=0",
            *overrides,
        ],
    )


def trainable_changed(model: torch.nn.Module) -> float:
    """Largest absolute change of any weight against the tiny model's initial weights."""
    from seeupo_gym.agents.models import load_model

    initial, _ = load_model("tiny", seed=0)
    start = dict(initial.named_parameters())
    changed = 0.0
    for name, param in model.named_parameters():
        name = name.removeprefix("module.")
        # The trained model may sit on a GPU and in another dtype; the snapshot is on CPU in fp32.
        current = param.detach().to(device="cpu", dtype=torch.float32)
        changed = max(changed, float((current - start[name].detach().float()).abs().max()))
    return changed
