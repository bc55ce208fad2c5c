"""A per-turn advantage as a seeupo-gym plug-in: reward-to-go with a per-turn leave-one-out baseline.

    .venv/bin/python scripts/credit_study.py --plugin docs/examples/turn_credit_plugin.py --methods grpo
    seeupo-train --config tiny-cpu --plugin docs/examples/turn_credit_plugin.py algorithm.name=reward_to_go

`TurnAdvantageAlgorithm` (algorithms/turn_credit.py) owns the update (GRPO's clipped token loss with
each turn's advantage on its tokens); a method only says what each turn's advantage is. Here turn t
of trajectory i gets its reward-to-go G_{i,t} = r_{i,t} + ... + r_{i,T} minus the mean reward-to-go at
turn t of the other rollouts of its task that reached turn t (0 when none did).

The keys are `(rollout_id, turn)` with turn 1-based, as `TurnSample.t` and `core.sample_key` give them:
every sample of the batch needs one, or the update raises a KeyError naming the missing key.
"""

from __future__ import annotations

from seeupo_gym.algorithms import core
from seeupo_gym.algorithms.base import register_algorithm
from seeupo_gym.algorithms.turn_credit import TurnAdvantageAlgorithm, discounted_returns, turn_rewards


@register_algorithm("reward_to_go")
class RewardToGo(TurnAdvantageAlgorithm):
    def turn_advantages(self, batch, learner) -> dict[core.SampleKey, float]:
        advantages = {}
        for members in batch.groups().values():
            to_go = {t.rollout_id: discounted_returns(turn_rewards(t), 1.0) for t in members}
            for trajectory in members:
                for turn in range(1, trajectory.num_turns + 1):  # 1-based, as the keys
                    others = [g[turn - 1] for rid, g in to_go.items() if rid != trajectory.rollout_id and len(g) >= turn]
                    baseline = sum(others) / len(others) if others else 0.0
                    advantages[(trajectory.rollout_id, turn)] = to_go[trajectory.rollout_id][turn - 1] - baseline
        return advantages
