"""Our envs in other frameworks: TRL, SkyRL, OpenEnv (the run layer: may import everything)."""
