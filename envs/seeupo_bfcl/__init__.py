"""`seeupo/BFCL-v4-v0` as an OpenEnv environment: `SeeupoBfclEnv` is its client (see client.py)."""

from seeupo_bfcl.client import SeeupoBfclEnv
from seeupo_bfcl.models import ResponseAction, SeeupoState, TextObservation

__all__ = ["SeeupoBfclEnv", "ResponseAction", "SeeupoState", "TextObservation"]
