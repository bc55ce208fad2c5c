"""User algorithms plug into the trainer without editing the package."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from trainer_helpers import tiny_config, trainable_changed

from seeupo_gym.algorithms import core
from seeupo_gym.algorithms.base import Algorithm, AlgorithmConfig, register_algorithm
from seeupo_gym.training.trainer import Trainer


@dataclass
class GroupReinforceConfig(AlgorithmConfig):
    baseline: str = "group"  # any of core.NORMALIZATIONS


@register_algorithm("test-group-reinforce")
class GroupReinforce(Algorithm):
    """REINFORCE with a group-mean baseline: -mean_samples A_i * sum_tokens log pi(y)."""

    config_class = GroupReinforceConfig
    updates: list[int] = []

    def update(self, batch, learner, generator):
        self.updates.append(len(batch))
        advantages = core.trajectory_advantages(batch, self.config.baseline)
        samples = batch.samples()
        new = learner.logprobs(samples)
        weights = core.per_sample(advantages, samples, new.logprobs)
        loss = -(weights * (new.logprobs * new.mask).sum(-1)).mean()
        return {"loss": float(loss), **learner.optimize(loss)}


def test_algorithm_defined_in_a_test_file_trains_a_step_through_the_trainer(tmp_path):
    GroupReinforce.updates.clear()
    config = tiny_config(tmp_path, "algorithm={name: test-group-reinforce, baseline: none}", "train.steps=1",
                         "env.kwargs={max_turns: 1}")
    with Trainer(config) as trainer:
        assert isinstance(trainer.algorithm, GroupReinforce) and trainer.algorithm.config.baseline == "none"
        records = trainer.train()
        assert trainable_changed(trainer.accelerator.unwrap_model(trainer.model)) > 1e-4
    assert GroupReinforce.updates == [2]
    assert records[0]["update/grad_norm"] > 0 and "update/loss" in records[0]


PLUGIN = '''
import torch
from seeupo_gym.algorithms.base import Algorithm, register_algorithm

@register_algorithm("test-file-plugin-sft")
class NegativeLikelihood(Algorithm):
    def update(self, batch, learner, generator):
        new = learner.logprobs(batch.samples())
        loss = -(new.logprobs * new.mask).sum() / new.mask.sum()
        return {"nll": float(loss), **learner.optimize(loss)}
'''


def test_algorithm_in_a_plugin_file_named_by_the_config_trains(tmp_path):
    plugin = tmp_path / "my_algorithm.py"
    plugin.write_text(PLUGIN)
    config = tiny_config(tmp_path, "algorithm.name=test-file-plugin-sft", "train.steps=1", "env.kwargs={max_turns: 1}")
    config.plugins.append(str(plugin))
    with Trainer(config) as trainer:
        assert type(trainer.algorithm).__name__ == "NegativeLikelihood"
        records = trainer.train()
    assert records[0]["update/nll"] > 0 and torch.isfinite(torch.tensor(records[0]["update/grad_norm"]))


def test_the_readme_rloo_example_trains_a_step_through_the_trainer(tmp_path):
    from trainer_helpers import ROOT

    config = tiny_config(tmp_path, "algorithm={name: rloo, minibatch_size: 2}", "train.steps=1",
                         "env.kwargs={max_turns: 1}", "model.max_tokens_per_microbatch=512")
    config.plugins.append(str(ROOT / "docs" / "examples" / "rloo.py"))
    with Trainer(config) as trainer:
        records = trainer.train()
        assert trainable_changed(trainer.accelerator.unwrap_model(trainer.model)) > 1e-6
    assert records[0]["update/optimizer_steps"] >= 1 and "update/policy_loss" in records[0]
