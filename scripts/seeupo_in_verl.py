"""One SeeUPO step through verl's own actor worker against the kit's, on the same rollouts and weights.

Fixed scripted multi-turn rollouts (tool calls, tool results, one answer that mimics turn markers) on
the `tiny` model, float32, CPU. The verl side: `seeupo_step` on a verl `DataProto` (one row per
trajectory, response_mask 0 on tool results), its actor calls served by verl's `ActorRolloutRefWorker`
(role "actor": the FSDP2 engine, verl's GSPO and KL losses, its optimizer, grad clip and LR schedule;
built in this process on a one-rank gloo group, `seeupo_gym.integrations.verl.cpu`) through
`WorkerGroupActor`, the conversion verl's trainer makes. The other side: `SeeUPO.update` with the
project's `LLMLearner` (`--reference kit`), or `algorithm1` below, the paper's Algorithm 1 written
out in plain torch from the paper (`--reference algorithm1`). SGD (lr 0.5, or the step's rate of
`--lr-schedule`) and grad-norm clip 1 on both sides. Prints `max parameter difference vs ...: X`.

    .venv/bin/python scripts/seeupo_in_verl.py --case reverse|natural|kl|control [--mask-runs] [--dp-size 4]
    .venv/bin/python scripts/seeupo_in_verl.py --case reverse --reference algorithm1 --lr-schedule warmup
    .venv/bin/python scripts/seeupo_in_verl.py --case natural --reference algorithm1 --empty-turn
    .venv/bin/python scripts/seeupo_in_verl.py --count-tokens
    .venv/bin/python scripts/seeupo_in_verl.py --case reverse --variant authors [--m-alignment position]

`--lr-schedule warmup|cosine`: verl's own schedule (`lr_warmup_steps=10`, or cosine over 20 steps),
moved to step `--schedule-position` (3) first, as after 3 training steps; prints the rate each pool
ran at and how far the step moved the schedule. `--empty-turn`: one rollout's second turn is empty
(the server sampled nothing), so its later turns must pool at their true index. `--count-tokens`:
one step on rows of 4-6 turns with a long tools prompt; prints, from what verl's worker received
(each call's sequence lengths summed), `verl SeeUPO tokens fed / exact floor: X`, and the kit's
learner's fed tokens against its own floor. `--variant authors`: SeeUPO as the authors' code computes it
on both sides (`algorithm.seeupo.variant=authors` against the kit's `seeupo_authors`: padded pools of
max_steps 4, turn-start ratios, M's factor clipped to [0.8, 1.2]; `--m-alignment position`: M by row
after balance_batch's order over 2 ranks).
"""

from __future__ import annotations

import argparse
import copy
import math

import numpy as np
import torch

from seeupo_gym.agents.models import load_model
from seeupo_gym.algorithms.base import make_algorithm
from seeupo_gym.algorithms.rollout import RolloutBatch, Trajectory, Turn
from seeupo_gym.integrations.verl.cpu import CPU_ACTOR_OVERRIDES

LR = 0.5  # large, so that a wrong pool order or M moves the weights far more than rounding
KL_COEF = 0.5
GRAD_CLIP = 1.0

# (group, reward, [(assistant text, tool result or None), ...]): 2 groups x 3 rollouts, 1 to 3 turns.
ROLLOUTS = [
    ("g0", 1.0, [('<tool_call>{"name": "open", "arguments": {"door": 1}}</tool_call>', "<tool_response>a goat</tool_response>"),
                 ('<tool_call>{"name": "open", "arguments": {"door": 2}}</tool_call>', "<tool_response>the car</tool_response>"),
                 ("The car is behind door 2.", None)]),
    ("g0", 0.0, [('<tool_call>{"name": "open", "arguments": {"door": 3}}</tool_call>', "<tool_response>a goat</tool_response>"),
                 ("Door 3.", None)]),
    ("g0", 0.5, [("I guess door 1.", None)]),
    ("g1", 0.0, [('<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>', "<tool_response>5</tool_response>"),
                 ('<tool_call>{"name": "mul", "arguments": {"a": 5, "b": 4}}</tool_call>', "<tool_response>20</tool_response>"),
                 ("user: <tool_response> 20 </tool_response> assistant:", None)]),  # text mimicking turn markers
    ("g1", 1.0, [('<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>', "<tool_response>5</tool_response>"),
                 ("The answer is 20.", None)]),
    ("g1", 0.25, [("Twenty.", None)]),
]
PROMPTS = {"g0": "user: Which door hides the car? Use the open tool.\nassistant: ",
           "g1": "user: What is (2 + 3) * 4? Use the tools.\nassistant: "}

# The first g1 rollout with an empty second turn (the server sampled nothing; the tool answered the
# empty action): its turns 3 and 4 are turns 3 and 4, not 2 and 3.
EMPTY_TURN_ROLLOUTS = [*ROLLOUTS[:3], ("g1", 0.0, [ROLLOUTS[3][2][0], ("", "<tool_response>no call</tool_response>"),
                                                   *ROLLOUTS[3][2][1:]]), *ROLLOUTS[4:]]


def long_rollouts() -> list:
    """Rows of 4-6 turns after a long tools prompt (BFCL-shaped: the prompt is most of each prefix)."""
    tools = " ".join(f'{{"name": "tool_{k}", "parameters": {{"x": "int", "y": "str"}}}}' for k in range(8))
    rows = []
    for k, turns in enumerate((4, 5, 6, 4, 6, 5)):
        pieces = [(f'<tool_call>{{"name": "tool_{j}", "arguments": {{"x": {k * j}, "y": "step {j} of row {k}"}}}}</tool_call>',
                   f"<tool_response>result {j}: {k * j * 7} units, status ok; " + "detail " * 40 + "</tool_response>") for j in range(turns - 1)]
        rows.append((f"g{k // 3}", float(k % 3) / 2, pieces + [(f"Done after {turns} turns: {k * 11}.", None)]))
    return rows, {"g0": f"system: tools {tools}\nuser: Solve task A.\nassistant: ",
                  "g1": f"system: tools {tools}\nuser: Solve task B.\nassistant: "}


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def scripted(tokenizer, rollouts=None, prompts=None):
    """Per rollout: (group, reward, prompt ids, [(response ids, tool ids)])."""
    out = []
    for group, reward, turns in rollouts or ROLLOUTS:
        pieces = [(encode(tokenizer, a), encode(tokenizer, "\n" + r + "\nassistant: ") if r else []) for a, r in turns]
        out.append((group, reward, encode(tokenizer, (prompts or PROMPTS)[group]), pieces))
    return out


def kit_batch(rollouts) -> RolloutBatch:
    trajectories = []
    for k, (group, reward, prompt, pieces) in enumerate(rollouts):
        context, turns = list(prompt), []
        for response, tool in pieces:
            turns.append(Turn(list(context), list(response), [0.0] * len(response)))
            context += response + tool
        trajectories.append(Trajectory(group, group, f"r{k}", turns, reward, reward > 0.5))
    return RolloutBatch(trajectories)


def verl_rows(rollouts) -> list[dict]:
    """Each rollout as the fields verl's agent loop stores for it: prompt, response (model and tool
    tokens), response_mask 0 on tool tokens, the score on the last token, its turn spans."""
    rows = []
    for group, reward, prompt, pieces in rollouts:
        response, mask, spans = [], [], []
        for r, tool in pieces:
            spans.append([len(response), len(response) + len(r)])
            response += r + tool
            mask += [1] * len(r) + [0] * len(tool)
        scores = [0.0] * len(response)
        scores[-1] = reward
        rows.append({"prompts": torch.tensor(prompt), "responses": torch.tensor(response), "response_mask": torch.tensor(mask),
                     "rm_scores": torch.tensor(scores), "uid": group, "extra_fields": {"turn_spans": spans}})
    return rows


def verl_batch(rollouts, pad_id: int, with_spans: bool):
    """The rollouts in verl's padded layout (`padded_tensors`), one row per trajectory."""
    from verl import DataProto

    from seeupo_gym.integrations.verl.trainer import right_padded, padded_tensors

    rows = verl_rows(rollouts)
    tensors = padded_tensors([r["prompts"] for r in rows], [r["responses"] for r in rows],
                             [r["response_mask"] for r in rows], pad_id)
    tensors["token_level_scores"] = right_padded([r["rm_scores"] for r in rows], tensors["responses"].shape[1])
    non_tensors = {"uid": np.array([r["uid"] for r in rows], dtype=object)}
    if with_spans:
        non_tensors["turn_spans"] = np.array([r["extra_fields"]["turn_spans"] for r in rows] + [None], dtype=object)[:-1]
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors)


# verl's LR schedules under test, and the rate each gives at step k, written from their definitions:
# linear warm-up over 10 steps then constant; cosine from LR to 0 over 20 steps (half a period).
SCHEDULES = {
    "constant": ((), lambda k: LR),
    "warmup": (("actor_rollout_ref.actor.optim.lr_warmup_steps=10",), lambda k: LR * min(k / 10, 1.0)),
    "cosine": (("actor_rollout_ref.actor.optim.lr_scheduler_type=cosine", "actor_rollout_ref.actor.optim.total_training_steps=20"),
               lambda k: LR * 0.5 * (1 + math.cos(math.pi * k / 20))),
}


def verl_overrides(model_path: str, kl_coef: float, micro_batch: int, schedule: str = "constant") -> list[str]:
    """The verl options of the run: SeeUPO's required actor loss, SGD as the kit's, float32 on CPU."""
    return [*CPU_ACTOR_OVERRIDES, *SCHEDULES[schedule][0], f"actor_rollout_ref.model.path={model_path}",
            "actor_rollout_ref.actor.ppo_mini_batch_size=1",
            f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro_batch}",
            f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={micro_batch}",
            "actor_rollout_ref.actor.policy_loss.loss_mode=gspo", "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean",
            f"actor_rollout_ref.actor.optim.lr={LR}", "actor_rollout_ref.actor.optim.optimizer=SGD",
            "actor_rollout_ref.actor.optim.weight_decay=0.0", f"actor_rollout_ref.actor.optim.clip_grad={GRAD_CLIP}",
            "actor_rollout_ref.actor.clip_ratio_low=0.2", "actor_rollout_ref.actor.clip_ratio_high=0.2",
            f"actor_rollout_ref.actor.use_kl_loss={kl_coef > 0}", f"actor_rollout_ref.actor.kl_loss_coef={kl_coef}",
            "actor_rollout_ref.actor.kl_loss_type=low_var_kl", "actor_rollout_ref.actor.entropy_coeff=0"]


CASES = {  # case: (verl's order, the kit's order, KL coefficient)
    "reverse": ("reverse", "reverse", 0.0), "natural": ("natural", "natural", 0.0), "kl": ("reverse", "reverse", KL_COEF),
    "control": ("natural", "reverse", 0.0),
}


def AUTHORS(m_alignment: str) -> dict:  # the authors' variant's options, the same on both sides
    return {"old_policy": "turn_start", "m_clip": (0.8, 1.2), "max_steps": 4, "m_alignment": m_alignment,
            "balance_world_size": 2}


def through_trainer(worker, config, rollouts, tokenizer, kl: bool) -> None:
    """The step as verl's trainer takes it: the rows in a live TransferQueue (on a local Ray), with the
    old and reference log-probs verl computes before the update, then `SeeUPOTrainer._update_actor`.
    Only the trainer's set-up (Ray worker groups, rollout servers: `PPOTrainer.__init__` / `init`) is
    replaced, by the in-process worker."""
    from types import SimpleNamespace

    import ray
    import transfer_queue as tq
    from omegaconf import OmegaConf
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    from seeupo_gym.integrations.verl.seeupo import WorkerGroupActor
    from seeupo_gym.integrations.verl.trainer import seeupo_trainer_class

    old = WorkerGroupActor(worker).compute_log_prob(verl_batch(rollouts, tokenizer.pad_token_id, True))
    rows = verl_rows(rollouts)
    for i, row in enumerate(rows):
        row["old_log_probs"] = old[i, : len(row["responses"])].clone()
        if kl:  # the reference is the initial policy, as at a run's first step
            row["ref_log_prob"] = old[i, : len(row["responses"])].clone()
    keys = [f"{row['uid']}_s{k}_0" for k, row in enumerate(rows)]
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        tq.init(OmegaConf.create({"backend": {"SimpleStorage": {"num_data_storage_units": 1}}}))
        tq.kv_batch_put(keys=keys, partition_id="train", fields=list_of_dict_to_tensordict(rows), tags=[{} for _ in keys])
        cls = seeupo_trainer_class()
        trainer = cls.__new__(cls)
        trainer.config, trainer.actor_rollout_wg, trainer.tokenizer, trainer.use_reference_policy = config, worker, tokenizer, kl
        metrics: dict = {}
        trainer._update_actor(SimpleNamespace(keys=keys, partition_id="train"), metrics)
        print(f"through the trainer: {int(metrics['seeupo/turn_pools'])} pools, M mean {metrics['seeupo/m_mean']:+.4f}")
    finally:
        tq.close()
        ray.shutdown()


def algorithm1(model, rollouts, order: str, lr: float, clip: float = 0.2, grad_clip: float = GRAD_CLIP, eps: float = 1e-6) -> None:
    """The paper's Algorithm 1 (SeeUPPO-GRAE, one epoch, one mini-batch per turn), in plain torch, on
    `model`, from the paper's equations (not from the kit's or verl's code):

    A_i = R_i - mean of i's group, then (A_i - mean A) / (std A + eps) over the batch; M_i = A_i.
    For t = T..1 (reverse) or 1..T (natural), D_t = the rollouts that reached turn t (an empty turn
    t included: s = 1, no gradient):
        s_i = exp(min(mean over turn t's tokens of log pi(y) - log pi_old(y), 10)), pi_old the step's start;
        L = -1/|D_t| sum_i min(s_i M_i, clip(s_i, 1 - eps_c, 1 + eps_c) M_i); grad-norm clip; SGD(lr);
        then M_i <- M_i * s_i at the new parameters (no gradient), for i in D_t.
    """
    rewards = torch.tensor([r for _, r, _, _ in rollouts], dtype=torch.float64)
    groups = [g for g, _, _, _ in rollouts]
    advantages = torch.stack([rewards[i] - rewards[[j for j, h in enumerate(groups) if h == g]].mean()
                              for i, g in enumerate(groups)])
    m = ((advantages - advantages.mean()) / (advantages.std() + eps)).tolist()
    sequences, turns = [], []  # per rollout: all token ids; [(start, end)] of each turn in them
    for _, _, prompt, pieces in rollouts:
        ids, spans = list(prompt), []
        for response, tool in pieces:
            spans.append((len(ids), len(ids) + len(response)))
            ids += response + tool
        sequences.append(ids)
        turns.append(spans)

    def turn_logprobs(i: int, t: int) -> torch.Tensor:  # log pi(y_{i,t} | its prefix), [tokens]
        start, end = turns[i][t - 1]
        ids = torch.tensor(sequences[i][:end])[None]
        logits = model(input_ids=ids).logits[0].float()
        return torch.log_softmax(logits[start - 1 : end - 1], -1).gather(-1, ids[0, start:end, None])[:, 0]

    with torch.no_grad():
        old = {(i, t): turn_logprobs(i, t) for i in range(len(rollouts)) for t in range(1, len(turns[i]) + 1)}
    longest = max(len(s) for s in turns)
    order_ts = list(range(longest, 0, -1)) if order == "reverse" else list(range(1, longest + 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for position, t in enumerate(order_ts):
        pool = [i for i in range(len(rollouts)) if len(turns[i]) >= t]
        if not pool:
            continue
        terms = []
        for i in pool:
            if turns[i][t - 1][0] == turns[i][t - 1][1]:
                terms.append(torch.tensor(m[i], dtype=torch.float32))  # s = 1: a constant
                continue
            s = torch.exp(torch.clamp((turn_logprobs(i, t) - old[i, t]).mean(), max=10.0))
            terms.append(torch.minimum(s * m[i], torch.clamp(s, 1 - clip, 1 + clip) * m[i]))
        loss = -torch.stack(terms).sum() / len(pool)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
        later = {i for t2 in order_ts[position + 1 :] for i in range(len(rollouts)) if len(turns[i]) >= t2}
        with torch.no_grad():
            for i in pool:
                if i in later and turns[i][t - 1][0] < turns[i][t - 1][1]:
                    m[i] *= float(torch.exp(torch.clamp((turn_logprobs(i, t) - old[i, t]).mean(), max=10.0)))


class CountingWorker:
    """verl's in-process actor worker, counting the tokens each call hands it: the lengths of the
    sequences in the call's `input_ids` (verl's no-padding layout), summed, by call."""

    def __init__(self, worker) -> None:
        self.worker, self.fed = worker, {"compute_log_prob": 0, "update_actor": 0}

    def _count(self, name: str, td) -> None:
        self.fed[name] += int(td["input_ids"].offsets().diff().sum())

    def compute_log_prob(self, td):
        self._count("compute_log_prob", td)
        return self.worker.compute_log_prob(td)

    def update_actor(self, td):
        self._count("update_actor", td)
        return self.worker.update_actor(td)

    def __getattr__(self, name):
        return getattr(self.worker, name)


class RateRecorder(CountingWorker):
    """Also records the optimizer's rate at the start of each `update_actor`."""

    def __init__(self, worker) -> None:
        super().__init__(worker)
        self.rates: list[float] = []

    def update_actor(self, td):
        self.rates.append(float(self.worker.actor.engine.optimizer.param_groups[0]["lr"]))
        return super().update_actor(td)


def floors(rollouts, order: str) -> dict[str, int]:
    """Exact token floors of one SeeUPO step on `rollouts` (no KL, `step_start`), from causal attention:
    turn t needs its prefix only (prompt + response through turn t's last token).

    verl: one frozen pass to each row's last turn; per pool, the gradient pass on each row's prefix to
    turn t; the ratio pass on the same prefixes of the rows with a later pool (a call of its own: verl's
    `update_actor` returns no log-probs). kit: the same, but the ratios after pool t ride in the next
    pool's first gradient pass (docs/algorithms.md, `share_ratio_pass`), in reverse order costing the
    difference of the two prefixes. `whole_rows`: what verl was fed before (every call on whole rows)."""
    prefix, whole = [], []
    for _, _, prompt, pieces in rollouts:
        ends, length = [], len(prompt)
        for response, tool in pieces:
            ends.append(length + len(response))
            length += len(response) + len(tool)
        prefix.append(ends)
        whole.append(length)
    longest = max(len(e) for e in prefix)
    order_ts = list(range(longest, 0, -1)) if order == "reverse" else list(range(1, longest + 1))
    later = lambda i, k: any(len(prefix[i]) >= t for t in order_ts[k + 1 :])  # noqa: E731
    verl = sum(e[-1] for e in prefix)
    full = sum(whole)
    for k, t in enumerate(order_ts):
        for i, ends in enumerate(prefix):
            if len(ends) >= t:
                verl += ends[t - 1] * (2 if later(i, k) else 1)
                full += whole[i] * (2 if later(i, k) else 1)
    kit = sum(whole) + sum(sum(e) for e in prefix) + sum(sum(e[1:]) - sum(e[:-1]) for e in prefix)
    return {"verl": verl, "kit": kit if order == "reverse" else None, "whole_rows": full}


def count_tokens(workdir: str | None = None) -> None:
    """One reverse-order step on 4-6-turn rows through verl's worker (tokens counted) and through the
    kit's learner (its own count); each against its exact floor."""
    import tempfile

    from accelerate import Accelerator

    from seeupo_gym.integrations.verl.cpu import cpu_actor_worker, verl_config
    from seeupo_gym.integrations.verl.seeupo import VerlSeeUPOConfig, WorkerGroupActor, seeupo_step
    from seeupo_gym.training.learner import LLMLearner, frozen_copy

    model, tokenizer = load_model("tiny", dtype="float32", seed=0)
    initial = copy.deepcopy(model.state_dict())
    rows, prompts = long_rollouts()
    rollouts = scripted(tokenizer, rows, prompts)
    with tempfile.TemporaryDirectory(dir=workdir) as folder:
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        worker = CountingWorker(cpu_actor_worker(verl_config(verl_overrides(folder, 0.0, 2))))
    batch = verl_batch(rollouts, tokenizer.pad_token_id, True)
    seeupo_step(batch, WorkerGroupActor(worker), VerlSeeUPOConfig(order="reverse"))
    floor = floors(rollouts, "reverse")
    fed = sum(worker.fed.values())
    turns = [len(p) for _, _, _, p in rollouts]
    print(f"rows: {len(rollouts)}, turns {min(turns)}-{max(turns)}, prompt {len(rollouts[0][2])} tokens")
    print(f"verl calls: update_actor {worker.fed['update_actor']:,} tokens, compute_log_prob {worker.fed['compute_log_prob']:,}")
    print(f"verl SeeUPO tokens fed / exact floor: {fed / floor['verl']:.3f} ({fed:,} / {floor['verl']:,})")
    print(f"verl before trimming (whole rows in every call) / exact floor: {floor['whole_rows'] / floor['verl']:.3f} "
          f"({floor['whole_rows']:,})")
    model.load_state_dict(initial)
    learner = LLMLearner(Accelerator(cpu=True), model, torch.optim.SGD(model.parameters(), lr=LR),
                         pad_token_id=tokenizer.pad_token_id, reference=frozen_copy(model), max_grad_norm=GRAD_CLIP)
    algorithm = make_algorithm("seeupo", {"order": "reverse", "normalization": "batch", "kl_coef": 0.0,
                                          "minibatch_size": 1024, "epochs": 1, "clip_low": 0.2, "clip_high": 0.2})
    algorithm.update(kit_batch(rollouts), learner, torch.Generator().manual_seed(0))
    kit = learner.tokens_fed["policy"]
    print(f"kit SeeUPO tokens fed / exact floor: {kit / floor['kit']:.3f} ({kit:,} / {floor['kit']:,})")
    print(f"verl SeeUPO tokens fed / the kit's floor (ratio passes shared): {fed / floor['kit']:.3f}")


def run_case(case: str, with_spans: bool = True, dp_size: int = 1, micro_batch: int = 1, workdir: str | None = None,
             trainer: bool = False, reference: str = "kit", schedule: str = "constant", position: int = 3,
             empty_turn: bool = False, hold_lr: bool = True, variant: str = "paper", m_alignment: str = "rollout") -> float:
    """One step through verl's actor worker (or its SeeUPO trainer's actor update, `trainer`) and one
    through the kit (or `algorithm1`) from the same weights; the largest parameter difference."""
    import tempfile

    from accelerate import Accelerator

    from seeupo_gym.integrations.verl.cpu import cpu_actor_worker, verl_config, worker_parameters
    from seeupo_gym.integrations.verl.seeupo import VerlSeeUPOConfig, WorkerGroupActor, step_for
    from seeupo_gym.training.learner import LLMLearner, frozen_copy

    verl_order, kit_order, kl = CASES[case]
    model, tokenizer = load_model("tiny", dtype="float32", seed=0)
    initial = copy.deepcopy(model.state_dict())
    rollouts = scripted(tokenizer, EMPTY_TURN_ROLLOUTS if empty_turn else ROLLOUTS)
    with tempfile.TemporaryDirectory(dir=workdir) as folder:
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        overrides = verl_overrides(folder, kl, micro_batch, schedule)
        if trainer:  # the launcher's config: SeeUPO's defaults, then these
            from seeupo_gym.integrations.verl.__main__ import compose

            config = compose([*overrides, "actor_rollout_ref.rollout.n=3", f"algorithm.seeupo.order={verl_order}"])
        else:
            config = verl_config(overrides)
        worker = RateRecorder(cpu_actor_worker(config))
    scheduler = worker.actor.engine.lr_scheduler
    for _ in range(position if schedule != "constant" else 0):  # stands in for earlier training steps
        scheduler.step()
    start = scheduler.last_epoch
    rate = SCHEDULES[schedule][1](start)

    # verl: its actor worker (FSDP engine, verl's GSPO loss, KL loss and optimizer), driven by seeupo_step
    if trainer:
        through_trainer(worker, config, rollouts, tokenizer, bool(kl))
    else:
        actor = WorkerGroupActor(worker, dp_size=dp_size)
        if not hold_lr:  # the control: verl's schedule as its worker steps it, once per pool
            actor.save_lr_schedule = actor.restore_lr_schedule = lambda: None
        batch = verl_batch(rollouts, tokenizer.pad_token_id, with_spans)
        if kl:  # the reference is the initial policy, as at a run's first step
            batch.batch["ref_log_prob"] = actor.compute_log_prob(batch)
        options = VerlSeeUPOConfig(order=verl_order, variant=variant, **(AUTHORS(m_alignment) if variant == "authors" else {}))
        step_for(options)(batch, actor, options)
    verl_params = worker_parameters(worker)
    if schedule != "constant":
        print(f"pool learning rates: {' '.join(f'{r:.6g}' for r in worker.rates)}")
        print(f"step's rate by the schedule's formula: {rate:.6g}")
        print(f"schedule advanced by: {scheduler.last_epoch - start}")

    # the other side, from the same initial weights, at the step's rate
    model.load_state_dict(initial)
    if reference == "algorithm1":
        if kl:
            raise SystemExit("--reference algorithm1 has no KL term; use --reference kit for --case kl")
        algorithm1(model, rollouts, kit_order, rate)
    else:
        learner = LLMLearner(Accelerator(cpu=True), model, torch.optim.SGD(model.parameters(), lr=rate),
                             pad_token_id=tokenizer.pad_token_id, reference=frozen_copy(model), max_grad_norm=GRAD_CLIP)
        common = {"order": kit_order, "kl_coef": kl, "kl_estimator": "k3", "minibatch_size": 1024, "epochs": 1,
                  "clip_low": 0.2, "clip_high": 0.2}
        algorithm = (make_algorithm("seeupo_authors", {**common, **AUTHORS(m_alignment)}) if variant == "authors"
                     else make_algorithm("seeupo", {**common, "normalization": "batch"}))
        algorithm.update(kit_batch(rollouts), learner, torch.Generator().manual_seed(0))
    kit_params = model.state_dict()
    if set(kit_params) != set(verl_params):
        raise RuntimeError(f"parameter names differ: {sorted(set(kit_params) ^ set(verl_params))[:4]}")
    moved = max(float((kit_params[k] - initial[k]).abs().max()) for k in initial)
    print(f"case {case}: largest parameter change of the {reference}'s step: {moved:.3e}")
    return max(float((verl_params[k] - kit_params[k]).abs().max()) for k in initial)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", choices=tuple(CASES), default="reverse",
                        help="control: verl natural order against the kit's reverse (must differ)")
    parser.add_argument("--mask-runs", action="store_true", help="turns from response_mask runs, not recorded turn_spans")
    parser.add_argument("--dp-size", type=int, default=1, help="pad each pool to a multiple of this many ranks")
    parser.add_argument("--micro-batch", type=int, default=1, help="ppo_micro_batch_size_per_gpu")
    parser.add_argument("--trainer", action="store_true",
                        help="through SeeUPOTrainer._update_actor, its rows in a live TransferQueue on a local Ray")
    parser.add_argument("--reference", choices=("kit", "algorithm1"), default="kit",
                        help="the other side: the kit's SeeUPO.update, or Algorithm 1 written out here")
    parser.add_argument("--lr-schedule", choices=tuple(SCHEDULES), default="constant")
    parser.add_argument("--schedule-position", type=int, default=3, help="the schedule's step when the SeeUPO step starts")
    parser.add_argument("--empty-turn", action="store_true", help="one rollout's turn 2 is empty (zero tokens)")
    parser.add_argument("--no-lr-hold", action="store_true", help="control: let verl's worker step the schedule per pool")
    parser.add_argument("--count-tokens", action="store_true", help="tokens fed / exact floor, verl and the kit")
    parser.add_argument("--variant", choices=("paper", "authors"), default="paper",
                        help="authors: SeeUPO as the authors' code computes it, on both sides")
    parser.add_argument("--m-alignment", choices=("rollout", "position"), default="rollout", help="with --variant authors")
    args = parser.parse_args()
    if args.count_tokens:
        count_tokens()
        return
    diff = run_case(args.case, with_spans=not args.mask_runs, dp_size=args.dp_size, micro_batch=args.micro_batch,
                    trainer=args.trainer, reference=args.reference, schedule=args.lr_schedule,
                    position=args.schedule_position, empty_turn=args.empty_turn, hold_lr=not args.no_lr_hold,
                    variant=args.variant, m_alignment=args.m_alignment)
    print(f"max parameter difference vs {'the kit' if args.reference == 'kit' else 'Algorithm 1'}: {diff:.3e}")


if __name__ == "__main__":
    main()
