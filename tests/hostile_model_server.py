"""A hostile stand-in for an OpenAI-compatible model server, for tests of `OpenAIBackend`.

    python tests/hostile_model_server.py     # prints "hostile at http://127.0.0.1:PORT"

A client whose base URL is http://127.0.0.1:PORT/MODE/v1 meets MODE (the first path segment):

- drip-S: a valid 146-byte completion (HTTP head and body), one byte every S seconds;
- slow-S: a valid chat reply with invalid answer text, after S seconds (each turn of an episode);
- echo: `GET .../models` lists a model named after the request's Authorization header; a chat
  request's first turn is answered 200 with that header in the reply's text, the next with a 400
  whose body repeats every request header (raw and \\u-escaped); `/completions` (tokens mode)
  requests get a valid one-token completion and the 400 in turn.

Written on raw sockets so that it can send what no well-behaved library would.
"""

from __future__ import annotations

import json
import socket
import threading
import time

# 146 bytes on the wire: the dripped reply (head and body together).
_COMPLETION = {"choices": [{"token_ids": [1], "logprobs": {"token_logprobs": [-0.5]}, "finish_reason": "stop"}]}
_COUNT = {"completions": 0}
_LOCK = threading.Lock()


def _http(status: str, body: bytes) -> bytes:
    return (f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            f"Connection: close\r\n\r\n").encode() + body


def dripped_completion() -> bytes:
    body = json.dumps(_COMPLETION, separators=(",", ":")).encode()
    body += b" " * (146 - len(b"HTTP/1.1 200 OK\r\nContent-Length: 000\r\n\r\n") - len(body))
    return f"HTTP/1.1 200 OK\r\nContent-Length: {len(body):03d}\r\n\r\n".encode() + body


def read_request(conn: socket.socket) -> tuple[str, str, dict[str, str], bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        more = conn.recv(65536)
        if not more:
            raise ConnectionError("closed")
        data += more
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    method, path = lines[0].split(" ")[:2]
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        more = conn.recv(65536)
        if not more:
            raise ConnectionError("closed")
        body += more
    return method, path, headers, body


def _chat(content: str) -> bytes:
    return json.dumps({"choices": [{"index": 0, "finish_reason": "stop",
                                    "message": {"role": "assistant", "content": content}}]}).encode()


def serve(conn: socket.socket) -> None:
    method, path, headers, body = read_request(conn)
    mode, _, route = path.lstrip("/").partition("/")
    if route.endswith("/models"):
        name = headers.get("authorization", "none") if mode == "echo" else "stand-in"
        conn.sendall(_http("200 OK", json.dumps({"object": "list", "data": [{"id": name}]}).encode()))
        return
    if mode.startswith("drip-"):
        pause = float(mode.split("-", 1)[1])
        for byte in dripped_completion():
            conn.sendall(bytes([byte]))
            time.sleep(pause)
        return
    if mode.startswith("slow-"):
        time.sleep(float(mode.split("-", 1)[1]))
        conn.sendall(_http("200 OK", _chat("Z")))
        return
    if mode == "echo":
        request = json.loads(body or b"{}")
        turn = sum(m.get("role") == "assistant" for m in request.get("messages", []))
        if route.endswith("/chat/completions"):
            pass
        elif route.endswith("/completions"):
            with _LOCK:
                _COUNT["completions"] += 1
                turn = (_COUNT["completions"] + 1) % 2  # valid, echo, valid, ...
            if turn == 0:
                conn.sendall(_http("200 OK", json.dumps(_COMPLETION).encode()))
                return
        authorization = headers.get("authorization", "")
        if turn == 0:
            conn.sendall(_http("200 OK", _chat(f"I saw {authorization}")))
            return
        escaped = "".join(f"\\u{ord(c):04x}" for c in authorization)
        echo = json.dumps({"error": "bad request", "headers": headers})[:-1] + f', "escaped": "{escaped}"}}'
        conn.sendall(_http("400 Bad Request", echo.encode()))
        return
    conn.sendall(_http("404 Not Found", b'{"error": "no such mode"}'))


def start() -> tuple[str, socket.socket]:
    """The server in daemon threads of this process: (its URL, its listening socket to close)."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)

    def handle(conn: socket.socket) -> None:
        try:
            serve(conn)
        except (ConnectionError, OSError, ValueError):
            pass
        finally:
            conn.close()

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:  # closed
                return
            threading.Thread(target=handle, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return f"http://127.0.0.1:{listener.getsockname()[1]}", listener


if __name__ == "__main__":
    url, _ = start()
    print(f"hostile at {url}", flush=True)
    threading.Event().wait()
