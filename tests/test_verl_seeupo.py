"""SeeUPO on stock verl (seeupo_gym.integrations.verl): one step served by verl's own actor worker
(FSDP2 engine on CPU) equals the kit's update on the same scripted rollouts (scripts/seeupo_in_verl.py),
a control that must differ, verl's TransferQueue rows read as the same batch, the launcher's options
and refusals, and the red team of each entry point (malformed rows, sessions and turn spans, hostile
completion text and extra fields, NaN rewards)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("verl")

from seeupo_gym.integrations.verl.seeupo import (  # noqa: E402
    MAX_TURNS,
    VerlSeeUPOConfig,
    check_actor_options,
    mask_runs,
    seeupo_authors_step,
    seeupo_step,
    turn_spans,
)

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "seeupo_in_verl.py"
spec = importlib.util.spec_from_file_location("seeupo_in_verl", SCRIPT)
seeupo_in_verl = importlib.util.module_from_spec(spec)
spec.loader.exec_module(seeupo_in_verl)

PARITY = 1e-5


def run_script(*args: str) -> str:
    """The script's stdout: each case runs in a process of its own (it builds verl's worker on a gloo
    group and selects verl's CPU platform, process-wide state)."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def printed(stdout: str, label: str) -> str:
    import re

    found = re.findall(rf"^{re.escape(label)}: (.+)$", stdout, re.M)
    assert len(found) == 1, stdout[-2000:]
    return found[0]


def parity(*args: str, stdout: list | None = None) -> float:
    """The script's own printed figure against the kit, or against Algorithm 1 (`--reference algorithm1`)."""
    out = run_script(*args)
    if stdout is not None:
        stdout.append(out)
    versus = "Algorithm 1" if "algorithm1" in args else "the kit"
    return float(printed(out, f"max parameter difference vs {versus}"))


def test_one_step_through_verls_actor_worker_equals_the_kits_reverse_order():
    assert parity("--case", "reverse") <= PARITY


def test_control_verl_natural_order_against_the_kits_reverse_differs_by_far_more():
    assert parity("--case", "control") > 1000 * PARITY


@pytest.mark.slow
@pytest.mark.parametrize("case", ("natural", "kl"))
def test_one_step_through_verls_actor_worker_equals_the_kits_natural_order_and_with_kl(case):
    assert parity("--case", case) <= PARITY


@pytest.mark.slow
@pytest.mark.parametrize("case", ("reverse", "kl"))
def test_seeupo_trainers_actor_update_through_a_live_transfer_queue_equals_the_kit(case):
    # SeeUPOTrainer._update_actor as verl's v1 trainer calls it; only its Ray set-up is replaced (in-process worker).
    assert parity("--case", case, "--trainer") <= PARITY


def test_under_a_warmup_schedule_every_pool_runs_at_the_steps_rate_and_the_schedule_moves_once():
    # lr_warmup_steps=10 at step 3: 0.5 * 3/10 for all three pools, against Algorithm 1 at that rate.
    out = []
    assert parity("--case", "reverse", "--reference", "algorithm1", "--lr-schedule", "warmup", stdout=out) <= PARITY
    assert [float(x) for x in printed(out[0], "pool learning rates").split()] == pytest.approx([0.15] * 3, abs=1e-12)
    assert printed(out[0], "schedule advanced by") == "1"


@pytest.mark.slow
def test_under_a_cosine_schedule_every_pool_runs_at_the_steps_rate_and_the_schedule_moves_once():
    import math

    out = []
    assert parity("--case", "natural", "--reference", "algorithm1", "--lr-schedule", "cosine", stdout=out) <= PARITY
    rate = 0.5 * 0.5 * (1 + math.cos(math.pi * 3 / 20))
    assert [float(x) for x in printed(out[0], "pool learning rates").split()] == pytest.approx([rate] * 3, rel=1e-6)
    assert printed(out[0], "schedule advanced by") == "1"


@pytest.mark.slow
def test_control_verls_schedule_stepped_per_pool_differs_from_algorithm1_at_the_steps_rate():
    out = []
    assert parity("--case", "reverse", "--reference", "algorithm1", "--lr-schedule", "warmup", "--no-lr-hold",
                  stdout=out) > 1000 * PARITY
    assert printed(out[0], "schedule advanced by") == "3"


@pytest.mark.slow
@pytest.mark.parametrize("order", ("reverse", "natural"))
def test_a_row_with_an_empty_turn_pools_its_later_turns_at_their_true_index(order):
    # Against Algorithm 1 written from the paper, and against the kit (which keeps empty turns).
    assert parity("--case", order, "--reference", "algorithm1", "--empty-turn") <= PARITY
    assert parity("--case", order, "--empty-turn") <= PARITY


@pytest.mark.slow
def test_count_tokens_verl_feeds_each_pool_its_prefix_only():
    out = run_script("--count-tokens")
    verl = float(printed(out, "verl SeeUPO tokens fed / exact floor").split()[0])
    kit = float(printed(out, "kit SeeUPO tokens fed / exact floor").split()[0])
    before = float(printed(out, "verl before trimming (whole rows in every call) / exact floor").split()[0])
    assert verl <= 1.1 and kit <= 1.1
    assert before > 1.2  # the control: whole rows in every call, as before


@pytest.mark.slow
def test_turns_from_response_mask_runs_equal_the_recorded_spans_step():
    assert parity("--case", "reverse", "--mask-runs") <= PARITY


@pytest.mark.slow
def test_pools_padded_for_four_ranks_and_micro_batches_of_two_change_nothing():
    assert parity("--case", "reverse", "--dp-size", "4", "--micro-batch", "2") <= PARITY


# ------------------------------------------------------------------------------- red team


class RecordingActor:
    """Replaces verl's actor: records calls, so a refused batch is shown to have run nothing."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def compute_log_prob(self, data):
        self.calls.append("compute_log_prob")
        return torch.zeros_like(data.batch["response_mask"], dtype=torch.float32)

    def update_actor(self, data):
        self.calls.append(("update_actor", int(data.batch["response_mask"].sum())))
        return {"actor/pg_loss": 0.0, "actor/odd": "text"}


@pytest.fixture(scope="module")
def rollouts():
    from seeupo_gym.agents.models import load_model

    _, tokenizer = load_model("tiny")
    return seeupo_in_verl.scripted(tokenizer), tokenizer.pad_token_id


def batch_of(rollouts, spans=None):
    rows, pad = rollouts
    batch = seeupo_in_verl.verl_batch(rows, pad, with_spans=spans is None)
    if spans is not None:
        batch.non_tensor_batch["turn_spans"] = np.array(list(spans) + [None], dtype=object)[:-1]
    return batch


def recorded(rollouts):
    return [list(map(list, row)) for row in turn_spans(batch_of(rollouts))]


@pytest.mark.parametrize(
    "bad, message",
    [
        (lambda s: [[s[0][0], [s[0][0][0], s[0][1][1]]]] + s[1:], "overlaps"),  # turn 2 starts inside turn 1
        (lambda s: [[[0, 10_000]]] + s[1:], "out of"),
        (lambda s: [[[-1, 2]]] + s[1:], "out of"),
        (lambda s: [[[0.0, 2.0]]] + s[1:], "ints"),
        (lambda s: [[[True, 2]]] + s[1:], "ints"),
        (lambda s: [[["0", "2"]]] + s[1:], "ints"),
        (lambda s: [[[0, 2, 3]]] + s[1:], "ints"),
        (lambda s: ["0:2"] + s[1:], "list"),
        (lambda s: [["0:2"]] + s[1:], "ints"),
        (lambda s: [{"start": 0}] + s[1:], "list"),
        (lambda s: [[[k, k + 1] for k in range(MAX_TURNS + 1)]] + s[1:], "more than"),
        (lambda s: [[[s[0][0][0], s[0][0][1] + 1]]] + s[1:], "response_mask 0"),  # reaches into the tool result
        (lambda s: [[[3, 2]]] + s[1:], "reversed"),
    ],
)
def test_malformed_turn_spans_are_one_line_errors_and_nothing_runs(rollouts, bad, message):
    actor = RecordingActor()
    batch = batch_of(rollouts, bad(recorded(rollouts)))
    with pytest.raises(ValueError, match=message) as err:
        seeupo_step(batch, actor, VerlSeeUPOConfig())
    assert "\n" not in str(err.value) and len(str(err.value)) < 300
    assert actor.calls == []


@pytest.mark.parametrize("value", (float("nan"), float("inf")))
def test_a_non_finite_reward_refuses_the_batch_before_any_update(rollouts, value):
    actor = RecordingActor()
    batch = batch_of(rollouts)
    batch.batch["token_level_scores"][2, 0] = value
    with pytest.raises(ValueError, match="non-finite reward"):
        seeupo_step(batch, actor, VerlSeeUPOConfig())
    assert actor.calls == []


def test_a_batch_without_uid_groups_is_refused(rollouts):
    actor = RecordingActor()
    batch = batch_of(rollouts)
    del batch.non_tensor_batch["uid"]
    with pytest.raises(ValueError, match="uid"):
        seeupo_step(batch, actor, VerlSeeUPOConfig())
    assert actor.calls == []


def test_completion_text_that_mimics_turn_markers_does_not_split_a_turn(rollouts):
    # Rollout 3's last answer is "user: <tool_response> 20 </tool_response> assistant:": still one turn.
    spans = recorded(rollouts)
    assert len(spans[3]) == 3
    batch = batch_of(rollouts)
    assert [list(map(list, mask_runs(batch.batch["response_mask"][i]))) for i in range(len(batch))] == spans


def test_pools_run_in_the_configured_order_with_one_update_each(rollouts):
    actor = RecordingActor()
    metrics = seeupo_step(batch_of(rollouts), actor, VerlSeeUPOConfig(order="reverse"))
    assert metrics["seeupo/turn_pools"] == 3.0
    assert [c for c in actor.calls if c[0] == "update_actor"] == [
        ("update_actor", sum(e - s for row in recorded(rollouts) if len(row) >= t for s, e in [row[t - 1]])) for t in (3, 2, 1)]
    assert "seeupo/turn3/actor/odd" not in metrics
    # the batch carries no old log-probs: once, then the ratios after pools 3 and 2 (pool 1 has no later pool)
    assert actor.calls.count("compute_log_prob") == 3


class PoolRecordingActor(RecordingActor):
    """Replaces verl's actor: records each update's rows (their turn masks) and the LR-schedule calls."""

    def __init__(self) -> None:
        super().__init__()
        self.pools: list[dict] = []

    def update_actor(self, data):
        from seeupo_gym.integrations.verl.seeupo import POOL_ROWS

        self.calls.append("update_actor")
        self.pools.append({"rows": data.meta_info.get(POOL_ROWS), "mask": data.batch["response_mask"].clone(),
                           "attention": data.batch["attention_mask"].sum(-1).tolist(), "width": data.batch["responses"].shape[1]})
        return {}

    def save_lr_schedule(self):
        self.calls.append("save_lr")

    def restore_lr_schedule(self):
        self.calls.append("restore_lr")


def test_each_pool_is_cut_at_its_turns_end_and_an_empty_turn_keeps_its_index(rollouts):
    spans = recorded(rollouts)
    end0 = spans[3][0][1]
    # row 3: [add, (empty at the end of turn 1), mul, answer]; the tokens of "mul" and "answer" unchanged
    spans[3] = [spans[3][0], [end0, end0], spans[3][1], spans[3][2]]
    actor = PoolRecordingActor()
    metrics = seeupo_step(batch_of(rollouts, spans), actor, VerlSeeUPOConfig(order="natural"))
    assert metrics["seeupo/turn_pools"] == 4.0
    pools = actor.pools
    # pool 2: rows 0, 1, 3 and 4 reached turn 2; row 3's is empty: counted, not fed
    assert [p["rows"] for p in pools] == [6, 4, 2, 1]
    assert pools[1]["mask"].shape[0] == 3
    # pool 3 holds row 3's "mul" (its true turn 3) beside row 0's turn 3; pool 4 row 3's answer alone
    prompt = batch_of(rollouts).batch["prompts"].shape[1]
    lengths = batch_of(rollouts).batch["attention_mask"][:, :prompt].sum(-1).tolist()
    assert pools[2]["attention"] == [lengths[0] + spans[0][2][1], lengths[3] + spans[3][2][1]]
    assert pools[3]["attention"] == [lengths[3] + spans[3][3][1]]
    assert pools[3]["width"] == spans[3][3][1] and int(pools[3]["mask"].sum()) == spans[3][3][1] - spans[3][3][0]
    # one LR per step: kept before the first update, put back before each later one
    assert [c for c in actor.calls if c in ("save_lr", "restore_lr")] == ["save_lr", "restore_lr", "restore_lr", "restore_lr"]


def test_trimmed_rows_keep_their_prefix_and_drop_every_token_after_the_end(rollouts):
    from seeupo_gym.integrations.verl.seeupo import fed_tokens, trimmed

    batch = batch_of(rollouts)
    prompt = batch.batch["prompts"].shape[1]
    ends = [3, 0, 5, 1, 2, 4]
    cut = trimmed(batch, ends)
    assert cut.batch["responses"].shape[1] == 5 and cut.batch["input_ids"].shape[1] == prompt + 5
    for i, end in enumerate(ends):
        assert torch.equal(cut.batch["input_ids"][i, : prompt + end], batch.batch["input_ids"][i, : prompt + end])
        assert int(cut.batch["attention_mask"][i, prompt:].sum()) == min(end, int(batch.batch["attention_mask"][i, prompt:].sum()))
        assert not cut.batch["response_mask"][i, end:].any()
    assert fed_tokens(cut) == sum(int(batch.batch["attention_mask"][i, :prompt].sum())
                                  + min(e, int(batch.batch["attention_mask"][i, prompt:].sum())) for i, e in enumerate(ends))


@pytest.mark.parametrize(
    "options, message",
    [({"order": "sideways"}, "order"), ({"normalization": "rank"}, "normalization"), ({"m_clip": [1.1, 1.2]}, "m_clip"),
     ({"old_policy": "never"}, "old_policy"), ({"sequential_update": True}, "no option")],
)
def test_bad_seeupo_options_are_refused_in_one_line(options, message):
    with pytest.raises(ValueError, match=message):
        VerlSeeUPOConfig.from_mapping(options)


@pytest.mark.parametrize(
    "actor_options, message",
    [({"policy_loss": {"loss_mode": "vanilla"}, "loss_agg_mode": "seq-mean-token-mean"}, "loss_mode=gspo"),
     ({"policy_loss": {"loss_mode": "gspo"}, "loss_agg_mode": "token-mean"}, "seq-mean-token-mean"),
     ({"policy_loss": {"loss_mode": "gspo"}, "loss_agg_mode": "seq-mean-token-mean", "ppo_epochs": 2}, "ppo_epochs")],
)
def test_actor_options_seeupo_cannot_honour_are_refused(actor_options, message):
    with pytest.raises(ValueError, match=message):
        check_actor_options(actor_options)


# ----------------------------------------------------- verl's v1 rows (TransferQueue layout)


def tq_rows(rollouts, mutate=None):
    """The rollouts as verl's v1 trainer holds them: `list_of_dict_to_tensordict`, the function
    verl's TransferQueue agent loop stores its outputs with (unpadded, nested per row)."""
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    rows = seeupo_in_verl.verl_rows(rollouts[0])
    for row in rows:
        row["old_log_probs"] = torch.zeros(len(row["responses"]))
    if mutate:
        mutate(rows)
    keys = [f"{row['uid']}_s{k}_0" for k, row in enumerate(rows)]
    return list_of_dict_to_tensordict(rows), keys


def test_verls_v1_rows_read_as_the_same_padded_batch_the_parity_step_takes(rollouts):
    from seeupo_gym.integrations.verl.trainer import dataproto_from_rows

    rows, keys = tq_rows(rollouts)
    data = dataproto_from_rows(rows, keys, rollouts[1])
    reference = batch_of(rollouts)
    for name in ("prompts", "responses", "input_ids", "attention_mask", "position_ids", "response_mask", "token_level_scores"):
        assert torch.equal(data.batch[name], reference.batch[name]), name
    assert list(data.non_tensor_batch["uid"]) == list(reference.non_tensor_batch["uid"])
    assert turn_spans(data) == turn_spans(reference)


def test_an_agent_loop_with_several_outputs_per_session_is_refused(rollouts):
    from seeupo_gym.integrations.verl.trainer import dataproto_from_rows

    rows, keys = tq_rows(rollouts)
    keys[1] = keys[0][:-1] + "1"  # a second output of session 0
    with pytest.raises(ValueError, match="one output per episode"):
        dataproto_from_rows(rows, keys, rollouts[1])


@pytest.mark.parametrize("extra", ({"turn_spans": "0:5"}, {"turn_spans": [[0, 10**9]]}, {"turn_spans": [[0, 2], [1, 3]]}))
def test_hostile_extra_fields_from_an_agent_loop_are_one_line_errors_and_nothing_runs(rollouts, extra):
    from seeupo_gym.integrations.verl.trainer import dataproto_from_rows

    def plant(rows):
        for row in rows:
            row["extra_fields"] = dict(extra)

    rows, keys = tq_rows(rollouts, plant)
    actor = RecordingActor()
    with pytest.raises(ValueError) as err:
        seeupo_step(dataproto_from_rows(rows, keys, rollouts[1]), actor, VerlSeeUPOConfig())
    assert "\n" not in str(err.value) and actor.calls == []


def test_rows_without_recorded_spans_fall_back_to_the_response_mask_runs(rollouts):
    from seeupo_gym.integrations.verl.trainer import dataproto_from_rows

    rows, keys = tq_rows(rollouts, lambda rows: [row.update(extra_fields={"turn_spans": None}) for row in rows])
    data = dataproto_from_rows(rows, keys, rollouts[1])
    assert "turn_spans" not in data.non_tensor_batch
    assert turn_spans(data) == turn_spans(batch_of(rollouts))


def test_verl_registers_seeupos_estimator_and_it_gives_each_row_its_initial_m(rollouts):
    from verl.trainer.ppo import core_algos

    from seeupo_gym.algorithms import core
    from seeupo_gym.integrations.verl import trainer  # noqa: F401  (registers on import)

    batch = batch_of(rollouts)
    estimator = core_algos.get_adv_estimator_fn("seeupo")
    advantages, returns = estimator(token_level_rewards=batch.batch["token_level_scores"],
                                    response_mask=batch.batch["response_mask"], index=batch.non_tensor_batch["uid"],
                                    config={"seeupo": {"normalization": "group"}})
    rewards = torch.tensor([r for _, r, _ in seeupo_in_verl.ROLLOUTS], dtype=torch.float64)
    expected = core.group_advantages(rewards, torch.tensor([0, 0, 0, 1, 1, 1]), "group").float()
    assert torch.allclose(advantages, expected[:, None] * batch.batch["response_mask"])
    assert torch.equal(advantages, returns)
    from seeupo_gym.algorithms.seeupo_authors import authors_advantages

    authors, _ = estimator(token_level_rewards=batch.batch["token_level_scores"], response_mask=batch.batch["response_mask"],
                           index=batch.non_tensor_batch["uid"], config={"seeupo": {"variant": "authors"}})
    expected = authors_advantages(rewards, torch.tensor([0, 0, 0, 1, 1, 1])).float()
    assert torch.allclose(authors, expected[:, None] * batch.batch["response_mask"])


# --------------------------------------------------------------------------- the launcher


def launch(*args):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "seeupo_gym.integrations.verl", *args], capture_output=True, text=True,
                          timeout=300)


def test_launcher_help_lists_seeupos_options():
    result = launch("--help")
    assert result.returncode == 0
    for option in ("algorithm.seeupo.order", "algorithm.seeupo.normalization", "algorithm.seeupo.m_clip",
                   "algorithm.seeupo.old_policy"):
        assert option in result.stdout


def test_launcher_composes_verls_config_with_seeupos_options(capsys):
    from seeupo_gym.integrations.verl.__main__ import main

    code = main(["--print-config", "actor_rollout_ref.rollout.n=8", "algorithm.seeupo.order=natural",
                 "algorithm.seeupo.m_clip=[0.8,1.2]", "actor_rollout_ref.actor.optim.lr=1e-6"])
    out = capsys.readouterr()
    assert code == 0, out.err[-2000:]
    assert "order='natural'" in out.out and "m_clip=(0.8, 1.2)" in out.out
    assert "actor_rollout_ref.actor.optim.lr=1e-06" in out.out


@pytest.mark.parametrize("overrides, message", [
    (["actor_rollout_ref.rollout.n=1"], "rollout.n >= 2"),
    (["algorithm.seeupo.order=sideways"], "order must be one of"),
    (["algorithm.seeupo.bogus=1"], "no SeeUPO option"),
    (["actor_rollout_ref.actor.loss_agg_mode=token-mean"], "seq-mean-token-mean"),
    (["actor_rollout_ref.actor.ppo_epochs=2"], "ppo_epochs=1"),
    (["algorithm.adv_estimator=grpo"], "must stay seeupo"),
    (["trainer.v1.trainer_mode=sync"], "must stay seeupo"),
    (["actor_rollout_ref.actor.entropy_coeff=0.01"], "entropy"),
    (["--frob"], "unknown flag"),
    (["actor_rollout_ref.nope.x=1"], ""),
])
def test_launcher_refuses_what_seeupo_cannot_honour_in_one_line(overrides, message, capsys):
    from seeupo_gym.integrations.verl.__main__ import main

    code = main(["--print-config", *(["actor_rollout_ref.rollout.n=8"] if "rollout.n" not in overrides[0] else []), *overrides])
    err = capsys.readouterr().err
    assert code == 2
    lines = [line for line in err.splitlines() if line.startswith("seeupo verl:")]
    assert len(lines) == 1 and message in lines[0], err[-1500:]
    assert "Traceback" not in err


@pytest.mark.slow
def test_the_paper_run_script_builds_its_data_and_its_config_passes_every_check(tmp_path):
    import os
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[1] / "scripts" / "verl_seeupo_paper.sh"
    env = {**os.environ, "PYTHON": sys.executable, "SEEUPO_VERL_DATA": str(tmp_path)}
    result = subprocess.run(["bash", str(script), "bfcl", "--print-config"], capture_output=True, text=True, env=env,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "order='reverse'" in result.stdout and "actor_rollout_ref.rollout.n=8" in result.stdout
    assert "actor_rollout_ref.actor.kl_loss_coef=0.002" in result.stdout and "data.train_batch_size=32" in result.stdout
    import pandas as pd

    assert len(pd.read_parquet(tmp_path / "bfcl_train.parquet")) == 100


def test_every_accepted_but_unused_option_is_named_in_one_warning_line(caplog):
    import logging

    from seeupo_gym.integrations.verl.__main__ import compose
    from seeupo_gym.integrations.verl.trainer import UNUSED_OPTIONS, warn_unused_options

    config = compose(["actor_rollout_ref.rollout.n=8", "actor_rollout_ref.actor.ppo_mini_batch_size=16"])
    with caplog.at_level(logging.WARNING, logger="seeupo_gym.integrations.verl.trainer"):
        warn_unused_options(config)
    lines = [r.getMessage() for r in caplog.records if r.name == "seeupo_gym.integrations.verl.trainer"]
    assert len(lines) == 1 and "\n" not in lines[0]
    assert "actor_rollout_ref.actor.ppo_mini_batch_size=16 (each turn pool is one mini-batch)" in lines[0]
    assert all(key in lines[0] for key in UNUSED_OPTIONS)


def test_seeupo_trainer_warns_at_start_before_verls_own_set_up(monkeypatch):
    from seeupo_gym.integrations.verl import trainer

    seen = []
    monkeypatch.setattr(trainer, "warn_unused_options", lambda config: seen.append(config))
    base = trainer._trainer_base()
    monkeypatch.setattr(base, "__init__", lambda self, config: seen.append("verl's __init__"))
    from seeupo_gym.integrations.verl.__main__ import compose

    config = compose(["actor_rollout_ref.rollout.n=8"])
    trainer.seeupo_trainer_class()(config)
    assert seen == [config, "verl's __init__"]


# ------------------------------------------- the authors' variant (algorithm.seeupo.variant=authors)


class ScriptedVerlActor:
    """Replaces verl's actor with test_seeupo_authors' scripted policy (log-probs a fixed function of the
    token and of the updates with a loss token so far), recording each update's advantage per row."""

    def __init__(self) -> None:
        from test_seeupo_authors import scripted_logprob

        self.logprob, self.version, self.updates = scripted_logprob, 0, []

    def compute_log_prob(self, data):
        return self.logprob(data.batch["responses"], self.version) * data.batch["attention_mask"][:, -data.batch["responses"].shape[1]:]

    def update_actor(self, data):
        mask = data.batch["response_mask"].bool()
        self.updates.append({rid: float(data.batch["advantages"][k][mask[k]][0])
                             for k, rid in enumerate(data.non_tensor_batch["rid"]) if mask[k].any()})
        if mask.any():
            self.version += 1
        return {}


def verl_rollouts(batch):
    """A kit batch as seeupo_in_verl's rollouts: (group, reward, prompt, [(response, tool reply)])."""
    out = []
    for trajectory in batch:
        turns, pieces = trajectory.turns, []
        for k, turn in enumerate(turns):
            after = turns[k + 1].context_ids[len(turn.context_ids) + turn.num_response_tokens:] if k + 1 < len(turns) else []
            pieces.append((list(turn.response_ids), list(after)))
        out.append((trajectory.group_id, trajectory.reward, list(turns[0].context_ids), pieces))
    return out


@pytest.mark.parametrize("alignment, world", [("rollout", 1), ("position", 2)])
def test_authors_variant_through_verls_calls_trains_each_pool_with_the_kits_advantages_scripted_policy(alignment, world):
    """Same rollouts (ragged, groups of one, padding rows), same scripted policy: the advantage verl's
    update_actor gets for each row of each pool (0 on padding rows) equals the kit's `seeupo_authors` M,
    and so do the final ratio products; positional M with balance_batch's order over two ranks too."""
    from test_seeupo_authors import ScriptedPolicyLearner, random_batch

    from seeupo_gym.algorithms.seeupo_authors import SeeUPOAuthors, SeeUPOAuthorsConfig
    from seeupo_gym.integrations.verl.seeupo import step_for

    kit = random_batch(5)
    kit = type(kit)(list(kit)[: len(kit) // 2 * 2])
    assert any(len(g) == 1 for g in kit.groups().values()) and len({t.num_turns for t in kit}) > 1
    batch = seeupo_in_verl.verl_batch(verl_rollouts(kit), 0, with_spans=True)
    batch.non_tensor_batch["rid"] = np.array(kit.rollout_ids, dtype=object)
    options = dict(order="natural", old_policy="turn_start", m_clip=(0.8, 1.2), m_alignment=alignment,
                   max_steps=5, balance_world_size=world)
    actor = ScriptedVerlActor()
    config = VerlSeeUPOConfig(variant="authors", **options)
    metrics = step_for(config)(batch, actor, config)
    algorithm = SeeUPOAuthors(SeeUPOAuthorsConfig(kl_coef=0.01, minibatch_size=1 << 20, **options))
    algorithm.update(kit, ScriptedPolicyLearner(), torch.Generator().manual_seed(0))
    ours = [phase.weights for phase in algorithm.schedule]
    assert len(ours) == len(actor.updates) == 5  # max_steps pools, padding rows (advantage 0) in each
    gap = max(abs(pool[rid] - theirs[rid]) for pool, theirs in zip(ours, actor.updates) for rid in pool)
    assert all(pool.keys() == theirs.keys() for pool, theirs in zip(ours, actor.updates))
    print(f"\n{alignment}: max |advantage difference| verl vs kit: {gap:.3g}")
    assert gap <= 1e-6  # verl's advantages are float32
    assert abs(metrics["seeupo/ratio_product_min"] - float(algorithm.m_factors.min())) <= 1e-9
    assert abs(metrics["seeupo/ratio_product_max"] - float(algorithm.m_factors.max())) <= 1e-9
    assert metrics["seeupo/turn_pools"] == 5.0
    reordered = any(list(phase.rollout_ids) != kit.rollout_ids for phase in algorithm.schedule)
    assert reordered == (alignment == "position")


@pytest.mark.slow
@pytest.mark.parametrize("case, alignment", [("reverse", "rollout"), ("kl", "position")])
def test_authors_variant_one_step_through_verls_actor_worker_equals_the_kits_seeupo_authors(case, alignment):
    """verl's own actor worker (FSDP2 on CPU) driven by `seeupo_authors_step` against the kit's
    `seeupo_authors` with LLMLearner, from the same weights: padded pools, turn-start ratios, clipped M."""
    assert parity("--case", case, "--variant", "authors", "--m-alignment", alignment) <= PARITY


def test_authors_variant_refuses_a_row_longer_than_max_steps_before_any_call(rollouts):
    actor = RecordingActor()
    with pytest.raises(ValueError, match="max_steps"):
        seeupo_authors_step(batch_of(rollouts), actor, VerlSeeUPOConfig(variant="authors", max_steps=1))
    assert actor.calls == []


@pytest.mark.parametrize("options, message", [
    ({"variant": "theirs"}, "variant"), ({"m_alignment": "rows"}, "m_alignment"), ({"max_steps": 0}, "max_steps"),
    ({"balance_world_size": 0}, "balance_world_size")])
def test_bad_authors_options_are_refused_in_one_line(options, message):
    with pytest.raises(ValueError, match=message) as error:
        VerlSeeUPOConfig.from_mapping(options)
    assert "\n" not in str(error.value)
