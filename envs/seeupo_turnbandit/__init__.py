"""`seeupo/TurnBandit-v0` as an OpenEnv environment: `SeeupoTurnbanditEnv` is its client (see client.py)."""

from seeupo_turnbandit.client import SeeupoTurnbanditEnv
from seeupo_turnbandit.models import ResponseAction, SeeupoState, TextObservation

__all__ = ["SeeupoTurnbanditEnv", "ResponseAction", "SeeupoState", "TextObservation"]
