"""A hostile stand-in for `seeupo-serve`, for tests of the `seeupo/Remote-v0` client.

    python tests/hostile_env_server.py     # prints "hostile at http://127.0.0.1:PORT"

A client pointed at http://127.0.0.1:PORT/MODE meets MODE (the first path segment). The server
describes itself as a default TurnBandit server and answers resets with a real TurnBandit env's
(so that an agent can start an episode); then, by MODE:

- honest: steps answered by the real env;
- nan_reward, list_info, int_text, string_done, long_text: one field of each step answer wrong;
- str_messages, str_tool_calls: a step's info (a dict) holds messages the agent cannot read: a string
  for a message, a string for a tool call; reset_str_messages, reset_no_messages: a reset's info;
- deflate_bomb: the first answer is a 415 kB permessage-deflate frame of 400 M characters;
- gzip_bomb: the description (GET /seeupo/env) is a 265 kB gzip body of 256 MiB;
- drip_description: the description's body comes one byte per 1.5 s (its headers at once);
- refuse_reset: every reset is answered with an error (as seeupo-serve says a reset failed);
- never_done: steps answered by the real env, but the episode never ends: past the env's own end
  (its turn limit, the last decision) each step answers done=false with one more user message;
- huge_reward: every step's reward is 1e300 (finite, but inf once it is a float32);
- reset_int_content, reset_str_tools: a reset's info holds a message whose content is a number, or
  `tools` that is a string; step_no_messages: a step's info has no messages; huge_messages: a step's
  info carries a 25 MB user message (the observation text stays in its space);
- drip_status, drip_headers: the description's status line, or its headers, one byte per 0.5 s;
  endless_continue: `100 Continue` answers, one per 0.5 s, never a final one;
- declared_turns: the description declares `max_turns` 10**9 as its default, and the episode never
  ends (as never_done).

Sessions may set `action_format` at reset (as `seeupo-serve --session-kwargs action_format`), so
TRL's adapter, which plays the tools format, can play it too.

Written on raw sockets so that it can send what no well-behaved library would.
"""

from __future__ import annotations

import base64
import hashlib
import inspect
import json
import socket
import struct
import threading
import time
import zlib

import gymnasium as gym

import seeupo_gym  # noqa: F401

ENV_ID = "seeupo/TurnBandit-v0"
SESSION_KWARGS = ("action_format",)  # what a session may set at reset, as `seeupo-serve --session-kwargs` allows
WS_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


def description() -> dict:
    env = gym.make(ENV_ID, disable_env_checker=True)
    creator = gym.envs.registration.load_env_creator(gym.spec(ENV_ID).entry_point)
    defaults = {name: p.default for name, p in inspect.signature(creator).parameters.items()
                if p.default is not inspect.Parameter.empty}
    space = {"type": "UnicodeText", "min_length": 0, "max_length": env.observation_space.max_length}
    return {"env_id": ENV_ID, "env_kwargs": {}, "default_kwargs": json.loads(json.dumps(defaults)),
            "session_kwargs": list(SESSION_KWARGS),
            "observation_space": space, "action_space": {"type": "UnicodeText", "min_length": 0, "max_length": 32768},
            "task_ids": list(env.unwrapped.task_ids), "max_sessions": 8}


def _deflate_unit(block: bytes) -> bytes:
    """`block` as raw deflate ending in a full flush: the compressor forgets everything, so the
    same bytes repeated are a valid stream of the block repeated (cheap to build at any size)."""
    pack = zlib.compressobj(9, zlib.DEFLATED, -15)
    return pack.compress(block) + pack.flush(zlib.Z_FULL_FLUSH)


def deflated(total: int, chunk: int = 1 << 20) -> bytes:
    """A permessage-deflate payload of `total` bytes of 'a' (the 00 00 ff ff tail dropped)."""
    return (_deflate_unit(b"a" * chunk) * (total // chunk))[:-4]


def gzipped(total: int, chunk: int = 1 << 20) -> bytes:
    """A gzip body of `total` spaces."""
    block, count = b" " * chunk, total // chunk
    crc = 0
    for _ in range(count):
        crc = zlib.crc32(block, crc)
    header = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x02\xff"
    last = b"\x03\x00"  # an empty final block
    return header + _deflate_unit(block) * count + last + struct.pack("<II", crc, (chunk * count) & 0xFFFFFFFF)


def read_head(conn: socket.socket) -> tuple[str, dict[str, str]]:
    data = b""
    while b"\r\n\r\n" not in data:
        more = conn.recv(4096)
        if not more:
            raise ConnectionError("closed")
        data += more
    lines = data.split(b"\r\n\r\n")[0].decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return lines[0].split(" ")[1], headers


def read_frame(conn: socket.socket, inflate: zlib._Decompress) -> bytes:
    def exact(n: int) -> bytes:
        data = b""
        while len(data) < n:
            more = conn.recv(n - len(data))
            if not more:
                raise ConnectionError("closed")
            data += more
        return data

    first, second = exact(2)
    length = second & 0x7F
    if length == 126:
        length = struct.unpack("!H", exact(2))[0]
    elif length == 127:
        length = struct.unpack("!Q", exact(8))[0]
    mask = exact(4) if second & 0x80 else b"\0\0\0\0"
    payload = bytes(b ^ mask[i % 4] for i, b in enumerate(exact(length)))
    if first & 0x0F == 8:
        raise ConnectionError("client closed")
    if first & 0x40:  # compressed by the client
        payload = inflate.decompress(payload + b"\x00\x00\xff\xff")
    return payload


def send_frame(conn: socket.socket, payload: bytes, compressed: bool = False) -> None:
    first = 0x80 | 0x01 | (0x40 if compressed else 0)
    n = len(payload)
    if n < 126:
        head = struct.pack("!BB", first, n)
    elif n < 1 << 16:
        head = struct.pack("!BBH", first, 126, n)
    else:
        head = struct.pack("!BBQ", first, 127, n)
    conn.sendall(head + payload)


def http_answer(conn: socket.socket, body: bytes, extra: str = "") -> None:
    conn.sendall(f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n{extra}"
                 f"Connection: close\r\n\r\n".encode() + body)


def observation(text, reward, done, truncated, info) -> bytes:
    data = {"observation": {"text": text, "truncated": truncated, "info": info}, "reward": reward, "done": done}
    return json.dumps({"type": "observation", "data": data}).encode()


def drip(conn: socket.socket, data: bytes, every_s: float = 0.5) -> None:
    for byte in data:
        conn.sendall(bytes([byte]))
        time.sleep(every_s)


def serve(conn: socket.socket, described: bytes, bombs: dict[str, bytes]) -> None:
    path, headers = read_head(conn)
    mode, _, path = path.lstrip("/").partition("/")
    if path.startswith("seeupo/env"):
        if mode == "drip_status":
            return drip(conn, b"HTTP/1.1 200 OK\r\n" * 1000)
        if mode == "drip_headers":
            conn.sendall(b"HTTP/1.1 200 OK\r\n")
            return drip(conn, b"X-Slow: " + b"a" * 10000)
        if mode == "endless_continue":
            while True:
                conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
                time.sleep(0.5)
        if mode == "declared_turns":
            lying = json.loads(described)
            lying["default_kwargs"]["max_turns"] = 10**9
            return http_answer(conn, json.dumps(lying).encode())
        if mode == "gzip_bomb":
            return http_answer(conn, bombs["gzip"], "Content-Encoding: gzip\r\n")
        if mode == "drip_description":
            conn.sendall(f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(described)}\r\n"
                         f"Connection: close\r\n\r\n".encode())
            for byte in described:
                conn.sendall(bytes([byte]))
                time.sleep(1.5)
            return None
        return http_answer(conn, described)
    key = headers["sec-websocket-key"].encode()
    accept = base64.b64encode(hashlib.sha1(key + WS_GUID).digest()).decode()
    deflate = "permessage-deflate" in headers.get("sec-websocket-extensions", "")
    extension = "Sec-WebSocket-Extensions: permessage-deflate\r\n" if deflate else ""
    conn.sendall(f"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                 f"Sec-WebSocket-Accept: {accept}\r\n{extension}\r\n".encode())
    inflate = zlib.decompressobj(-15)
    env = gym.make(ENV_ID, disable_env_checker=True)
    over: tuple | None = None  # never_done: the env's real last answer, once its episode has ended
    while True:
        message = json.loads(read_frame(conn, inflate))
        if mode == "deflate_bomb":
            send_frame(conn, bombs["deflate"], compressed=True)
            continue
        if message["type"] == "reset" and mode == "refuse_reset":
            send_frame(conn, json.dumps({"type": "error", "data": {"message": "reset failed: no such luck",
                                                                   "code": "EXECUTION_ERROR"}}).encode())
            continue
        if message["type"] == "close":
            return
        if message["type"] == "step" and over is not None:
            text, info = over
            info = {**info, "messages": info["messages"] + [{"role": "assistant", "content": message["data"]["response"]},
                                                            {"role": "user", "content": "Go on."}]}
            over = (text, info)
            send_frame(conn, observation(text, 0.0, False, False, info))
            continue
        if message["type"] == "reset":
            over = None
            data = dict(message.get("data") or {})
            seed = data.pop("seed", None)
            kwargs = {k: v for k, v in (data.pop("env_kwargs", None) or {}).items() if k in SESSION_KWARGS}
            if kwargs:
                env = gym.make(ENV_ID, disable_env_checker=True, **kwargs)
            text, info = env.reset(seed=seed, options=data or None)
            if mode == "reset_str_messages":
                info = {**info, "messages": ["hello"]}
            elif mode == "reset_no_messages":
                info = {k: v for k, v in info.items() if k != "messages"}
            elif mode == "reset_int_content":
                info = {**info, "messages": info["messages"][:-1] + [{"role": "user", "content": 5}]}
            elif mode == "reset_str_tools":
                info = {**info, "tools": "all of them"}
            send_frame(conn, observation(text, None, False, False, info))
            continue
        text, reward, terminated, truncated, info = env.step(message["data"]["response"])
        done = terminated or truncated
        if mode in ("never_done", "declared_turns") and done:
            reward, done, truncated = 0.0, False, False
            info = {**info, "messages": info["messages"] + [{"role": "user", "content": "Go on."}]}
            over = (text, info)
        if mode == "huge_reward":
            reward = 1e300
        elif mode == "nan_reward":
            reward = float("nan")
        elif mode == "list_info":
            info = [info]
        elif mode == "int_text":
            text = 5
        elif mode == "string_done":
            done = "yes"
        elif mode == "long_text":
            text = "x" * (env.observation_space.max_length + 1)
        elif mode == "str_messages":
            info = {**info, "messages": info["messages"][:-1] + ["hello"]}
        elif mode == "step_no_messages":
            info = {k: v for k, v in info.items() if k != "messages"}
        elif mode == "huge_messages":
            info = {**info, "messages": info["messages"] + [{"role": "user", "content": "x" * (25 << 20)}]}
        elif mode == "str_tool_calls":
            info = {**info, "messages": info["messages"] + [{"role": "assistant", "content": "", "tool_calls": ["x"]}]}
        send_frame(conn, observation(text, reward, done, truncated, info))


def main() -> None:
    bombs = {"deflate": deflated(400 << 20), "gzip": gzipped(256 << 20)}
    described = json.dumps(description()).encode()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    print(f"hostile at http://127.0.0.1:{listener.getsockname()[1]} ({', '.join(f'{k} {len(v)} bytes' for k, v in bombs.items())})",
          flush=True)

    def handle(conn: socket.socket) -> None:
        try:
            serve(conn, described, bombs)
        except (ConnectionError, OSError, ValueError):
            pass
        finally:
            conn.close()

    while True:
        conn, _ = listener.accept()
        threading.Thread(target=handle, args=(conn,), daemon=True).start()


if __name__ == "__main__":
    main()
