"""AppWorld as a Gymnasium env (`seeupo/AppWorld-v0`), its worlds served by separate processes.

See `env` (the env and `render_action`), `server` (server processes and their pool),
`sandbox` (the bubblewrap sandbox model code runs in), `worker` (what runs inside it),
`paths` (where the AppWorld interpreter and data are found) and `setup` (the command that
creates a managed AppWorld venv).
"""

from seeupo_gym.appworld.env import AppWorldEnv, extract_code, render_action
from seeupo_gym.appworld.paths import AppWorldSetupError, find_data_dir, find_python
from seeupo_gym.appworld.sandbox import SandboxLimits, SandboxUnavailable
from seeupo_gym.appworld.server import AppWorldServer, ServerDied, ServerError, ServerPool, ServerTimeout

__all__ = [
    "AppWorldEnv",
    "AppWorldServer",
    "AppWorldSetupError",
    "SandboxLimits",
    "SandboxUnavailable",
    "ServerDied",
    "ServerError",
    "ServerPool",
    "ServerTimeout",
    "extract_code",
    "find_data_dir",
    "find_python",
    "render_action",
]
