"""The verl launcher checks the config its workers run: interpolations are resolved once, in the
launcher, before the checks (seeupo_gym.integrations.verl.launch_check). Red team: a value such as
`trainer.v1.trainer_mode=${oc.env:MODE,seeupo}` reads "seeupo" in the launcher and "sync" in a
worker whose environment sets MODE (verl's `ray_kwargs.ray_init.runtime_env.env_vars`)."""

from __future__ import annotations

import pytest

pytest.importorskip("verl", reason="needs verl 0.9.1 (make venv installs it with --no-deps)")

MODE = "SEEUPO_TEST_TRAINER_MODE"
LOSS = "SEEUPO_TEST_LOSS_MODE"
HOSTILE = ["actor_rollout_ref.rollout.n=8", f"trainer.v1.trainer_mode=${{oc.env:{MODE},seeupo}}",
           f"actor_rollout_ref.actor.policy_loss.loss_mode=${{oc.env:{LOSS},gspo}}",
           f"+ray_kwargs.ray_init.runtime_env.env_vars.{MODE}=sync", f"+ray_kwargs.ray_init.runtime_env.env_vars.{LOSS}=vanilla"]


def test_the_config_verl_ships_to_its_workers_holds_the_values_the_launcher_checked(monkeypatch):
    """The launcher's run path, verl's launch stubbed (`run_ppo`, `machine_check`: no GPUs here); the
    shipped config is read again with the workers' environment."""
    import verl.trainer.main_ppo as main_ppo

    import seeupo_gym.integrations.verl.__main__ as launcher

    monkeypatch.delenv(MODE, raising=False)
    monkeypatch.delenv(LOSS, raising=False)
    shipped = []
    monkeypatch.setattr(launcher, "machine_check", lambda config: None)
    monkeypatch.setattr(main_ppo, "validate_config", lambda **kwargs: None)
    monkeypatch.setattr(main_ppo, "run_ppo", lambda config, **kwargs: shipped.append(config))
    assert launcher.main(HOSTILE) == 0
    (config,) = shipped
    workers = dict(config.ray_kwargs.ray_init.runtime_env.env_vars)
    assert workers == {MODE: "sync", LOSS: "vanilla"}
    for name, value in workers.items():  # what a worker's process has in its environment
        monkeypatch.setenv(name, value)
    # before: "sync" and "vanilla", values the launcher refuses (the interpolation was re-read here)
    assert config.trainer.v1.trainer_mode == "seeupo"
    assert config.actor_rollout_ref.actor.policy_loss.loss_mode == "gspo"


def test_with_the_launchers_environment_set_the_same_values_are_refused(monkeypatch, capsys):
    import seeupo_gym.integrations.verl.__main__ as launcher

    monkeypatch.setenv(MODE, "sync")
    assert launcher.main(["--print-config", *HOSTILE]) == 2
    assert "trainer.v1.trainer_mode must stay seeupo (got 'sync')" in capsys.readouterr().err


def test_resolve_for_workers_leaves_no_interpolation(monkeypatch):
    from omegaconf import OmegaConf

    from seeupo_gym.integrations.verl.launch_check import resolve_for_workers

    monkeypatch.setenv(MODE, "seeupo")
    config = resolve_for_workers(OmegaConf.create({"a": f"${{oc.env:{MODE}}}", "b": "${a}", "c": {"d": "${b}"}}))
    monkeypatch.setenv(MODE, "sync")
    assert OmegaConf.to_container(config) == {"a": "seeupo", "b": "seeupo", "c": {"d": "seeupo"}}
    assert "${" not in OmegaConf.to_yaml(config)
