"""`seeupo/TurnBandit-v0` in the tools format, as OpenEnv's `server.app:app` layout expects it; `main()` is
`seeupo-serve seeupo/TurnBandit-v0 action_format=tools` (the same bounds, token rule and flags)."""

from seeupo_gym.integrations.openenv_cli import package_main
from seeupo_gym.integrations.openenv_server import create_app

ENV_ID = "seeupo/TurnBandit-v0"
ENV_KWARGS = {"action_format": "tools"}

app = create_app(ENV_ID, ENV_KWARGS)


def main() -> None:
    package_main(ENV_ID, ENV_KWARGS)


if __name__ == "__main__":
    main()
