"""The run layer's edges to other trainers and protocols (OpenEnv server, trainer adapters)."""
