"""AppWorld over `seeupo-serve seeupo/AppWorld-v0` (each session its own AppWorld server and sandbox,
on the serving machine): `vf-eval seeupo-vf-appworld --env.taskset.serve-url URL`."""

from seeupo_verifiers import SeeupoEnv, SeeupoHarness, SeeupoTaskset


class AppWorldTaskset(SeeupoTaskset):
    ENV_ID = "seeupo/AppWorld-v0"


__all__ = ["AppWorldTaskset", "SeeupoEnv", "SeeupoHarness"]
