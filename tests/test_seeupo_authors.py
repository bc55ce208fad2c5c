"""`seeupo_authors`: SeeUPO as its authors' code computes it, checked against a transcription of that code.

The transcription below is written from github.com/modelscope/AgentEvolver, branch `seeupo`, commit
e59dea41e7211f31d04993bbb28c6666bd153e73 (`beyondagent/module/trainer/ba_ray_trainer.py`:
`compute_grpo_outcome_advantage_local`, `compute_advantage`, `update_ratios`, `union_gen_batch_via_task_id`,
`parse_reward_from_dataproto`, `compute_response_mask`, `_balance_batch` and the sequential loop of `fit`;
`beyondagent/module/env_manager/env_manager.py`: `trajectories_to_samples_list`, `samples_to_dataproto`;
`context_manager_templates/cmt_linear_think.py`: `group_tokenize_turns`, `tokenize_steps_pure_padding`), in
plain torch with their names and control flow; only the model is replaced, by a scripted policy whose
log-probs are a fixed function of the token and of how many updates with a loss token it has taken (the
same policy for every path, so that the kit, verl and the transcription can be compared number for number).
"""

from __future__ import annotations

import random
from collections import defaultdict

import numpy as np
import pytest
import torch

from seeupo_gym.algorithms import core
from seeupo_gym.algorithms.base import TokenLogprobs, algorithm_class, loss_share, make_algorithm
from seeupo_gym.algorithms.rollout import RolloutBatch, Trajectory, Turn
from seeupo_gym.algorithms.seeupo_authors import (
    MFactors, SeeUPOAuthors, SeeUPOAuthorsConfig, authors_advantages, balance_order, clipped_product)

CLIP = 0.2  # their algorithm.adv_clip_ratio: M's factor in [0.8, 1.2]
TOLERANCE = 1e-9  # float64 on both sides


# ------------------------------------------------------------------- the scripted policy


def scripted_logprob(tokens: torch.Tensor, version: int) -> torch.Tensor:
    """log pi(token) after `version` updates: moves by up to +-0.8 per update, so some ratios pass the clip."""
    return -1.0 - 0.4 * torch.sin(0.37 * tokens.to(torch.float64) + 1.3 * version)


class ScriptedPolicyLearner:
    """Replaces the kit's model with the scripted policy: an update with a gradient counts one version."""

    def __init__(self) -> None:
        self.version = 0

    def _rows(self, samples, version: int) -> TokenLogprobs:
        length = max([s.turn.num_response_tokens for s in samples] + [1])
        logprobs = torch.zeros(len(samples), length, dtype=torch.float64)
        mask = torch.zeros(len(samples), length, dtype=torch.bool)
        for k, s in enumerate(samples):
            n = s.turn.num_response_tokens
            logprobs[k, :n] = scripted_logprob(torch.tensor(s.turn.response_ids), version)
            mask[k, :n] = True
        return TokenLogprobs(logprobs, mask)

    def logprobs(self, samples, *, grad: bool = True, entropy: bool = False) -> TokenLogprobs:
        return self._rows(samples, self.version)

    def ref_logprobs(self, samples) -> TokenLogprobs:
        return self._rows(samples, -1)

    def minimize(self, samples, loss, *, values: bool = False, entropy: bool = False) -> dict[str, float]:
        new = self._rows(samples, self.version)
        new.logprobs.requires_grad_(True)
        value, _ = loss_share(loss(samples, new, None))
        if value.requires_grad:
            value.backward()
        if new.logprobs.grad is not None and bool(new.logprobs.grad.abs().sum() > 0):
            self.version += 1
        return {"policy_loss": float(value.detach())}


# ------------------------------------------------ transcription of the authors' code (see module doc)


def compute_grpo_outcome_advantage_local(token_level_rewards, response_mask, index, epsilon=1e-6,
                                         norm_adv_by_std_in_grpo=True, special_norm=False):
    scores = token_level_rewards.sum(dim=-1)

    id2score = defaultdict(list)
    id2mean = {}
    id2std = {}

    with torch.no_grad():
        bsz = scores.shape[0]
        for i in range(bsz):
            id2score[index[i]].append(scores[i])
        for idx in id2score:
            if len(id2score[idx]) == 1:
                id2mean[idx] = torch.tensor(0.0, dtype=scores.dtype)
                id2std[idx] = torch.tensor(1.0, dtype=scores.dtype)
            elif len(id2score[idx]) > 1:
                scores_tensor = torch.stack(id2score[idx])
                id2mean[idx] = torch.mean(scores_tensor)
                id2std[idx] = torch.std(scores_tensor)
            else:
                raise ValueError(f"no score in prompt index: {idx}")
        for i in range(bsz):
            if norm_adv_by_std_in_grpo:
                scores[i] = (scores[i] - id2mean[index[i]]) / (id2std[index[i]] + epsilon)
            else:
                scores[i] = scores[i] - id2mean[index[i]]
        if special_norm:
            assert not norm_adv_by_std_in_grpo
            if torch.std(scores) > 1e-6:
                scores = (scores - torch.mean(scores)) / (torch.std(scores))
            else:
                scores = (scores - torch.mean(scores))
            scores = torch.clamp(scores, -3, 3)
        scores = scores.unsqueeze(-1) * response_mask

    return scores, scores


def update_ratios(ratios, last_agent_log_prob, now_agent_log_prob, response_mask, clip_ratio_low=CLIP,
                  clip_ratio_high=CLIP):
    negative_approx_kl = now_agent_log_prob - last_agent_log_prob
    seq_lengths = torch.sum(response_mask, dim=-1).clamp(min=1)
    negative_approx_kl_seq = torch.sum(negative_approx_kl * response_mask, dim=-1) / seq_lengths
    log_seq_importance_ratio = negative_approx_kl_seq.detach()
    log_seq_importance_ratio = torch.clamp(log_seq_importance_ratio, min=-10.0, max=10.0)
    seq_importance_ratio = torch.exp(log_seq_importance_ratio)
    seq_importance_ratio = torch.clamp(seq_importance_ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    updated_ratio = ratios * seq_importance_ratio if ratios is not None else seq_importance_ratio
    updated_ratio = torch.clamp(updated_ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    return updated_ratio


def compute_response_mask(data):
    response_length = data["responses"].size(1)
    return data["attention_mask"][:, -response_length:]


def compute_advantage(data, ratios=None):
    """The GRPO branch, with their run's norm_adv_by_std_in_grpo=False and special_norm=True."""
    grpo_calculation_mask = data["response_mask"]
    response_length = grpo_calculation_mask.size(1)
    grpo_calculation_mask = data["loss_mask"][:, -response_length:]
    advantages, returns = compute_grpo_outcome_advantage_local(
        token_level_rewards=data["token_level_rewards"], response_mask=grpo_calculation_mask, index=data["uid"],
        norm_adv_by_std_in_grpo=False, special_norm=True)
    data["advantages"] = advantages
    if ratios is not None:
        data["advantages"] = data["advantages"] * ratios.unsqueeze(-1).detach()
    return data


def group_tokenize_turns(trajectory: Trajectory, max_turn: int) -> list[dict]:
    """One sample per turn index; past the last turn, the last turn again with every loss_mask 0."""
    sample_arr = []
    for turn_idx in range(max_turn):
        if turn_idx < len(trajectory.turns):
            ext_steps = trajectory.turns[turn_idx]
            loss = [1] * len(ext_steps.response_ids)
        else:
            ext_steps = trajectory.turns[-1]
            loss = [0] * len(ext_steps.response_ids)  # tokenize_steps_pure_padding
        sample_arr.append({"task_id": trajectory.task_id, "rid": trajectory.rollout_id, "prompt_ids": ext_steps.context_ids,
                           "response_ids": ext_steps.response_ids, "response_loss_mask": loss,
                           "reward_scores": {"outcome": trajectory.reward}})
    return sample_arr


def samples_to_dataproto(samples: list[dict]) -> dict:
    prompt_width = max(len(s["prompt_ids"]) for s in samples)
    response_width = max(len(s["response_ids"]) for s in samples)
    bs = len(samples)
    prompts = torch.zeros(bs, prompt_width, dtype=torch.long)
    responses = torch.zeros(bs, response_width, dtype=torch.long)
    prompt_attention = torch.zeros(bs, prompt_width, dtype=torch.long)
    response_attention = torch.zeros(bs, response_width, dtype=torch.long)
    response_loss = torch.zeros(bs, response_width, dtype=torch.long)
    for i, s in enumerate(samples):
        p, r = len(s["prompt_ids"]), len(s["response_ids"])
        prompts[i, prompt_width - p:] = torch.tensor(s["prompt_ids"])  # left padding
        prompt_attention[i, prompt_width - p:] = 1
        responses[i, :r] = torch.tensor(s["response_ids"])
        response_attention[i, :r] = 1
        response_loss[i, :r] = torch.tensor(s["response_loss_mask"])
    return {"prompts": prompts, "responses": responses,
            "attention_mask": torch.cat([prompt_attention, response_attention], -1),
            "loss_mask": torch.cat([torch.zeros_like(prompt_attention), response_loss], -1),
            "task_ids": np.array([s["task_id"] for s in samples]), "rid": [s["rid"] for s in samples],
            "reward_scores": np.array([s["reward_scores"] for s in samples])}


def trajectories_to_samples_list(trajectories: list[Trajectory], max_steps: int) -> list[list[dict]]:
    sample_arr_final = [[] for _ in range(max_steps)]
    for cmt in trajectories:
        sample_arr = group_tokenize_turns(cmt, max_steps)
        for i in range(max_steps):
            sample_arr_final[i] += [sample_arr[i]]
    return sample_arr_final


def union_gen_batch_via_task_id(task_uids: dict[str, str], gen_batch_output: dict) -> dict:
    batch = dict(gen_batch_output)
    batch["uid"] = np.array([task_uids[tid] for tid in gen_batch_output["task_ids"]], dtype=object)
    return batch


def reorder(batch: dict, idx: list[int]) -> dict:
    return {k: (v[idx] if isinstance(v, (torch.Tensor, np.ndarray)) else [v[j] for j in idx]) for k, v in batch.items()}


def _balance_batch(batch: dict, world_size: int) -> dict:
    from verl.utils.seqlen_balancing import get_seqlen_balanced_partitions

    attention_mask = batch["attention_mask"]
    global_seqlen_lst = attention_mask.view(attention_mask.shape[0], -1).sum(-1).tolist()
    global_partition_lst = get_seqlen_balanced_partitions(global_seqlen_lst, k_partitions=world_size, equal_size=True)
    return reorder(batch, [j for partition in global_partition_lst for j in partition])


def parse_reward_from_dataproto(data: dict) -> torch.Tensor:
    reward_tensor = torch.zeros_like(data["responses"], dtype=torch.float64)
    prompt_lengths = data["prompts"].shape[-1]
    response_lengths = data["attention_mask"][:, prompt_lengths:].sum(dim=1)
    reward_scores = torch.tensor([item["outcome"] for item in data["reward_scores"]], dtype=torch.float64)
    reward_tensor[torch.arange(len(reward_scores)), response_lengths - 1] = reward_scores
    return reward_tensor


class ScriptedActor:
    """The actor worker group of the transcription, serving the scripted policy."""

    def __init__(self) -> None:
        self.version = 0

    def compute_log_prob(self, batch: dict) -> torch.Tensor:
        return scripted_logprob(batch["responses"], self.version) * compute_response_mask(batch)

    def update_actor(self, batch: dict) -> None:
        if bool(batch["response_mask"].any()):  # the actor's loss mask (padding rows too: their KL term)
            self.version += 1


def fit_sequential(trajectories, max_steps, update_order, reorders=None, world_size=1):
    """Their `fit` for one step with sequential_update and adv_updator=seeupo: per agent_id the turn's batch,
    balance_batch (or a given order), reward, old log-probs, advantage x ratios, update, new log-probs,
    update_ratios. Returns the batch of each pool (with its advantages) and the final ratios by position."""
    gen_batch_output = [samples_to_dataproto(s) for s in trajectories_to_samples_list(trajectories, max_steps)]
    task_uids = {t.task_id: f"uid-{t.task_id}" for t in trajectories}  # one uid per task, as init_batch's
    actor, seeupo_ratios, pools = ScriptedActor(), None, []
    for agent_id in update_order:
        batch = union_gen_batch_via_task_id(task_uids, gen_batch_output[agent_id])
        batch["response_mask"] = compute_response_mask(batch)
        if reorders is not None:
            batch = reorder(batch, reorders[agent_id])
        elif world_size > 1:
            batch = _balance_batch(batch, world_size)
        batch["token_level_rewards"] = parse_reward_from_dataproto(batch)
        batch["old_log_probs"] = actor.compute_log_prob(batch)
        batch = compute_advantage(batch, ratios=seeupo_ratios)
        actor.update_actor(batch)
        new_log_prob = actor.compute_log_prob(batch)
        seeupo_ratios = update_ratios(seeupo_ratios, batch["old_log_probs"], new_log_prob, batch["response_mask"])
        pools.append(batch)
    return pools, seeupo_ratios


# ------------------------------------------------------------------------- random batches


def random_batch(seed: int, max_steps: int = 4) -> RolloutBatch:
    """Tasks with 1 to 3 rollouts (groups of one among them), 1..max_steps turns each, rewards in
    {0, 0.5, 1} or uniform; a turn's context is the prompt, the earlier turns and their tool replies."""
    rng = random.Random(seed)
    trajectories = []
    for task in range(rng.randint(3, 5)):
        prompt = [rng.randrange(3, 500) for _ in range(rng.randint(3, 9))]
        for g in range(rng.choice([1, 1, 2, 3])):
            context, turns = list(prompt), []
            for _ in range(rng.randint(1, max_steps)):
                reply = [rng.randrange(3, 500) for _ in range(rng.randint(1, 7))]
                turns.append(Turn(list(context), reply, [0.0] * len(reply)))
                context += reply + [rng.randrange(3, 500) for _ in range(rng.randint(1, 5))]
            reward = rng.choice([0.0, 0.5, 1.0]) if seed % 2 else rng.random()
            trajectories.append(Trajectory(f"task{task}", f"task{task}", f"task{task}-{g}", turns, reward, reward > 0.5))
    return RolloutBatch(trajectories)


def kit_update(batch, max_steps, **options):
    algorithm = make_algorithm("seeupo_authors", {"max_steps": max_steps, "kl_coef": 0.01, "minibatch_size": 1 << 20,
                                                  **options})
    algorithm.update(batch, ScriptedPolicyLearner(), torch.Generator().manual_seed(0))
    return algorithm


def pool_weights(batch: dict) -> dict[str, float]:
    """The advantage each row trains with over its response_mask (constant; 0 on a padding row)."""
    out = {}
    for k, rid in enumerate(batch["rid"]):
        values = batch["advantages"][k][batch["response_mask"][k].bool()]
        assert float(values.max() - values.min()) == 0.0
        out[rid] = float(values[0])
    return out


# ---------------------------------------------------------------- (1) against the transcription


@pytest.mark.parametrize("seed", range(6))
def test_advantages_equal_the_authors_group_mean_batch_zscore_and_clamp_with_padding_rows(seed):
    batch = random_batch(seed)
    max_steps = 4
    for agent_id, turn_batch in enumerate(samples_to_dataproto(s) for s in trajectories_to_samples_list(list(batch), max_steps)):
        uids = union_gen_batch_via_task_id({t.task_id: t.task_id for t in batch}, turn_batch)["uid"]
        rewards = parse_reward_from_dataproto(turn_batch)
        theirs, _ = compute_grpo_outcome_advantage_local(rewards, torch.ones(len(uids), 1), uids,
                                                          norm_adv_by_std_in_grpo=False, special_norm=True)
        names = {u: k for k, u in enumerate(dict.fromkeys(uids))}
        ours = authors_advantages(rewards.sum(-1), torch.tensor([names[u] for u in uids]))
        assert float((ours - theirs[:, 0]).abs().max()) <= TOLERANCE
    assert any(len(group) == 1 for group in batch.groups().values()) or seed % 3


def test_a_group_of_one_keeps_its_raw_score_before_the_batch_zscore_and_a_flat_batch_is_only_centred():
    rewards, groups = torch.tensor([1.0, 0.0, 1.0, 5.0]), torch.tensor([0, 0, 0, 1])
    theirs, _ = compute_grpo_outcome_advantage_local(rewards[:, None], torch.ones(4, 1), ["a", "a", "a", "b"],
                                                      norm_adv_by_std_in_grpo=False, special_norm=True)
    assert torch.allclose(authors_advantages(rewards, groups).float(), theirs[:, 0].float())
    flat = authors_advantages(torch.tensor([2.0, 2.0, 2.0]), torch.tensor([0, 1, 2]))
    assert flat.tolist() == [0.0, 0.0, 0.0]
    wide = authors_advantages(torch.tensor([0.0] * 20 + [100.0]), torch.arange(21))
    assert float(wide.max()) == 3.0  # clamped


@pytest.mark.parametrize("seed", range(4))
def test_m_factor_steps_equal_update_ratios_clip_then_product_then_clip(seed):
    generator = torch.Generator().manual_seed(seed)
    n, length = 9, 6
    mask = (torch.rand(n, length, generator=generator) > 0.3).to(torch.float64)
    mask[:, 0] = 1
    theirs, ours = None, MFactors(n, "position", (1 - CLIP, 1 + CLIP))
    for _ in range(4):
        old = -torch.rand(n, length, generator=generator, dtype=torch.float64) * 3
        new = old + torch.randn(n, length, generator=generator, dtype=torch.float64) * 0.4
        theirs = update_ratios(theirs, old, new, mask)
        ours.update(list(range(n)), core.sequence_ratio(new, old, mask.bool()))
        assert float((ours.factor - theirs).abs().max()) <= TOLERANCE
    assert clipped_product(torch.tensor([1.0]), torch.tensor([3.0]), None).item() == 3.0  # m_clip off: no clip


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("alignment", ["position", "rollout"])
@pytest.mark.parametrize("order", ["reverse", "natural"])
def test_one_step_with_a_scripted_policy_trains_each_pool_with_the_transcriptions_advantages(seed, alignment, order):
    """Ragged turn counts, groups of one, padding rows; pools reordered by a random permutation each (as
    balance_batch does): position-aligned M is theirs exactly; rollout-aligned M equals theirs when no pool
    is reordered."""
    batch, max_steps = random_batch(seed), 4
    rng = random.Random(100 + seed)
    n = len(batch)
    perms = [rng.sample(range(n), n) for _ in range(max_steps)] if alignment == "position" else [list(range(n))] * max_steps
    agents = list(range(max_steps))[::-1] if order == "reverse" else list(range(max_steps))  # their agent_id order
    pools, final = fit_sequential(list(batch), max_steps, agents, reorders=perms)
    algorithm = SeeUPOAuthors(SeeUPOAuthorsConfig(max_steps=max_steps, kl_coef=0.01, minibatch_size=1 << 20, order=order,
                                                  old_policy="turn_start", m_clip=(1 - CLIP, 1 + CLIP), m_alignment=alignment))
    algorithm.row_order = lambda t, pool: perms[t - 1]  # read by `position` only
    algorithm.update(batch, ScriptedPolicyLearner(), torch.Generator().manual_seed(0))
    assert [phase.turn for phase in algorithm.schedule] == [a + 1 for a in agents]
    worst = 0.0
    for phase, theirs in zip(algorithm.schedule, pools):
        expected = pool_weights(theirs)
        assert phase.weights.keys() == expected.keys()
        assert all(w == 0.0 for rid, w in expected.items() if batch[rid].num_turns < phase.turn)  # padding rows
        worst = max([worst] + [abs(phase.weights[rid] - expected[rid]) for rid in expected])
    print(f"\nseed {seed}, {alignment}, {order}: max |advantage difference| vs the transcription over {max_steps} pools: {worst:.3g}")
    assert worst <= TOLERANCE
    assert float((algorithm.m_factors - final).abs().max()) <= TOLERANCE


def test_every_trajectory_gives_max_steps_pools_and_a_padding_row_trains_with_advantage_zero_under_the_kl():
    batch = random_batch(1)
    assert max(t.num_turns for t in batch) < 6
    learner = ScriptedPolicyLearner()
    algorithm = make_algorithm("seeupo_authors", {"max_steps": 6, "kl_coef": 0.01, "minibatch_size": 1 << 20})
    algorithm.update(batch, learner, torch.Generator().manual_seed(0))
    assert [phase.turn for phase in algorithm.schedule] == [6, 5, 4, 3, 2, 1]
    assert all(len(phase.rollout_ids) == len(batch) for phase in algorithm.schedule)  # padding rows included
    assert all(phase.weights[rid] == 0.0 for phase in algorithm.schedule for rid in phase.rollout_ids
               if batch[rid].num_turns < phase.turn)
    # pool 6 holds padding rows only: their KL term alone still moves the policy, as the authors' actor
    assert learner.version == 6 == algorithm.budget(batch).optimizer_steps


# ------------------------------------------------------------------- (3) positional vs rollout M


def test_positional_and_rollout_aligned_m_are_equal_unreordered_and_differ_once_a_pool_is_reordered():
    batch, max_steps = random_batch(3), 4
    n = len(batch)

    def run(alignment, order):
        algorithm = SeeUPOAuthors(SeeUPOAuthorsConfig(max_steps=max_steps, kl_coef=0.01, minibatch_size=1 << 20,
                                                      m_alignment=alignment))
        algorithm.row_order = order
        algorithm.update(batch, ScriptedPolicyLearner(), torch.Generator().manual_seed(0))
        return [phase.weights for phase in algorithm.schedule]

    identity = lambda t, pool: list(range(n))  # noqa: E731
    reversed_order = lambda t, pool: list(range(n))[::-1] if t % 2 else list(range(n))  # noqa: E731
    rollout = run("rollout", None)
    assert run("position", identity) == rollout
    moved = run("position", reversed_order)
    gap = max(abs(a[rid] - b[rid]) for a, b in zip(moved, rollout) for rid in a)
    print(f"\npositional vs rollout-aligned M, pools 1 and 3 reversed: max |M difference| {gap:.3g}")
    assert gap > 1e-2
    assert moved[0] == rollout[0]  # the first pool's M is A alone: no factor yet


def test_balance_order_is_verls_partitions_concatenated_and_one_rank_keeps_the_order():
    pytest.importorskip("verl", reason="balance_batch's order is verl's get_seqlen_balanced_partitions")
    from verl.utils.seqlen_balancing import get_seqlen_balanced_partitions

    lengths = [5, 30, 8, 1, 17, 2, 9, 40]
    assert balance_order(lengths, 1) == list(range(8))
    assert balance_order(lengths, 2) == [j for part in get_seqlen_balanced_partitions(lengths, 2, True) for j in part]
    assert balance_order(lengths, 2) != list(range(8))
    assert balance_order(lengths[:7], 2) == list(range(7))  # does not split: unchanged


def test_positional_m_without_a_given_order_takes_balance_batchs_order_of_the_pools_token_counts():
    pytest.importorskip("verl", reason="balance_batch's order is verl's get_seqlen_balanced_partitions")
    batch = random_batch(2)
    batch = RolloutBatch(list(batch)[: len(batch) // 2 * 2])
    algorithm = kit_update(batch, 4, m_alignment="position", balance_world_size=2)
    trajectories = list(batch)
    for phase in algorithm.schedule:
        turns = [t.turns[min(phase.turn, t.num_turns) - 1] for t in trajectories]
        order = balance_order([len(turn.context_ids) + turn.num_response_tokens for turn in turns], 2)
        assert list(phase.rollout_ids) == [trajectories[j].rollout_id for j in order]
    assert any(list(phase.rollout_ids) != [t.rollout_id for t in trajectories] for phase in algorithm.schedule)


# ------------------------------------------------------------------------------- config


@pytest.mark.parametrize("options, message", [
    ({"m_alignment": "sideways"}, "m_alignment"),
    ({"max_steps": 0}, "max_steps"),
    ({"balance_world_size": 0}, "balance_world_size"),
    ({"m_clip": [1.2, 0.8]}, "m_clip"),
])
def test_bad_options_are_refused_in_one_line(options, message):
    with pytest.raises(ValueError, match=message) as error:
        make_algorithm("seeupo_authors", options)
    assert "\n" not in str(error.value)


def test_the_variant_registers_with_seeupo_and_defaults_to_the_authors_run():
    config = algorithm_class("seeupo_authors").config_class()
    assert (config.order, config.old_policy, config.m_clip, config.m_alignment) == ("reverse", "turn_start", (0.8, 1.2), "rollout")


def test_more_turns_than_max_steps_is_refused():
    with pytest.raises(ValueError, match="max_steps"):
        kit_update(random_batch(0, max_steps=4), 1)
