"""The client AutoEnv builds for `seeupo-appworld`: seeupo-gym's typed OpenEnv client.
Its MCP tools: `openenv.core.mcp_client.MCPToolClient(base_url=...)`."""

from seeupo_gym.integrations.openenv_client import SeeupoEnv


class SeeupoAppworldEnv(SeeupoEnv):
    """`seeupo/AppWorld-v0` served by seeupo-serve (WebSocket sessions: reset, step, state)."""


__all__ = ["SeeupoAppworldEnv"]
