"""`seeupo/AppWorld-v0` as an OpenEnv environment: `SeeupoAppworldEnv` is its client (see client.py)."""

from seeupo_appworld.client import SeeupoAppworldEnv
from seeupo_appworld.models import ResponseAction, SeeupoState, TextObservation

__all__ = ["SeeupoAppworldEnv", "ResponseAction", "SeeupoState", "TextObservation"]
