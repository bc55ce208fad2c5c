"""verifiers v1 tasksets for seeupo-gym's envs, each played over `seeupo-serve` (module `seeupo_vf_bfcl`,
`seeupo_vf_appworld`, `seeupo_vf_turnbandit`; `vf-eval seeupo-vf-bfcl ...`). See `taskset.py`."""

from seeupo_verifiers.taskset import (SeeupoConfig, SeeupoData, SeeupoEnv, SeeupoEnvConfig, SeeupoHarness,
                                      SeeupoTask, SeeupoTaskset)

__all__ = ["SeeupoConfig", "SeeupoData", "SeeupoEnv", "SeeupoEnvConfig", "SeeupoHarness", "SeeupoTask",
           "SeeupoTaskset"]
