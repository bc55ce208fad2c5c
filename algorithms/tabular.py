"""A tabular softmax policy that implements `Learner`, for exact and fast algorithm tests.

The world is any sequential joint-action task: T turns, K options per turn, a team reward
r(a_1..a_T) revealed at the end (TurnBandit tasks fit; this module knows nothing of envs and
reads tasks through the `JointActionTask` protocol). A task may end before T (`ends`, e.g. a
TurnBandit `stopping` task's stop option): a joint action is then any action sequence that ends. A context is (task index, earlier
choices); the policy holds one row of K logits per context. A "response" is one token, the
chosen option, so `TokenLogprobs` are [n, 1].

Besides the learner: sampling rollouts (`sample_batch`), the exact expected return of the
policy by enumerating joint actions (`exact_return`), exact V and Q per history (`exact_values`,
hence exact advantages Q - V), and `expected_batch`, a deterministic
batch whose trajectory counts follow the joint-action probabilities (no sampling noise).

Stochastic transitions: a task with `slip` > 0 executes another option than the chosen one with that
probability (`task.executed(a)`: [(option, probability)]). A context is then the executed history, a
turn's response the chosen option, the reward that of the executed options; J enumerates executed
histories with P(e | h) = sum_a pi(a | h) P(e | a). `expected_batch` does not take such tasks.

`SharedPolicy` (algorithms/shared_policy.py) is the same learner with logits shared across turns.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from seeupo_gym.algorithms.base import MicroLoss, TokenLogprobs, loss_share
from seeupo_gym.algorithms.rollout import RolloutBatch, Trajectory, Turn, TurnSample


class JointActionTask(Protocol):
    """T turns of K options each; `reward` of a full joint action, in [0, 1]."""

    task_id: str

    @property
    def num_turns(self) -> int: ...

    @property
    def num_options(self) -> int: ...

    def reward(self, actions: Sequence[int]) -> float: ...


def ends(task: JointActionTask, actions: Sequence[int]) -> bool:
    """Whether an episode of `task` is over after `actions`: the task's own `ends` where it has one
    (episodes whose length the policy chooses), else after T choices."""
    method = getattr(task, "ends", None)
    return bool(method(actions)) if method is not None else len(actions) >= task.num_turns


def joint_actions(task: JointActionTask) -> list[tuple[int, ...]]:
    """Every complete joint action of `task` (each ends, none of its prefixes does), in lexicographic order."""
    out: list[tuple[int, ...]] = []

    def visit(history: tuple[int, ...]) -> None:
        for a in range(task.num_options):
            actions = history + (a,)
            if ends(task, actions):
                out.append(actions)
            else:
                visit(actions)

    visit(())
    return out


def context_ids(task_index: int, history: Sequence[int]) -> list[int]:
    """The token ids of a tabular context: the task's index, then the earlier choices."""
    return [task_index, *history]


class TabularPolicy:
    """One softmax row per (task, history) context; a `Learner`.

    The reference policy is the initial table (for the KL term); `values()` reads a tabular value
    table per context (for PPO). `optimizer` is "sgd" or "adam" over the logits and values.
    `microbatch_samples` cuts every `minimize` into parts of that many samples (None: one part),
    which must not change the result.
    """

    @property
    def measures_alongside(self) -> bool:
        # Cut into parts of k samples, a trajectory's turns may land in different parts.
        return self.microbatch_samples is None

    def __init__(
        self,
        tasks: Sequence[JointActionTask],
        *,
        lr: float = 0.1,
        optimizer: str = "sgd",
        max_grad_norm: float | None = None,
        init_logits: torch.Tensor | None = None,
        microbatch_samples: int | None = None,
        observations: bool = False,
    ) -> None:
        self.tasks = list(tasks)
        # observations=True: trajectories carry info["observations"], what a TurnBandit env shows before
        # each turn (the turn and the previous choice, not the whole history), so that methods keyed by
        # observation (GiGPO's anchors) see states repeat across different histories.
        self.observations = observations
        self.microbatch_samples = microbatch_samples
        self.num_options = max(task.num_options for task in self.tasks)
        self.index: dict[tuple[int, ...], int] = {}
        for k, task in enumerate(self.tasks):
            for depth in range(task.num_turns):
                for history in itertools.product(range(task.num_options), repeat=depth):
                    self.index[tuple(context_ids(k, history))] = len(self.index)
        rows = len(self.index)
        # Options a task does not have (fewer than num_options) are masked out with -inf.
        self.invalid = torch.zeros(rows, self.num_options, dtype=torch.bool)
        for key, row in self.index.items():
            self.invalid[row, self.tasks[key[0]].num_options :] = True
        start = torch.zeros(rows, self.num_options) if init_logits is None else init_logits.clone().float()
        if start.shape != (rows, self.num_options):
            raise ValueError(f"init_logits must have shape {(rows, self.num_options)}, got {tuple(start.shape)}")
        self.logits = torch.nn.Parameter(start)
        self.value_table = torch.nn.Parameter(torch.zeros(rows))
        self.ref_logits = start.clone()
        self.max_grad_norm = max_grad_norm
        self.parameters = [self.logits, self.value_table]
        self._make_optimizer(optimizer, lr)

    def _make_optimizer(self, optimizer: str, lr: float) -> None:
        if optimizer == "sgd":
            self.optimizer: torch.optim.Optimizer = torch.optim.SGD(self.parameters, lr=lr)
        elif optimizer == "adam":
            self.optimizer = torch.optim.Adam(self.parameters, lr=lr)
        else:
            raise ValueError(f"optimizer must be 'sgd' or 'adam', got {optimizer!r}")
        self.optimizer_steps = 0

    # -- the policy ---------------------------------------------------------------------
    def logits_table(self) -> torch.Tensor:
        """The logits of every context row, [rows, K], with autograd (a subclass may compute them)."""
        return self.logits

    def logits_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """`logits_table()[rows]`, computed for those rows only."""
        return self.logits[rows]

    def _log_softmax(self, logits: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        invalid = self.invalid if rows is None else self.invalid[rows]
        return torch.log_softmax(logits.masked_fill(invalid, float("-inf")), dim=-1)

    def _rows(self, samples: Sequence[TurnSample]) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            rows = torch.tensor([self.index[tuple(s.turn.context_ids)] for s in samples], dtype=torch.long)
        except KeyError as err:
            raise KeyError(f"context {err.args[0]} is not in this tabular policy's tasks") from None
        actions = torch.tensor([s.turn.response_ids[0] for s in samples], dtype=torch.long)
        return rows, actions

    def log_probs_table(self) -> torch.Tensor:
        """log pi(. | context) for every context row, detached."""
        return self._log_softmax(self.logits_table().detach())

    def probs(self, task_index: int, history: Sequence[int]) -> torch.Tensor:
        return self.log_probs_table()[self.index[tuple(context_ids(task_index, history))]].exp()

    # -- Learner ------------------------------------------------------------------------
    def logprobs(self, samples: Sequence[TurnSample], *, grad: bool = True, entropy: bool = False) -> TokenLogprobs:
        rows, actions = self._rows(samples)
        with torch.set_grad_enabled(grad):
            table = self._log_softmax(self.logits_rows(rows), rows)  # one row per sample
            chosen = table.gather(1, actions.unsqueeze(1))
            # H = -sum_a p(a) log p(a) over the valid options (invalid ones have p = 0).
            h = -(table.exp() * table.masked_fill(self.invalid[rows], 0.0)).sum(-1).unsqueeze(1) if entropy else None
        return TokenLogprobs(chosen, torch.ones_like(chosen, dtype=torch.bool), entropy=h)

    def ref_logprobs(self, samples: Sequence[TurnSample]) -> TokenLogprobs:
        rows, actions = self._rows(samples)
        chosen = self._log_softmax(self.ref_logits)[rows, actions].unsqueeze(1)
        return TokenLogprobs(chosen, torch.ones_like(chosen, dtype=torch.bool))

    def values(self, samples: Sequence[TurnSample]) -> torch.Tensor:
        rows, _ = self._rows(samples)
        return self.value_table[rows].unsqueeze(1)

    def minimize(
        self, samples: Sequence[TurnSample], loss: MicroLoss, *, values: bool = False, entropy: bool = False
    ) -> dict[str, float]:
        self.optimizer.zero_grad()
        size = self.microbatch_samples or max(len(samples), 1)
        totals: dict[str, float] = {}
        for start in range(0, len(samples), size):
            part = samples[start : start + size]
            new = self.logprobs(part, entropy=True) if entropy else self.logprobs(part)
            share, stats = loss_share(loss(part, new, self.values(part) if values else None))
            share.backward()
            for key, value in stats.items():
                totals[key] = totals.get(key, 0.0) + value
        return {**totals, **self._step()}

    def optimize(self, loss: torch.Tensor) -> dict[str, float]:
        self.optimizer.zero_grad()
        loss.backward()
        return self._step()

    def _step(self) -> dict[str, float]:
        norm = torch.nn.utils.clip_grad_norm_(self.parameters, self.max_grad_norm if self.max_grad_norm else float("inf"))
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.optimizer_steps += 1
        return {"grad_norm": float(norm)}

    # -- exact evaluation ---------------------------------------------------------------
    def joint_action_probabilities(self, task_index: int) -> dict[tuple[int, ...], float]:
        """pi(a_1..a_n) of every joint action of task `task_index` (sums to 1)."""
        task = self.tasks[task_index]
        table = self.executed_table(task_index)
        out = {}
        for actions in joint_actions(task):
            p = 1.0
            for t, a in enumerate(actions):
                p *= table[self.index[tuple(context_ids(task_index, actions[:t]))]][a]
            out[actions] = p
        return out

    def executed_table(self, task_index: int, *, as_tensor: bool = False):
        """P(executed option | context) per row: pi itself, or with `slip` sum_a pi(a | h) P(e | a)."""
        probs = self.log_probs_table().exp()
        task = self.tasks[task_index]
        if getattr(task, "slip", 0.0):
            transition = torch.tensor([[p for _, p in task.executed(a)] for a in range(task.num_options)])
            probs = probs[:, : task.num_options] @ transition
        return probs if as_tensor else probs.tolist()

    def exact_values(self, task_index: int) -> tuple[dict[tuple[int, ...], float], dict[tuple[int, ...], float]]:
        """(V, Q) of the policy on one task, exactly: V(h) for every history h at which the episode
        goes on and Q(h + (a,)) = expected reward after choosing a at h (where h + (a,) ends the
        episode, the reward itself). The exact advantage of choosing a at h is Q(h + (a,)) - V(h).
        With `slip`, h is an executed history and Q(h + (a,)) averages over the executed option."""
        task = self.tasks[task_index]
        table = self.log_probs_table().exp().tolist()
        transitions = [getattr(task, "executed", lambda a: [(a, 1.0)])(a) for a in range(task.num_options)]
        q: dict[tuple[int, ...], float] = {}
        v: dict[tuple[int, ...], float] = {}

        def value(history: tuple[int, ...]) -> float:
            row = table[self.index[tuple(context_ids(task_index, history))]]
            outcome = [task.reward(history + (e,)) if ends(task, history + (e,)) else value(history + (e,))
                       for e in range(task.num_options)]
            for a in range(task.num_options):
                q[history + (a,)] = sum(p * outcome[e] for e, p in transitions[a])
            v[history] = sum(row[a] * q[history + (a,)] for a in range(task.num_options))
            return v[history]

        value(())
        return v, q

    def exact_returns(self) -> list[float]:
        """`exact_return` of every task at once (the same sums, vectorized over joint actions)."""
        if not hasattr(self, "_leaves"):
            self._leaves = []
            for k, task in enumerate(self.tasks):
                paths = joint_actions(task)
                depth = max(len(a) for a in paths)
                rows = [[self.index[tuple(context_ids(k, a[:t]))] if t < len(a) else 0 for t in range(depth)] for a in paths]
                acts = [[a[t] if t < len(a) else 0 for t in range(depth)] for a in paths]
                live = [[t < len(a) for t in range(depth)] for a in paths]
                self._leaves.append((torch.tensor(rows), torch.tensor(acts), torch.tensor(live),
                                     torch.tensor([task.reward(a) for a in paths], dtype=torch.float64)))
        out = []
        for k, (rows, acts, live, rewards) in enumerate(self._leaves):
            table = self.executed_table(k, as_tensor=True).double()
            p = torch.where(live, table[rows, acts], torch.ones((), dtype=torch.float64)).prod(1)
            out.append(float((p * rewards).sum()))
        return out

    def exact_return(self, task_index: int) -> float:
        """J(pi) = sum_a pi(a) r(a) for one task, by enumeration."""
        task = self.tasks[task_index]
        return sum(p * task.reward(a) for a, p in self.joint_action_probabilities(task_index).items())


@dataclass
class _Rollout:
    task_index: int
    actions: tuple[int, ...]  # the executed options
    chosen: tuple[int, ...] | None = None  # the chosen ones where they differ (slip); None: the executed


def _trajectory(policy: TabularPolicy, table: Sequence[list[float]] | dict[int, list[float]], rollout: _Rollout, rollout_id: str) -> Trajectory:
    task = policy.tasks[rollout.task_index]
    turns = []
    chosen = rollout.chosen or rollout.actions
    for t, a in enumerate(chosen):
        ids = context_ids(rollout.task_index, rollout.actions[:t])
        turns.append(Turn(context_ids=ids, response_ids=[a], sample_logprobs=[table[policy.index[tuple(ids)]][a]]))
    reward = task.reward(rollout.actions)
    info: dict = {}
    if getattr(task, "per_turn_rewards", False):
        info["turn_rewards"] = list(task.turn_rewards(rollout.actions))
    if policy.observations:
        info["observations"] = [f"turn {t + 1} after {rollout.actions[t - 1] if t else 'start'}" for t in range(len(rollout.actions))]
    return Trajectory(
        task_id=task.task_id,
        group_id=task.task_id,
        rollout_id=rollout_id,
        turns=turns,
        reward=reward,
        success=reward >= 1.0,
        info=info,
    )


def sample_batch(policy: TabularPolicy, rollouts_per_task: int, generator: torch.Generator) -> RolloutBatch:
    """G sampled rollouts of every task of the policy (B = number of tasks)."""
    log_rows: dict[int, list[float]] = {}  # log pi of the rows visited (a long task has many more)
    trajectories = []
    for k, task in enumerate(policy.tasks):
        # All G rollouts of a task advance one turn at a time; each draws from its own context's row.
        histories: list[tuple[int, ...]] = [() for _ in range(rollouts_per_task)]
        choices: list[tuple[int, ...]] = [() for _ in range(rollouts_per_task)]
        slip = getattr(task, "slip", 0.0)
        for _ in range(task.num_turns):
            going = [g for g, h in enumerate(histories) if not h or not ends(task, h)]
            if not going:
                break
            rows = torch.tensor([policy.index[tuple(context_ids(k, histories[g]))] for g in going])
            with torch.no_grad():
                log_probs = policy._log_softmax(policy.logits_rows(rows), rows)
            log_rows.update(zip(rows.tolist(), log_probs.tolist()))
            draws = torch.multinomial(log_probs.exp(), 1, generator=generator).squeeze(1).tolist()
            for g, a in zip(going, draws):
                executed = a
                if slip:
                    weights = torch.tensor([p for _, p in task.executed(a)])
                    executed = int(torch.multinomial(weights, 1, generator=generator))
                histories[g] = histories[g] + (executed,)
                choices[g] = choices[g] + (a,)
        trajectories += [
            _trajectory(policy, log_rows, _Rollout(k, h, choices[g] if slip else None), f"{task.task_id}/{g}")
            for g, h in enumerate(histories)
        ]
    return RolloutBatch(trajectories)


def expected_batch(policy: TabularPolicy, rollouts_per_task: int) -> RolloutBatch:
    """A deterministic batch: each joint action a of each task appears round(G * pi(a)) times
    (largest-remainder rounding, so every task has exactly G rollouts). As G grows, the batch's
    empirical distribution matches the policy's with error <= 1/G per joint action and no
    sampling noise, so an algorithm's update on it approaches its expected update."""
    log_rows = policy.log_probs_table().tolist()
    trajectories = []
    for k, task in enumerate(policy.tasks):
        if getattr(task, "slip", 0.0):
            raise ValueError(f"expected_batch takes deterministic tasks only; task {task.task_id} has slip {task.slip}: use sample_batch")
        probs = policy.joint_action_probabilities(k)
        quotas = {a: p * rollouts_per_task for a, p in probs.items()}
        counts = {a: int(q) for a, q in quotas.items()}
        leftover = rollouts_per_task - sum(counts.values())
        for a in sorted(quotas, key=lambda a: quotas[a] - counts[a], reverse=True)[:leftover]:
            counts[a] += 1
        g = 0
        for a, count in counts.items():
            for _ in range(count):
                trajectories.append(_trajectory(policy, log_rows, _Rollout(k, a), f"{task.task_id}/{g}"))
                g += 1
    return RolloutBatch(trajectories)
