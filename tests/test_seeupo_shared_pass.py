"""SeeUPO's ratios after pool t measured inside the next pool's first gradient pass: the same
update as a separate frozen pass, with one policy pass fewer per pool (tiny model, real learner);
and M as the paper's Algorithm 1 whatever the learner reports or cuts (tabular policy)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from accelerate import Accelerator
from trainer_helpers import synthetic_batch

from seeupo_gym.agents.models import load_model
from seeupo_gym.algorithms.base import make_algorithm
from seeupo_gym.algorithms.rollout import RolloutBatch, Trajectory, Turn
from seeupo_gym.algorithms.tabular import TabularPolicy
from seeupo_gym.training.learner import LLMLearner, frozen_copy


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", seed=0)


def run(tiny, options: dict):
    model = copy.deepcopy(tiny[0])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    learner = LLMLearner(Accelerator(cpu=True), model, optimizer, pad_token_id=tiny[1].pad_token_id,
                         reference=frozen_copy(model), max_tokens_per_microbatch=128)
    algorithm = make_algorithm("seeupo", {"kl_coef": 0.01, **options})
    batch = synthetic_batch(num_tasks=2, group_size=3, max_turns=3, seed=4)
    algorithm.update(batch, learner, torch.Generator().manual_seed(0))
    return algorithm.schedule, model, learner.tokens_fed["policy"]


@pytest.mark.parametrize("options", [
    {"order": "reverse"},
    {"order": "natural", "m_clip": [0.8, 1.2]},
    {"order": "reverse", "epochs": 2, "minibatch_size": 2, "old_policy": "turn_start"},
])
def test_shared_ratio_pass_gives_the_unshared_update_with_fewer_policy_tokens(tiny, options):
    shared, model_shared, tokens_shared = run(tiny, {**options, "share_ratio_pass": True})
    apart, model_apart, tokens_apart = run(tiny, {**options, "share_ratio_pass": False})
    assert [p.turn for p in shared] == [p.turn for p in apart] and len(shared) >= 2
    for a, b in zip(shared, apart):
        assert a.rollout_ids == b.rollout_ids and a.optimizer_steps == b.optimizer_steps
        assert a.ratios_after.keys() == b.ratios_after.keys()
        for rid in a.ratios_after:
            assert a.ratios_after[rid] == pytest.approx(b.ratios_after[rid], rel=1e-6)
        for rid in a.weights:
            assert a.weights[rid] == pytest.approx(b.weights[rid], rel=1e-6, abs=1e-9)
    assert any(abs(r - 1) > 1e-3 for p in apart for r in p.ratios_after.values())  # M really moved
    for p, q in zip(model_shared.parameters(), model_apart.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)
    if "minibatch_size" in options:  # only the pool's first minibatch shares: it may hold none of them
        assert tokens_shared <= tokens_apart
    else:
        assert tokens_shared < tokens_apart


# --------------------------------------------------------------------------- any learner, any cut
# SeeUPO on the tabular policy against the paper's Algorithm 1 written out here (reverse order,
# step_start ratios, batch-normalized GRAE, one SGD step per pool, no KL): M must be the same whether
# the learner reports its parts' diagnostics or not, and whatever it cuts.



class ThreeTurns:
    num_turns, num_options = 3, 3

    def __init__(self, task_id):
        self.task_id = task_id

    def reward(self, actions):
        return 0.0


TASKS = [ThreeTurns("t0"), ThreeTurns("t1")]
PLAYS = {  # rollout_id: (task index, choices, reward); r3 and r5 stop early
    "r0": (0, (0, 1, 2), 1.0), "r1": (0, (1, 1, 0), 0.0), "r2": (0, (2, 0), 0.5),
    "r3": (1, (0, 2, 1), 0.2), "r4": (1, (1, 0, 0), 0.9), "r5": (1, (2,), 0.0),
}
LR, CLIP = 2.0, 0.2


def tabular_batch() -> RolloutBatch:
    return RolloutBatch([
        Trajectory(TASKS[k].task_id, TASKS[k].task_id, rid,
                   [Turn([k, *plays[:t]], [a], [math.log(1 / 3)]) for t, a in enumerate(plays)], reward, False)
        for rid, (k, plays, reward) in PLAYS.items()
    ])


def reference_seeupo(
    index: dict, order=(3, 2, 1), placeholders: bool = False, plays: dict | None = None, pool_lr=None,
    options: int = 3, adam_lr: float | None = None,
) -> tuple[torch.Tensor, list[dict[str, float]], list[dict[str, float]]]:
    """Final logits, M before each pool and s(y) after each pool (for trajectories with a later pool).

    `plays`: rollout_id -> (task index, choices, reward), PLAYS by default. Episodes of different
    lengths (PLAYS' r2: 2 turns, r5: 1): pool t holds the trajectories that reached turn t, and its
    loss is their mean. placeholders=True is the paper's alternative: every trajectory is in every
    pool, one that ended before t as a no-op (no gradient, s = 1), so the loss is divided by all N
    trajectories instead. `pool_lr(pool size, N)`: pool t's SGD step size (LR by default); `options`: K;
    `adam_lr`: one torch Adam step per pool instead of SGD."""
    PLAYS = plays or globals()["PLAYS"]
    rewards = {rid: r for rid, (_, _, r) in PLAYS.items()}
    groups = {rid: k for rid, (k, _, _) in PLAYS.items()}
    grae = {}
    for rid in PLAYS:
        mates = [rewards[j] for j in PLAYS if groups[j] == groups[rid]]
        grae[rid] = rewards[rid] - sum(mates) / len(mates)
    mean = sum(grae.values()) / len(grae)
    std = (sum((a - mean) ** 2 for a in grae.values()) / (len(grae) - 1)) ** 0.5
    m = {rid: (a - mean) / (std + 1e-6) for rid, a in grae.items()}
    logits = torch.zeros(len(index), options, dtype=torch.float32)

    def logp(table, rid, t):
        k, plays, _ = PLAYS[rid]
        return torch.log_softmax(table[index[(k, *plays[: t - 1])]], -1)[plays[t - 1]]

    start = logits.clone()
    adam_table = logits.clone().requires_grad_(True)
    adam = torch.optim.Adam([adam_table], lr=adam_lr) if adam_lr else None
    weights, ratios = [], []
    for position, t in enumerate(order):
        pool = [rid for rid, (_, plays, _) in PLAYS.items() if len(plays) >= t]
        weights.append({rid: m[rid] for rid in pool})
        table = adam_table if adam_lr else logits.clone().requires_grad_(True)
        objective = 0.0
        for rid in pool:
            s = torch.exp(logp(table, rid, t) - logp(start, rid, t))
            objective = objective + torch.minimum(s * m[rid], torch.clamp(s, 1 - CLIP, 1 + CLIP) * m[rid])
        (-objective / (len(PLAYS) if placeholders else len(pool))).backward()
        if adam_lr:
            adam.step()
            adam.zero_grad()
            logits = adam_table.detach().clone()
        else:
            logits = logits - (pool_lr(len(pool), len(PLAYS)) if pool_lr else LR) * table.grad
        # s(y_{i,t}) is read by M_i only if trajectory i has a turn in a later pool (an episode that
        # ended is in none: its M keeps the s = 1 of a placeholder).
        later = [rid for rid in pool if any(len(PLAYS[rid][1]) >= u for u in order[position + 1 :])]
        after = {rid: float(torch.exp(logp(logits, rid, t) - logp(start, rid, t))) for rid in later}
        ratios.append(after)
        for rid, s in after.items():
            m[rid] *= s
    return logits, weights, ratios


class QuietLearner:
    """A learner of its own (the tabular policy inside) whose `minimize` returns its own metrics only,
    not its parts' diagnostics; it says nothing of `measures_alongside`."""

    def __init__(self, policy: TabularPolicy) -> None:
        self.policy = policy

    def logprobs(self, samples, *, grad=True):
        return self.policy.logprobs(samples, grad=grad)

    def ref_logprobs(self, samples):
        return self.policy.ref_logprobs(samples)

    def minimize(self, samples, loss, *, values=False):
        return {"grad_norm": self.policy.minimize(samples, loss)["grad_norm"]}


@pytest.mark.parametrize("learner", ["tabular", "cut into single samples", "reports no diagnostics"])
def test_m_follows_algorithm_1_whatever_the_learner_reports_or_cuts(learner):
    policy = TabularPolicy(TASKS, lr=LR, microbatch_samples=1 if learner == "cut into single samples" else None)
    target = QuietLearner(policy) if learner == "reports no diagnostics" else policy
    algorithm = make_algorithm("seeupo", {"kl_coef": 0.0, "clip_low": CLIP, "clip_high": CLIP})
    algorithm.update(tabular_batch(), target, torch.Generator().manual_seed(0))
    logits, weights, ratios = reference_seeupo(policy.index)
    assert [p.turn for p in algorithm.schedule] == [3, 2, 1]
    for phase, expected_m, expected_s in zip(algorithm.schedule, weights, ratios):
        assert phase.weights == pytest.approx(expected_m, rel=1e-5)
        assert phase.ratios_after == pytest.approx(expected_s, rel=1e-5)
    assert any(abs(s - 1) > 0.05 for after in ratios for s in after.values())  # M really moved
    torch.testing.assert_close(policy.logits.detach(), logits, atol=1e-5, rtol=1e-5)


def test_a_learner_that_claims_to_measure_alongside_but_drops_the_ratios_is_an_error():
    class Claiming(QuietLearner):
        measures_alongside = True

    algorithm = make_algorithm("seeupo", {"kl_coef": 0.0})
    with pytest.raises(RuntimeError, match="measures_alongside"):
        algorithm.update(tabular_batch(), Claiming(TabularPolicy(TASKS, lr=LR)), torch.Generator().manual_seed(0))


def test_on_phase_sees_the_ratios_after_the_pool_it_reports():
    policy = TabularPolicy(TASKS, lr=LR)
    seen: list[tuple[int, dict[str, float]]] = []
    algorithm = make_algorithm("seeupo", {"kl_coef": 0.0, "clip_low": CLIP, "clip_high": CLIP})
    algorithm.on_phase = lambda phase: seen.append((phase.turn, dict(phase.ratios_after)))
    algorithm.update(tabular_batch(), policy, torch.Generator().manual_seed(0))
    _, _, ratios = reference_seeupo(policy.index)
    assert [turn for turn, _ in seen] == [3, 2, 1]
    for (_, after), expected in zip(seen, ratios):
        assert after == pytest.approx(expected, rel=1e-5)
    assert seen[0][1] and seen[1][1] and seen[2][1] == {}  # filled where a later pool reads them


def test_on_phase_runs_with_the_parameters_right_after_its_pool():
    # The callback comes before the next pool's first step, not after it.
    policy = TabularPolicy(TASKS, lr=LR)
    snapshots = {}
    algorithm = make_algorithm("seeupo", {"kl_coef": 0.0})
    algorithm.on_phase = lambda phase: snapshots.__setitem__(phase.turn, policy.logits.detach().clone())
    algorithm.update(tabular_batch(), policy, torch.Generator().manual_seed(0))
    logits, _, _ = reference_seeupo(policy.index)
    torch.testing.assert_close(snapshots[1], logits, atol=1e-5, rtol=1e-5)
    assert not torch.equal(snapshots[3], snapshots[2])


@pytest.mark.parametrize("order", ["reverse", "natural"])
def test_episodes_that_end_early_are_absent_from_later_pools_as_algorithm_1_with_early_ends(order):
    """Trajectories of 3, 2 and 1 turns: pool t is the trajectories that reached turn t, its loss
    their mean, and an ended trajectory's M never moves again. The paper's placeholders (all N in
    every pool, the ended ones as no-ops) would divide pool t's loss by N: a different update."""
    turns = (3, 2, 1) if order == "reverse" else (1, 2, 3)
    policy = TabularPolicy(TASKS, lr=LR)
    algorithm = make_algorithm("seeupo", {"kl_coef": 0.0, "clip_low": CLIP, "clip_high": CLIP, "order": order})
    algorithm.update(tabular_batch(), policy, torch.Generator().manual_seed(0))
    logits, weights, ratios = reference_seeupo(policy.index, order=turns)
    assert [p.turn for p in algorithm.schedule] == list(turns)
    for phase, expected_m, expected_s in zip(algorithm.schedule, weights, ratios):
        assert set(phase.rollout_ids) == set(expected_m)  # absent, not placeholders
        assert phase.weights == pytest.approx(expected_m, rel=1e-5)
        assert phase.ratios_after == pytest.approx(expected_s, rel=1e-5)
    assert sorted(len(m) for m in weights) == [4, 5, 6]  # the pools really shrink
    torch.testing.assert_close(policy.logits.detach(), logits, atol=1e-5, rtol=1e-5)
    with_placeholders, _, _ = reference_seeupo(policy.index, order=turns, placeholders=True)
    assert (with_placeholders - logits).abs().max() > 1e-2


def test_placeholders_are_the_kits_update_with_each_pools_step_scaled_by_its_share_of_the_batch():
    """Why absent and placeholders agree: a no-op placeholder adds a constant (s = 1, no gradient) to
    pool t's objective and nothing to M, so its update is the kit's direction with a step |D_t|/N as
    large. Scaling the placeholder reference's step by N/|D_t| gives the kit's update exactly."""
    policy = TabularPolicy(TASKS, lr=LR)
    algorithm = make_algorithm("seeupo", {"kl_coef": 0.0, "clip_low": CLIP, "clip_high": CLIP})
    algorithm.update(tabular_batch(), policy, torch.Generator().manual_seed(0))
    rescaled, weights, ratios = reference_seeupo(policy.index, placeholders=True, pool_lr=lambda size, n: LR * n / size)
    torch.testing.assert_close(policy.logits.detach(), rescaled, atol=1e-5, rtol=1e-5)
    for phase, expected_m, expected_s in zip(algorithm.schedule, weights, ratios):
        assert phase.weights == pytest.approx(expected_m, rel=1e-5)
        assert phase.ratios_after == pytest.approx(expected_s, rel=1e-5)


def test_under_adam_the_kits_update_is_the_placeholder_form_where_each_parameter_serves_one_turn():
    """Adam divides a parameter's step by its gradients' scale: on the tabular policy (one row per
    context, so per turn) the placeholder form's |D_t|/N vanishes from the update."""
    policy = TabularPolicy(TASKS, lr=0.1, optimizer="adam")
    algorithm = make_algorithm("seeupo", {"kl_coef": 0.0, "clip_low": CLIP, "clip_high": CLIP})
    algorithm.update(tabular_batch(), policy, torch.Generator().manual_seed(0))
    absent, _, _ = reference_seeupo(policy.index, adam_lr=0.1)
    with_placeholders, _, _ = reference_seeupo(policy.index, placeholders=True, adam_lr=0.1)
    torch.testing.assert_close(policy.logits.detach(), absent, atol=1e-6, rtol=1e-6)
    assert (with_placeholders - absent).abs().max() < 1e-6 < 0.1 < absent.abs().max()


@pytest.mark.parametrize("order", ["reverse", "natural"])
def test_algorithm_1_with_early_ends_on_a_sampled_batch_of_turnbandit_stopping_tasks(order):
    """Real stopping tasks (a stop option at every turn), a sampled batch whose episodes end at 1..T
    turns: the kit's update is the reference's, pool by pool."""
    from seeupo_gym.algorithms.tabular import sample_batch
    from seeupo_gym.turnbandit import make_tasks

    tasks = make_tasks("stopping", 4, seed=3, turns=(3, 4))
    policy = TabularPolicy(tasks, lr=LR)
    batch = sample_batch(policy, 6, torch.Generator().manual_seed(1))
    plays = {t.rollout_id: (int(t.turns[0].context_ids[0]), tuple(turn.response_ids[0] for turn in t.turns), t.reward)
             for t in batch}
    assert len({len(choices) for _, choices, _ in plays.values()}) >= 3  # several lengths, 1 among them
    assert min(len(choices) for _, choices, _ in plays.values()) == 1
    longest = max(t.num_turns for t in tasks)
    turns = tuple(range(longest, 0, -1)) if order == "reverse" else tuple(range(1, longest + 1))
    algorithm = make_algorithm("seeupo", {"kl_coef": 0.0, "clip_low": CLIP, "clip_high": CLIP, "order": order})
    algorithm.update(batch, policy, torch.Generator().manual_seed(0))
    logits, weights, ratios = reference_seeupo(policy.index, order=turns, plays=plays)
    assert [p.turn for p in algorithm.schedule] == list(turns)
    for phase, expected_m, expected_s in zip(algorithm.schedule, weights, ratios):
        assert set(phase.rollout_ids) == set(expected_m)
        assert phase.weights == pytest.approx(expected_m, rel=1e-5, abs=1e-7)
        assert phase.ratios_after == pytest.approx(expected_s, rel=1e-5)
    assert any(abs(s - 1) > 0.05 for after in ratios for s in after.values())  # M really moved
    torch.testing.assert_close(policy.logits.detach(), logits, atol=1e-5, rtol=1e-5)
