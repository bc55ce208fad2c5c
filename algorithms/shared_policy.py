"""A softmax policy whose turns share parameters, for credit-assignment studies where they interact.

`TabularPolicy` gives every context its own row of logits, so an update on turn t never moves the
policy at another turn, unlike an LLM, whose turns share every weight. `SharedPolicy` keeps the same
contexts (task index, earlier choices), the same `Learner` methods, sampling and exact J, but
computes the logits of a context at turn t (0-based), after previous choice p, of task k as a
linear function of one-hot features, that is a sum of weight rows:

    logits(k, t, p) = option[:] + task[k] + previous[p] + task_turn[k, t]

`option`, `task` and `previous` are shared by every turn (and `option`, `previous` by every task), so
a step on turn t's samples moves the logits of every other turn; `task_turn` lets each task follow any
sequence of options, so every TurnBandit suite's optimal joint action stays reachable (its open-loop
path; with `slip` the closed-loop optimum may not be). The value table (PPO's and turn_gae's critic)
stays one entry per context. The policy starts uniform (all weights 0).
"""

from __future__ import annotations

from typing import Sequence

import torch

from seeupo_gym.algorithms.tabular import JointActionTask, TabularPolicy


class SharedPolicy(TabularPolicy):
    """A `Learner` whose logits are `option + task[k] + previous[p] + task_turn[k, t]` (module docstring)."""

    def __init__(
        self,
        tasks: Sequence[JointActionTask],
        *,
        lr: float = 0.1,
        optimizer: str = "sgd",
        max_grad_norm: float | None = None,
        microbatch_samples: int | None = None,
        observations: bool = False,
    ) -> None:
        super().__init__(tasks, lr=lr, optimizer=optimizer, max_grad_norm=max_grad_norm,
                         microbatch_samples=microbatch_samples, observations=observations)
        k_options = self.num_options
        max_turns = max(task.num_turns for task in self.tasks)
        rows = len(self.index)
        # Each row's features: its task, its turn (the history's length), its previous choice (K = none yet).
        task_of = torch.zeros(rows, dtype=torch.long)
        turn_of = torch.zeros(rows, dtype=torch.long)
        previous_of = torch.full((rows,), k_options, dtype=torch.long)
        for key, row in self.index.items():
            task_of[row], turn_of[row] = key[0], len(key) - 1
            if len(key) > 1:
                previous_of[row] = key[-1]
        self.task_of, self.turn_of, self.previous_of = task_of, turn_of, previous_of
        self.option = torch.nn.Parameter(torch.zeros(k_options))
        self.task = torch.nn.Parameter(torch.zeros(len(self.tasks), k_options))
        self.previous = torch.nn.Parameter(torch.zeros(k_options + 1, k_options))
        self.task_turn = torch.nn.Parameter(torch.zeros(len(self.tasks), max_turns, k_options))
        self.logits = None  # type: ignore[assignment]  # computed, not stored (`logits_table`)
        self.ref_logits = torch.zeros(rows, k_options)
        self.parameters = [self.option, self.task, self.previous, self.task_turn, self.value_table]
        self._make_optimizer(optimizer, lr)

    def logits_table(self) -> torch.Tensor:
        return self.logits_rows(torch.arange(len(self.index)))

    def logits_rows(self, rows: torch.Tensor) -> torch.Tensor:
        task, turn = self.task_of[rows], self.turn_of[rows]
        return self.option + self.task[task] + self.previous[self.previous_of[rows]] + self.task_turn[task, turn]
