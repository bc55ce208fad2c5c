"""The resource server's table of seeupo-serve sessions and its front's credential rule (app.py), in
a module that imports nothing of NeMo Gym's, so that the rules are tested without its venv.

Each NeMo Gym session holds one seeupo-serve session, and a reset without a session cookie makes a
new one. Before a session opens, `to_close` picks the sessions to close: those unused for
`idle_s`, then finished episodes, least recently used first, until one more fits under the cap. A
live episode (started, not ended, used within `idle_s`) is never closed for another: with every
slot live the new reset is refused (`SessionsFull`), so resets without a cookie cannot take a
working runner's episode. The cap is the smaller of the front's own and seeupo-serve's
`max_sessions` (`effective_cap`), so the front refuses before seeupo-serve does.
"""

from __future__ import annotations

import hmac
import time
from typing import Any, Optional


class SessionsFull(RuntimeError):
    """Every session slot holds a live episode: the reset is refused."""


class Session:
    """One NeMo Gym session's seeupo-serve session: the count of messages seen, its last use,
    whether a request is in flight and whether its episode has ended."""

    def __init__(self, serve: Any) -> None:
        self.serve, self.seen, self.last_used, self.busy, self.done = serve, 0, time.monotonic(), 0, False

    def live(self, now: float, idle_s: float) -> bool:
        return bool(self.busy) or (not self.done and now - self.last_used <= idle_s)


def to_close(sessions: dict[str, Session], *, cap: int, idle_s: float, now: float) -> list[str]:
    """The ids to close before one more session opens under `cap` (see the module); `SessionsFull`
    when only live episodes hold the slots."""
    closing = [sid for sid, entry in sessions.items() if not entry.live(now, idle_s)]
    stale = {sid for sid in closing if now - sessions[sid].last_used > idle_s}
    closing = sorted(stale) + sorted((sid for sid in closing if sid not in stale), key=lambda sid: sessions[sid].last_used)
    over = len(sessions) - cap + 1  # how many must go for one more to fit
    if over > len(closing):
        raise SessionsFull(f"all {cap} sessions hold live episodes; retry when one ends")
    return closing[: max(over, len(stale))]


def effective_cap(own: Optional[int], served: Any) -> int:
    """The front's session cap: its own `max_sessions`, at most seeupo-serve's (from its description)."""
    served_cap = served if type(served) is int and served >= 1 else None
    caps = [cap for cap in (own, served_cap) if cap is not None]
    if not caps:
        raise ValueError("neither max_sessions nor the served env's description gives a session cap")
    return min(caps)


def credential_refusal(token: Optional[str], authorization: Optional[str]) -> Optional[str]:
    """Why a request is refused (None: let it in): with a token set, every peer, loopback included,
    must send it."""
    if not token:
        return None
    if hmac.compare_digest((authorization or "").encode(), f"Bearer {token}".encode()):
        return None
    return "this resource server requires its token: send it as Authorization: Bearer"
