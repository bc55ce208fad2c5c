"""The wire models of `seeupo/TurnBandit-v0` sessions (their one home is seeupo-gym's openenv_client)."""

from seeupo_gym.integrations.openenv_client import ResponseAction, SeeupoState, TextObservation

__all__ = ["ResponseAction", "SeeupoState", "TextObservation"]
