"""The client AutoEnv builds for `seeupo-bfcl`: seeupo-gym's typed OpenEnv client.
Its MCP tools: `openenv.core.mcp_client.MCPToolClient(base_url=...)`."""

from seeupo_gym.integrations.openenv_client import SeeupoEnv


class SeeupoBfclEnv(SeeupoEnv):
    """`seeupo/BFCL-v4-v0` served by seeupo-serve (WebSocket sessions: reset, step, state)."""


__all__ = ["SeeupoBfclEnv"]
