"""Length-prefixed JSON messages over a Unix stream socket, shared by host and sandbox.

A message is a 4-byte big-endian length and that many bytes of UTF-8 JSON. A file descriptor
may ride along with a message (SCM_RIGHTS): that is how the host hands an episode its socket.
"""

from __future__ import annotations

import json
import socket
import struct
import time
from typing import Any

HEADER = struct.Struct(">I")
MAX_MESSAGE_BYTES = 64 * 2**20  # a larger header means a broken or hostile peer


class WireError(ConnectionError):
    """The peer closed the connection or sent something that is not a message."""


def send(sock: socket.socket, message: Any, fd: int | None = None) -> None:
    body = json.dumps(message, ensure_ascii=False).encode("utf-8", "surrogatepass")
    frame = HEADER.pack(len(body)) + body
    if fd is None:
        sock.sendall(frame)
        return
    sent = socket.send_fds(sock, [frame], [fd])
    if sent < len(frame):
        sock.sendall(frame[sent:])


def receive(
    sock: socket.socket, with_fd: bool = False, timeout: float | None = None, max_bytes: int = MAX_MESSAGE_BYTES
) -> tuple[Any, int | None]:
    """(message, fd or None). Raises WireError on EOF or a malformed message (over `max_bytes`,
    not UTF-8 JSON, nested too deeply), TimeoutError when the whole message has not arrived
    within `timeout` seconds (a peer that trickles bytes cannot stretch the wait)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    fd = None
    if with_fd:
        data, fds, _, _ = socket.recv_fds(sock, HEADER.size, 1)
        fd = fds[0] if fds else None
        if not data:
            raise WireError("connection closed")
        header = data + _read_exactly(sock, HEADER.size - len(data), deadline)
    else:
        header = _read_exactly(sock, HEADER.size, deadline)
    (length,) = HEADER.unpack(header)
    if length > max_bytes:
        raise WireError(f"message of {length} bytes is over the limit of {max_bytes}")
    body = _read_exactly(sock, length, deadline)
    try:
        return json.loads(body.decode("utf-8", "surrogatepass")), fd
    except (ValueError, RecursionError) as error:
        raise WireError(f"malformed message: {type(error).__name__}: {str(error)[:200]}") from error


def _read_exactly(sock: socket.socket, count: int, deadline: float | None = None) -> bytes:
    chunks, left = [], count
    while left:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("the message did not arrive in time")
            sock.settimeout(remaining)
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise WireError("connection closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
