"""Bounds `seeupo-serve` applies to a connection before it reads a byte of it.

uvicorn keeps a connection open for as long as its client takes to send a request head, and
accepts as many as the process has descriptors: 1,100 clients that never finish their headers
exhaust them, before any token check. This protocol (uvicorn's HTTP/1.1 one, `h11`) closes a
connection at once when its peer (the remote IP address) holds `max_connections_per_peer` already,
so that one peer cannot take every slot; when `max_connections` are open already (WebSocket
sessions included) it closes the one that has waited longest for a request head instead (it has
sent no whole request), or the new one when none waits, so that half-open connections from many
peers cannot keep a newcomer (`/health`) out; `configured` refuses a cap the process's descriptors
cannot hold (`RLIMIT_NOFILE`, raised to its hard limit first); closes one whose request head (the request line and headers, a WebSocket upgrade
request included) is not complete `header_timeout_s` after it opened or after its previous answer;
and closes one answered before its request body ended (a refusal), whose rest could drip forever.
Reading a body within its deadline is the app's (`request_guard.BoundedRequests`).
"""

from __future__ import annotations

import asyncio
import resource
import time
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


class BoundedConnections(H11Protocol):
    """uvicorn's h11 protocol with a connection cap, a per-peer cap and a request-head deadline.

    Use `BoundedConnections.configured(...)` as uvicorn's `http` protocol class.
    """

    max_connections = 256
    max_connections_per_peer = 64
    header_timeout_s = 10.0
    # Descriptors kept beyond the connections: the listening socket, logs, env and sandbox files.
    reserved_descriptors = 256

    @classmethod
    def configured(cls, *, max_connections: int, header_timeout_s: float,
                   max_connections_per_peer: int = 64) -> type["BoundedConnections"]:
        if max_connections < 1 or max_connections_per_peer < 1 or header_timeout_s <= 0:
            raise ValueError(f"max_connections and max_connections_per_peer must be >= 1 and header_timeout_s > 0, "
                             f"got {max_connections}, {max_connections_per_peer}, {header_timeout_s}")
        cls.ensure_descriptors(max_connections)
        return type(cls.__name__, (cls,), {"max_connections": max_connections, "header_timeout_s": header_timeout_s,
                                           "max_connections_per_peer": max_connections_per_peer})

    @classmethod
    def ensure_descriptors(cls, max_connections: int) -> None:
        """Raise this process's open-file limit to hold `max_connections` and the reserve (at most
        to its hard limit); ValueError, one line, when even that is too few: past it, accepting
        fails and no connection, `/health` included, gets in."""
        needed = max_connections + cls.reserved_descriptors
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and soft < needed:
            raised = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            if raised < needed:
                raise ValueError(f"--max-connections {max_connections} needs {needed} open files ({cls.reserved_descriptors} "
                                 f"kept for the server), and this process may open {raised} (ulimit -n): lower "
                                 f"--max-connections to {max(1, raised - cls.reserved_descriptors)} or raise the limit")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_deadline: asyncio.TimerHandle | None = None
        self._waiting_since: float | None = None  # when it began to wait for a request head

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if self._peer_connections() > self.max_connections_per_peer or (
                len(self.connections) > self.max_connections and not self._close_longest_waiting()):
            # Closed before reading anything: the descriptor is freed now, not at a timeout, and
            # its slot at once (not when the loop gets to `connection_lost`).
            self.connections.discard(self)
            transport.abort()
            return
        self._await_head()

    def _close_longest_waiting(self) -> bool:
        """Free a slot by closing the connection that has waited longest for a request head (a
        half-open one, or an idle keep-alive); False when every other one is busy or a WebSocket."""
        waiting = [each for each in self.connections
                   if each is not self and getattr(each, "_waiting_since", None) is not None]
        if not waiting:
            return False
        oldest = min(waiting, key=lambda each: each._waiting_since)
        self.connections.discard(oldest)
        oldest._head_received()
        oldest.transport.abort()
        return True

    def _peer_connections(self) -> int:
        """Open connections from this one's remote address, itself and WebSocket sessions included."""
        if not self.client:
            return 0
        peer = self.client[0]
        return sum(1 for each in self.connections if (getattr(each, "client", None) or (None,))[0] == peer)

    def connection_lost(self, exc: Exception | None) -> None:
        self._head_received()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE:  # a whole request head arrived
            self._head_received()

    def on_response_complete(self) -> None:
        if self.conn.their_state is h11.SEND_BODY:
            # Answered before its body ended: every byte of the rest would put the keep-alive
            # timeout off again, and the head deadline waits for a head that cannot come.
            self.transport.close()
        else:
            self._await_head()  # the next keep-alive request gets the same deadline
        super().on_response_complete()

    def _await_head(self) -> None:
        self._head_received()
        self._head_deadline = self.loop.call_later(self.header_timeout_s, self._head_late)
        self._waiting_since = time.monotonic()

    def _head_received(self) -> None:
        self._waiting_since = None
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_late(self) -> None:
        self._head_deadline = self._waiting_since = None
        # After a WebSocket upgrade the transport belongs to the WebSocket protocol.
        if self.transport.get_protocol() is self and self.conn.their_state is h11.IDLE:
            self.transport.abort()
