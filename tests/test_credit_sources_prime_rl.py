"""`prime_rl_turn_credit` against a transcription of PrimeIntellect-ai/prime-rl
0d6024432d2d62ebfc5f7c99a6a1fea45139a91b src/prime_rl/orchestrator/algo/turn_credit.py (`deltas`,
`smear`, `TurnCreditAlgorithm.score_group`, `_token_advantages`), written from the source in plain
python with its names and control flow (one branch of nodes, a token mask); our code is not called."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest

from credit_source_batches import max_abs_difference, random_batch, step_rewards
from seeupo_gym.algorithms.base import make_algorithm
from seeupo_gym.algorithms.rollout import RolloutBatch, Trajectory, Turn

ENV_TOKENS = 2


def deltas(phis):
    out = [0.0] * len(phis)
    last = None
    for i, phi in enumerate(phis):
        if phi is None:
            continue
        if last is not None:
            out[i] = phi - last
        last = phi
    return out


def smear(progress, gamma):
    n = len(progress)
    values = []
    for t, r in enumerate(progress, start=1):
        z = t if gamma == 1.0 else (1.0 - gamma**t) / (1.0 - gamma)
        values.append(r / z)
    credits = [0.0] * n
    acc = 0.0
    for t in range(n - 1, -1, -1):
        acc = values[t] + gamma * acc
        credits[t] = acc
    return credits


@dataclass
class Node:
    token_ids: list
    sampled: bool


@dataclass
class Rollout:
    reward: float
    nodes: list
    info: dict = field(default_factory=dict)
    advantages: object = None

    def assign_advantages(self, advantages):
        self.advantages = advantages


def iter_trainable_branches(rollout):
    mask = [1 if node.sampled else 0 for node in rollout.nodes for _ in node.token_ids]
    yield rollout, mask  # one chain: the rollout is its only branch


class TurnCreditAlgorithm:
    def __init__(self, gamma, beta):
        self.gamma, self.beta = gamma, beta

    def score_group(self, group):
        turn_scores = [rollout.info.get("turn_rewards") for rollout in group]
        progress = [sum(deltas(scores)) if scores is not None else 0.0 for scores in turn_scores]
        returns = [rollout.reward + net for rollout, net in zip(group, progress)]
        baseline = sum(returns) / len(returns)
        for rollout, scores, ret in zip(group, turn_scores, returns):
            level = ret - baseline
            if scores is None or self.beta == 0.0:
                rollout.assign_advantages(level)
            else:
                rollout.assign_advantages(self._token_advantages(rollout, scores, level))

    def _token_advantages(self, rollout, scores, level):
        turn_index = {}
        for node in rollout.nodes:
            if node.sampled:
                turn_index[id(node)] = len(turn_index)
        branches = list(iter_trainable_branches(rollout))
        credits, weights = {}, {}
        for branch, mask in branches:
            chain = [node for node in branch.nodes if node.sampled]
            chain_credits = smear(deltas([scores[turn_index[id(node)]] for node in chain]), self.gamma)
            position = {id(node): i for i, node in enumerate(chain)}
            offset = 0
            for node in branch.nodes:
                span = len(node.token_ids)
                if node.sampled and id(node) not in credits:
                    trainable = sum(mask[offset : offset + span])
                    if trainable:
                        credits[id(node)] = chain_credits[position[id(node)]]
                        weights[id(node)] = trainable
                offset += span
        total_weight = sum(weights.values())
        if total_weight == 0:
            return []
        center = sum(credits[key] * weights[key] for key in credits) / total_weight
        stream = []
        for branch, mask in branches:
            offset = 0
            for node in branch.nodes:
                span = len(node.token_ids)
                credit = credits.get(id(node))
                for i in range(offset, offset + span):
                    if mask[i] and credit is not None:
                        stream.append(level + self.beta * (credit - center))
                    else:
                        stream.append(0.0)
                offset += span
        return stream


def prime_rl(batch, gamma, beta, scores):
    """Per (rollout_id, t) with tokens: the source's advantage on the turn's tokens (all equal)."""
    out = {}
    for group in batch.groups().values():
        rollouts, layouts = [], []
        for trajectory in group:
            nodes, spans, offset = [], [], 0
            for turn in trajectory.turns:
                nodes.append(Node([0] * ENV_TOKENS, False))
                offset += ENV_TOKENS
                nodes.append(Node(list(turn.response_ids), True))
                spans.append((offset, offset + turn.num_response_tokens))
                offset += turn.num_response_tokens
            info = {}
            if trajectory.info.get("turn_rewards") is not None:
                # Mapping: our per-turn increments become state scores (cumulative) or pass as given.
                r = step_rewards(trajectory)
                info["turn_rewards"] = r if scores == "given" else [sum(r[: t + 1]) for t in range(len(r))]
            rollouts.append(Rollout(trajectory.reward, nodes, info))
            layouts.append(spans)
        TurnCreditAlgorithm(gamma, beta).score_group(rollouts)
        for trajectory, rollout, spans in zip(group, rollouts, layouts):
            for t, (start, end) in enumerate(spans, start=1):
                if start == end:
                    continue  # no token carries this turn's advantage there
                if isinstance(rollout.advantages, float):
                    out[(trajectory.rollout_id, t)] = rollout.advantages
                else:
                    values = rollout.advantages[start:end]
                    assert all(v == values[0] for v in values)
                    out[(trajectory.rollout_id, t)] = values[0]
    return out


def _with_tokens(advantages, batch):
    return {k: v for k, v in advantages.items() if batch[k[0]].turns[k[1] - 1].num_response_tokens}


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("gamma,beta", [(0.9, 1.0), (1.0, 0.5), (0.0, 2.0), (0.9, 0.0)])
@pytest.mark.parametrize("scores", ["cumulative", "given"])
def test_prime_rl_turn_credit_equals_prime_rl_turn_credit_algorithm(seed, gamma, beta, scores):
    batch = random_batch(seed, empty_turns=seed % 2 == 0, dense=seed % 3 == 1)
    options = {"gamma": gamma, "beta": beta, "scores": scores}
    ours = make_algorithm("prime_rl_turn_credit", options).turn_advantages(batch, learner=None)
    assert max_abs_difference(_with_tokens(ours, batch), prime_rl(batch, gamma, beta, scores)) < 1e-9


def test_prime_rl_defaults_are_the_source_defaults():
    config = make_algorithm("prime_rl_turn_credit", {}).config
    assert (config.gamma, config.beta, config.scores) == (0.9, 1.0, "cumulative")


def test_prime_rl_turn_credit_shift_is_zero_sum_over_tokens_and_a_group_of_one_trains_on_shaping_alone():
    # One rollout, turns of 1, 2, 1 tokens, rewards [0.5, 0, 1]: progress (0, 0, 1), gamma 1:
    # v = (0, 0, 1/3), credits (1/3, 1/3, 1/3): all equal, so the shift is 0. With gamma 0: (0, 0, 1).
    turns = [Turn([0], [1], [0.0]), Turn([0], [1, 2], [0.0, 0.0]), Turn([0], [3], [0.0])]
    batch = RolloutBatch([Trajectory("t", "g", "a", turns, 1.5, True, info={"turn_rewards": [0.5, 0.0, 1.0]})])
    flat = make_algorithm("prime_rl_turn_credit", {"gamma": 1.0}).turn_advantages(batch, learner=None)
    assert all(v == pytest.approx(0.0) for v in flat.values())
    sharp = make_algorithm("prime_rl_turn_credit", {"gamma": 0.0}).turn_advantages(batch, learner=None)
    center = 1 / 4  # token-weighted mean of (0, 0, 1) with weights (1, 2, 1)
    assert sharp[("a", 3)] == pytest.approx(1 - center) and sharp[("a", 1)] == pytest.approx(-center)
    assert math.isclose(sum(sharp[("a", t)] * w for t, w in [(1, 1), (2, 2), (3, 1)]), 0.0, abs_tol=1e-12)
