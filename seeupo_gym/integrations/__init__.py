"""The run layer's edges to other trainers and protocols: the OpenEnv server, TRL and SkyRL adapters."""
