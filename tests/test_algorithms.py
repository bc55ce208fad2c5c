"""PPO / GRPO / GSPO / SeeUPO on the tabular policy: losses on a fixed batch, SeeUPO's schedule and M,
the registry and user plug-ins."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Sequence

import pytest
import torch

from seeupo_gym.algorithms import core
from seeupo_gym.algorithms.base import (
    Algorithm,
    UpdatePhase,
    available_algorithms,
    load_plugin,
    loss_share,
    make_algorithm,
    register_algorithm,
)
from seeupo_gym.algorithms.rollout import RolloutBatch, Trajectory, Turn
from seeupo_gym.algorithms.tabular import TabularPolicy, context_ids

torch.set_num_threads(1)


@dataclass
class TinyTask:
    """T turns of K options with an explicit reward table."""

    task_id: str
    turns: int
    options: int
    table: dict

    @property
    def num_turns(self) -> int:
        return self.turns

    @property
    def num_options(self) -> int:
        return self.options

    def reward(self, actions: Sequence[int]) -> float:
        return self.table.get(tuple(actions), 0.0)


class RecordingPolicy(TabularPolicy):
    """The real tabular learner, also recording each minibatch loss it minimizes (the sum of its parts'
    shares) and the order of the samples of each gradient forward (to observe minibatch shuffling)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.losses: list[float] = []
        self.forward_orders: list[list[tuple[str, int]]] = []

    def logprobs(self, samples, *, grad=True):
        if grad:
            self.forward_orders.append([(s.rollout_id, s.t) for s in samples])
        return super().logprobs(samples, grad=grad)

    def minimize(self, samples, loss, *, values=False):
        shares = []

        def recorded(part, new, vals):
            result = loss(part, new, vals)
            shares.append(float(loss_share(result)[0].detach()))
            return result

        metrics = super().minimize(samples, recorded, values=values)
        self.losses.append(sum(shares))
        return metrics


def trajectory(task_index: int, task: TinyTask, actions: tuple[int, ...], rid: str, group: str = "g", reward=None) -> Trajectory:
    turns = [Turn(context_ids(task_index, actions[:t]), [a], [-0.5]) for t, a in enumerate(actions)]
    r = task.reward(actions) if reward is None else reward
    return Trajectory(task.task_id, group, rid, turns, r, r == 1.0)


# One task, 2 turns, 2 options. r0 plays (0, 0) -> 1.0; r1 stops after one turn (a missing turn 2) with 0.0;
# r2 plays (0, 1) -> 0.5. One group: GRAE A = [0.5, -0.5, 0]; std 0.5, so group- and batch-normalized A = [1, -1, 0].
TASK = TinyTask("t", 2, 2, {(0, 0): 1.0, (0, 1): 0.5})


def fixed_setup(lr: float = 0.1) -> tuple[RecordingPolicy, RolloutBatch]:
    policy = RecordingPolicy([TASK], lr=lr)
    # Current policy differs from the reference (the zero table), so the KL term is not zero:
    # root row p = [0.75, 0.25]; row after choosing 0: p = [0.4, 0.6].
    with torch.no_grad():
        policy.logits[policy.index[(0,)]] = torch.tensor([math.log(3.0), 0.0])
        policy.logits[policy.index[(0, 0)]] = torch.tensor([math.log(0.4), math.log(0.6)])
    batch = RolloutBatch(
        [
            trajectory(0, TASK, (0, 0), "r0"),
            trajectory(0, TASK, (1,), "r1", reward=0.0),
            trajectory(0, TASK, (0, 1), "r2"),
        ]
    )
    return policy, batch


def k3(p_new: float, p_ref: float) -> float:
    d = math.log(p_ref) - math.log(p_new)
    return math.exp(d) - d - 1


# KL per turn sample of the fixed batch (reference is uniform, 0.5 everywhere).
KL = {("r0", 1): k3(0.75, 0.5), ("r0", 2): k3(0.4, 0.5), ("r1", 1): k3(0.25, 0.5), ("r2", 1): k3(0.75, 0.5), ("r2", 2): k3(0.6, 0.5)}
GEN = lambda: torch.Generator().manual_seed(0)  # noqa: E731


def test_grpo_loss_on_a_fixed_batch_is_the_token_mean_surrogate_plus_kl():
    policy, batch = fixed_setup()
    make_algorithm("grpo", {"kl_coef": 0.1, "minibatch_size": 64}).update(batch, policy, GEN())
    # First (only) minibatch: ratios are 1, so the surrogate is the token mean of A: (1 + 1 - 1 + 0 + 0) / 5.
    expected = -(1 + 1 - 1 + 0 + 0) / 5 + 0.1 * sum(KL.values()) / 5
    assert policy.losses == [pytest.approx(expected, abs=1e-6)]


def test_grpo_seq_mean_token_mean_aggregation_per_turn():
    policy, batch = fixed_setup()
    make_algorithm("grpo", {"kl_coef": 0.0, "loss_agg": "seq-mean-token-mean", "sequence": "turn"}).update(batch, policy, GEN())
    # One token per sample, so per-sample means are the advantages: (1 + 1 - 1 + 0 + 0) / 5 samples.
    assert policy.losses == [pytest.approx(-1 / 5, abs=1e-6)]


def test_grpo_seq_mean_token_mean_aggregation_per_trajectory():
    policy, batch = fixed_setup()
    make_algorithm("grpo", {"kl_coef": 0.0, "loss_agg": "seq-mean-token-mean"}).update(batch, policy, GEN())
    # Each trajectory's token mean is its A_i; group-centred advantages of one group sum to 0.
    assert policy.losses == [pytest.approx(0.0, abs=1e-6)]


def test_gspo_loss_on_a_fixed_batch_is_the_sample_mean_surrogate_plus_kl():
    policy, batch = fixed_setup()
    make_algorithm("gspo", {"kl_coef": 0.1}).update(batch, policy, GEN())
    expected = -(1 + 1 - 1 + 0 + 0) / 5 + 0.1 * sum(KL.values()) / 5
    assert policy.losses == [pytest.approx(expected, abs=1e-6)]


def test_seeupo_losses_on_a_fixed_batch_skip_the_missing_turn_and_carry_m():
    policy, batch = fixed_setup(lr=0.5)
    algo = make_algorithm("seeupo", {"kl_coef": 0.1, "order": "reverse"})
    before = policy.log_probs_table().clone()
    algo.update(batch, policy, GEN())
    assert [p.turn for p in algo.schedule] == [2, 1]
    # Pool 2 holds r0 and r2 only: no loss and no KL for r1's missing turn.
    pool2 = -(1 + 0) / 2 + 0.1 * (KL[("r0", 2)] + KL[("r2", 2)]) / 2
    # After pool 2's update, M_r0 = 1 * s(y_r0,2) with the updated table; r1 keeps -1; r2 stays 0.
    after = policy.log_probs_table()
    row = policy.index[(0, 0)]
    s_r0 = math.exp(float(after[row, 0] - before[row, 0]))
    assert algo.schedule[0].ratios_after["r0"] == pytest.approx(s_r0, rel=1e-6)
    assert "r1" not in algo.schedule[0].ratios_after
    assert algo.schedule[1].weights == pytest.approx({"r0": s_r0, "r1": -1.0, "r2": 0.0}, abs=1e-5)
    # Pool 1's rows were untouched by pool 2, so its ratios are 1 and its surrogate is the mean of M.
    pool1 = -(s_r0 - 1 + 0) / 3 + 0.1 * (KL[("r0", 1)] + KL[("r1", 1)] + KL[("r2", 1)]) / 3
    assert policy.losses == [pytest.approx(pool2, abs=1e-5), pytest.approx(pool1, abs=1e-5)]
    assert s_r0 > 1.0  # pool 2 raised the probability of r0's rewarded second choice


def test_ppo_loss_on_a_fixed_batch_uses_gae_over_turns_and_the_value_table():
    policy, batch = fixed_setup()
    with torch.no_grad():
        policy.value_table[policy.index[(0,)]] = 0.5
        policy.value_table[policy.index[(0, 0)]] = 0.2
    algo = make_algorithm("ppo", {"kl_coef": 0.1, "vf_coef": 0.5})
    assert algo.needs_value_model
    algo.update(batch, policy, GEN())
    # gamma = lambda = 1: A = R - V per token. r0: [0.5, 0.8]; r1: [-0.5]; r2: [0.0, 0.3].
    raw = [0.5, 0.8, -0.5, 0.0, 0.3]
    # Whitened advantages have token mean 0 (ratios are 1 in the first minibatch), so the surrogate is 0;
    # the value loss is 0.5 * mean((V - R)^2) = 0.5 * mean(A^2).
    value_loss = 0.5 * sum(a * a for a in raw) / 5
    expected = 0.0 + 0.5 * value_loss + 0.1 * sum(KL.values()) / 5
    assert policy.losses == [pytest.approx(expected, abs=1e-6)]
    whitened = [(a - statistics.mean(raw)) / statistics.stdev(raw) for a in raw]
    assert algo.schedule[0].weights["r0"] == pytest.approx(whitened[0], abs=1e-5)


@pytest.mark.parametrize("name", ["grpo", "gspo", "seeupo", "ppo"])
def test_every_algorithm_reuses_each_sample_epochs_times(name):
    policy, batch = fixed_setup()
    # SeeUPO's shared ratio rows ride along in a gradient pass without being trained on; that pass
    # is checked in test_seeupo_shared_ratio_pass_*.
    options = {"share_ratio_pass": False} if name == "seeupo" else {}
    make_algorithm(name, {"epochs": 3, "minibatch_size": 2, **options}).update(batch, policy, GEN())
    seen = [key for order in policy.forward_orders for key in order]
    assert sorted(seen) == sorted([(s.rollout_id, s.t) for s in batch.samples()] * 3)


def test_old_logprobs_are_recomputed_by_the_learner_not_taken_from_the_sampler():
    policy, batch = fixed_setup()
    # The sampler's logprobs (-0.5 everywhere) are wrong on purpose; ratios must still start at 1.
    metrics = make_algorithm("gspo", {"kl_coef": 0.0}).update(batch, policy, GEN())
    assert metrics["ratio_mean"] == pytest.approx(1.0)


# --- SeeUPO's schedule --------------------------------------------------------------------------------

TASKS3 = [TinyTask(f"t{k}", 3, 2, {(k % 2, 1, 0): 1.0, (1, 1, 1): 0.3}) for k in range(6)]


def pool_batch(policy: TabularPolicy) -> RolloutBatch:
    """Every task its own context rows; two groups; all trajectories have 3 turns, one has 2."""
    plays = [(0, 1, 0), (1, 1, 0), (1, 1, 1), (0, 0, 0), (1, 1, 0), (0, 1)]
    return RolloutBatch(
        [trajectory(k, TASKS3[k], a, f"r{k}", group="g" if k < 3 else "h") for k, a in enumerate(plays)]
    )


def test_reverse_order_updates_pools_3_2_1_and_multiplies_m_by_each_updated_turns_ratio():
    policy = RecordingPolicy(TASKS3, lr=0.5)
    algo = make_algorithm("seeupo", {"order": "reverse", "kl_coef": 0.0})
    seen: list[UpdatePhase] = []
    algo.on_phase = seen.append
    batch = pool_batch(policy)
    advantages = core.trajectory_advantages(batch, "batch")
    algo.update(batch, policy, GEN())
    assert [p.turn for p in algo.schedule] == [3, 2, 1] and seen == algo.schedule
    p3, p2, p1 = algo.schedule
    assert set(p3.rollout_ids) == {"r0", "r1", "r2", "r3", "r4"}  # r5 has no turn 3
    assert p3.weights == pytest.approx({rid: advantages[rid] for rid in p3.rollout_ids})
    for rid in batch.rollout_ids:
        m2 = advantages[rid] * p3.ratios_after.get(rid, 1.0)
        assert p2.weights[rid] == pytest.approx(m2)
        assert p1.weights[rid] == pytest.approx(m2 * p2.ratios_after[rid])
    assert any(abs(r - 1.0) > 1e-3 for r in p3.ratios_after.values())  # the factors really moved
    assert p1.ratios_after == {}  # nothing reads M after the last pool


def test_natural_order_updates_pools_1_2_3():
    policy = TabularPolicy(TASKS3, lr=0.5)
    algo = make_algorithm("seeupo", {"order": "natural", "kl_coef": 0.0})
    algo.update(pool_batch(policy), policy, GEN())
    assert [p.turn for p in algo.schedule] == [1, 2, 3]
    # r5 ends at turn 2: nothing reads its M after pool 2, so no ratio is computed for it there.
    assert "r5" in algo.schedule[0].ratios_after and "r5" not in algo.schedule[1].ratios_after
    assert algo.schedule[1].weights["r0"] == pytest.approx(
        algo.schedule[0].weights["r0"] * algo.schedule[0].ratios_after["r0"]
    )


def test_random_order_draws_a_fresh_permutation_each_step_from_the_generator():
    policy = TabularPolicy(TASKS3, lr=0.1)
    algo = make_algorithm("seeupo", {"order": "random", "kl_coef": 0.0})
    generator = torch.Generator().manual_seed(3)
    orders = []
    for _ in range(12):
        algo.update(pool_batch(policy), policy, generator)
        orders.append(tuple(p.turn for p in algo.schedule))
    assert all(sorted(o) == [1, 2, 3] for o in orders)
    assert len(set(orders)) > 2  # not a fixed order
    # Reproducible from the generator's seed.
    policy2, algo2, generator2 = TabularPolicy(TASKS3, lr=0.1), make_algorithm("seeupo", {"order": "random"}), torch.Generator().manual_seed(3)
    again = []
    for _ in range(12):
        algo2.update(pool_batch(policy2), policy2, generator2)
        again.append(tuple(p.turn for p in algo2.schedule))
    assert again == orders


def test_m_follows_its_trajectory_when_a_pool_is_shuffled_into_minibatches():
    lr = 0.3
    policy = RecordingPolicy(TASKS3, lr=lr)
    algo = make_algorithm("seeupo", {"order": "reverse", "kl_coef": 0.0, "minibatch_size": 1})
    batch = pool_batch(policy)
    before = policy.logits.detach().clone()
    probs_before = policy.log_probs_table().exp()
    algo.update(batch, policy, GEN())
    pool1_order = [rid for order in policy.forward_orders for rid, t in order if t == 1]
    assert pool1_order != sorted(pool1_order)  # the pool really was shuffled
    # With one sample per SGD step and a row per task, the chosen logit of turn 1 moved by exactly
    # lr * M_i * (1 - p): only M_i of the sample's own trajectory can have produced it.
    m = algo.schedule[-1].weights
    for k, t in enumerate(batch):
        row, action = policy.index[(k,)], t.turns[0].response_ids[0]
        moved = float(policy.logits.detach()[row, action] - before[row, action])
        assert moved == pytest.approx(lr * m[t.rollout_id] * (1 - float(probs_before[row, action])), abs=1e-6)


def test_step_start_and_turn_start_anchor_ratios_differently():
    # A context shared by every turn (all turns read the root row), so later pools move earlier ones.
    task = TinyTask("s", 3, 2, {(0, 0, 0): 1.0})

    def shared_batch() -> RolloutBatch:
        def traj(rid, actions, reward):
            return Trajectory("s", "g", rid, [Turn([0], [a], [-0.7]) for a in actions], reward, reward == 1.0)

        return RolloutBatch([traj("a", (0, 0, 0), 1.0), traj("b", (1, 1, 0), 0.0), traj("c", (0, 1, 1), 0.0)])

    results = {}
    for mode in ("step_start", "turn_start"):
        policy = TabularPolicy([task], lr=0.5)
        snapshots = {}
        algo = make_algorithm("seeupo", {"old_policy": mode, "kl_coef": 0.0})
        start = policy.log_probs_table()[0].clone()
        algo.on_phase = lambda phase: snapshots.__setitem__(phase.turn, policy.log_probs_table()[0].clone())
        algo.update(shared_batch(), policy, GEN())
        results[mode] = (algo.schedule, snapshots, start)
    schedule, snaps, start = results["step_start"]
    # Pool 2's ratio after its update is against theta_k (the start of the step) ...
    a = 0  # trajectory "a" chose option 0 at turn 2
    assert schedule[1].ratios_after["a"] == pytest.approx(math.exp(float(snaps[2][a] - start[a])), rel=1e-5)
    schedule, snaps, start = results["turn_start"]
    # ... or, with turn_start, against the parameters just before pool 2's update (after pool 3's).
    assert schedule[1].ratios_after["a"] == pytest.approx(math.exp(float(snaps[2][a] - snaps[3][a])), rel=1e-5)


def test_m_clip_bounds_the_importance_factor_but_keeps_the_sign():
    policy = TabularPolicy(TASKS3, lr=5.0)
    algo = make_algorithm("seeupo", {"m_clip": [0.9, 1.1], "kl_coef": 0.0})
    batch = pool_batch(policy)
    advantages = core.trajectory_advantages(batch, "batch")
    algo.update(batch, policy, GEN())
    factors = [w / advantages[rid] for phase in algo.schedule for rid, w in phase.weights.items() if advantages[rid] != 0]
    assert factors and all(0.9 - 1e-9 <= f <= 1.1 + 1e-9 for f in factors)


@pytest.mark.parametrize(
    "name,options,match",
    [
        ("seeupo", {"order": "backwards"}, "order"),
        ("seeupo", {"normalization": "turn"}, "normalization"),
        ("seeupo", {"old_policy": "before"}, "old_policy"),
        ("seeupo", {"m_clip": [1.2, 0.8]}, "m_clip"),
        ("grpo", {"epochs": 0}, "epochs"),
        ("grpo", {"lr": 1.0}, "unknown algorithm option"),
        ("ppo", {"gamma": 2.0}, "gamma"),
    ],
)
def test_bad_algorithm_config_is_a_clear_error(name, options, match):
    with pytest.raises(ValueError, match=match):
        make_algorithm(name, options)


def test_the_four_algorithms_are_registered():
    assert {"ppo", "grpo", "gspo", "seeupo"} <= set(available_algorithms())
    with pytest.raises(ValueError, match="unknown algorithm"):
        make_algorithm("nope")


# --- user algorithms ----------------------------------------------------------------------------------


@register_algorithm("test-reinforce")
class Reinforce(Algorithm):
    """A user algorithm from the shared parts: sequence-level REINFORCE with GRAE, one step."""

    def update(self, batch, learner, generator):
        self.schedule = []
        advantages = core.trajectory_advantages(batch, "none")
        samples = batch.samples()
        new = learner.logprobs(samples)
        weights = core.per_sample(advantages, samples, new.logprobs)
        loss = -(core.masked_mean(new.logprobs, new.mask, dim=-1) * weights).mean()
        learner.optimize(loss)
        self.record_phase(UpdatePhase(None, tuple(batch.rollout_ids), advantages, 1))
        return {"loss": float(loss.detach())}


def test_a_user_algorithm_from_a_test_file_registers_and_updates_the_tabular_policy():
    policy, batch = fixed_setup()
    algo = make_algorithm("test-reinforce")
    assert isinstance(algo, Reinforce) and "test-reinforce" in available_algorithms()
    before = policy.probs(0, (0,))[0]
    algo.update(batch, policy, GEN())
    assert policy.probs(0, (0,))[0] > before  # (0, 0) earned the top reward


def test_a_user_algorithm_file_loads_as_a_plugin(tmp_path):
    plugin = tmp_path / "my_algo.py"
    plugin.write_text(
        "from seeupo_gym.algorithms.base import Algorithm, register_algorithm\n"
        "@register_algorithm('test-plugin-noop')\n"
        "class Noop(Algorithm):\n"
        "    def update(self, batch, learner, generator):\n"
        "        return {'noop': 1.0}\n"
    )
    load_plugin(plugin)
    policy, batch = fixed_setup()
    # Its update runs behind the kit's selection, which reports what it left out.
    assert make_algorithm("test-plugin-noop").update(batch, policy, GEN()) == {"noop": 1.0, "never_started": 0.0}
    with pytest.raises(FileNotFoundError):
        load_plugin(tmp_path / "missing.py")


def test_loading_a_plugin_file_twice_registers_its_algorithm_once(tmp_path):
    from seeupo_gym.algorithms.base import available_algorithms, load_plugin

    plugin = tmp_path / "twice_plugin.py"
    plugin.write_text(
        "from seeupo_gym.algorithms.base import Algorithm, register_algorithm\n"
        "@register_algorithm('loaded-twice')\n"
        "class LoadedTwice(Algorithm):\n"
        "    def update(self, batch, learner, generator):\n"
        "        return {}\n"
    )
    load_plugin(plugin)
    load_plugin(str(plugin))
    assert "loaded-twice" in available_algorithms()
