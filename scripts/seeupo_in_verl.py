"""One SeeUPO step through verl's own actor worker against the kit's, on the same rollouts and weights.

Fixed scripted multi-turn rollouts (tool calls, tool results, one answer that mimics turn markers) on
the `tiny` model, float32, CPU. The verl side: `seeupo_step` on a verl `DataProto` (one row per
trajectory, response_mask 0 on tool results), its actor calls served by verl's `ActorRolloutRefWorker`
(role "actor": the FSDP2 engine, verl's GSPO and KL losses, its optimizer and grad clip; built in
this process on a one-rank gloo group, `seeupo_gym.integrations.verl.cpu`) through
`WorkerGroupActor`, the conversion verl's trainer makes. The kit side: `SeeUPO.update` with the
project's `LLMLearner`. SGD lr 0.5 and grad-norm clip 1 in both. Prints
`max parameter difference vs the kit: X`.

    .venv/bin/python scripts/seeupo_in_verl.py --case reverse|natural|kl|control [--mask-runs] [--dp-size 4]
"""

from __future__ import annotations

import argparse
import copy

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


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def scripted(tokenizer):
    """Per rollout: (group, reward, prompt ids, [(response ids, tool ids)])."""
    out = []
    for group, reward, turns in ROLLOUTS:
        pieces = [(encode(tokenizer, a), encode(tokenizer, "\n" + r + "\nassistant: ") if r else []) for a, r in turns]
        out.append((group, reward, encode(tokenizer, PROMPTS[group]), pieces))
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


def verl_overrides(model_path: str, kl_coef: float, micro_batch: int) -> list[str]:
    """The verl options of the run: SeeUPO's required actor loss, SGD as the kit's, float32 on CPU."""
    return [*CPU_ACTOR_OVERRIDES, f"actor_rollout_ref.model.path={model_path}",
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


def run_case(case: str, with_spans: bool = True, dp_size: int = 1, micro_batch: int = 1, workdir: str | None = None,
             trainer: bool = False) -> float:
    """One step through verl's actor worker (or its SeeUPO trainer's actor update, `trainer`) and one
    through the kit from the same weights; the largest parameter difference."""
    import tempfile

    from accelerate import Accelerator

    from seeupo_gym.integrations.verl.cpu import cpu_actor_worker, verl_config, worker_parameters
    from seeupo_gym.integrations.verl.seeupo import VerlSeeUPOConfig, WorkerGroupActor, seeupo_step
    from seeupo_gym.training.learner import LLMLearner, frozen_copy

    verl_order, kit_order, kl = CASES[case]
    model, tokenizer = load_model("tiny", dtype="float32", seed=0)
    initial = copy.deepcopy(model.state_dict())
    rollouts = scripted(tokenizer)
    with tempfile.TemporaryDirectory(dir=workdir) as folder:
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        overrides = verl_overrides(folder, kl, micro_batch)
        if trainer:  # the launcher's config: SeeUPO's defaults, then these
            from seeupo_gym.integrations.verl.__main__ import compose

            config = compose([*overrides, "actor_rollout_ref.rollout.n=3", f"algorithm.seeupo.order={verl_order}"])
        else:
            config = verl_config(overrides)
        worker = cpu_actor_worker(config)

    # verl: its actor worker (FSDP engine, verl's GSPO loss, KL loss and optimizer), driven by seeupo_step
    if trainer:
        through_trainer(worker, config, rollouts, tokenizer, bool(kl))
    else:
        actor = WorkerGroupActor(worker, dp_size=dp_size)
        batch = verl_batch(rollouts, tokenizer.pad_token_id, with_spans)
        if kl:  # the reference is the initial policy, as at a run's first step
            batch.batch["ref_log_prob"] = actor.compute_log_prob(batch)
        seeupo_step(batch, actor, VerlSeeUPOConfig(order=verl_order))
    verl_params = worker_parameters(worker)

    # the kit, from the same initial weights
    model.load_state_dict(initial)
    learner = LLMLearner(Accelerator(cpu=True), model, torch.optim.SGD(model.parameters(), lr=LR),
                         pad_token_id=tokenizer.pad_token_id, reference=frozen_copy(model), max_grad_norm=GRAD_CLIP)
    algorithm = make_algorithm("seeupo", {"order": kit_order, "normalization": "batch", "kl_coef": kl, "kl_estimator": "k3",
                                          "minibatch_size": 1024, "epochs": 1, "clip_low": 0.2, "clip_high": 0.2})
    algorithm.update(kit_batch(rollouts), learner, torch.Generator().manual_seed(0))
    kit_params = model.state_dict()
    if set(kit_params) != set(verl_params):
        raise RuntimeError(f"parameter names differ: {sorted(set(kit_params) ^ set(verl_params))[:4]}")
    moved = max(float((kit_params[k] - initial[k]).abs().max()) for k in initial)
    print(f"case {case}: largest parameter change of the kit's step: {moved:.3e}")
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
    args = parser.parse_args()
    diff = run_case(args.case, with_spans=not args.mask_runs, dp_size=args.dp_size, micro_batch=args.micro_batch,
                    trainer=args.trainer)
    print(f"max parameter difference vs the kit: {diff:.3e}")


if __name__ == "__main__":
    main()
