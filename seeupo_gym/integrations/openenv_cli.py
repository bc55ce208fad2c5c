"""`seeupo-serve ENV_ID [--host 127.0.0.1] [--port N] [--max-sessions N] [key=value ...]`.

Serves a registered env over the OpenEnv protocol (`openenv_server`); the key=value pairs are
the env's kwargs (values read as YAML scalars: `max_turns=4`, `categories=[base,miss_func]`);
`--session-kwargs max_turns,split` lets each session choose those kwargs at reset.
At most `--max-connections` connections are open at once, at most `--max-connections-per-peer`
from one remote address, and each must send its request head within `--header-timeout` seconds,
all enforced before any token check (`connections.py`). A request whose `Origin` header names
another web origin than the server's own is refused (a web page may not play the env; a page of
an origin given with `--allow-origin` may).
Binding anything but a loopback address requires a token (`--token-file` or
`$SEEUPO_SERVE_TOKEN`), which clients then send as `Authorization: Bearer <token>`.
SIGTERM or Ctrl-C closes every session's env (an AppWorld env kills its sandboxes) and exits.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Any, Sequence

import yaml

from seeupo_gym.integrations import is_loopback

TOKEN_ENV = "SEEUPO_SERVE_TOKEN"


def parse_env_kwargs(pairs: Sequence[str]) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.isidentifier():
            raise SystemExit(f"seeupo-serve: env kwargs are key=value with key a Python name, got {pair!r}")
        try:
            kwargs[key] = yaml.safe_load(value) if value else ""
        except yaml.YAMLError as error:
            raise SystemExit(f"seeupo-serve: cannot read the value of {key}: {error}") from None
    return kwargs


def read_token(token_file: str | None) -> str | None:
    if token_file:
        token = Path(token_file).read_text().strip()
        if not token:
            raise SystemExit(f"seeupo-serve: the token file {token_file} is empty")
        return token
    return os.environ.get(TOKEN_ENV) or None


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="seeupo-serve", description=__doc__.split("\n\n")[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("env_id", help="a registered env id, e.g. seeupo/BFCL-v4-v0")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1, loopback only)")
    parser.add_argument("--port", type=int, default=8000, help="port (0: any free port; the URL is printed)")
    parser.add_argument("--max-sessions", type=int, default=32, help="most live envs at once (default 32)")
    parser.add_argument("--idle-timeout", type=float, default=600.0,
                        help="seconds after which an idle session is closed (default 600)")
    parser.add_argument("--max-request-bytes", type=int, default=1 << 20,
                        help="largest request body or WebSocket message (default 1 MiB)")
    parser.add_argument("--max-connections", type=int, default=256,
                        help="most open connections, WebSocket sessions included; more are closed at once (default 256)")
    parser.add_argument("--max-connections-per-peer", type=int, default=64,
                        help="most open connections from one remote IP address (default 64); a trainer on this "
                             "machine opens one per session")
    parser.add_argument("--allow-origin", action="append", default=[], metavar="ORIGIN",
                        help="a web origin (scheme://host[:port]) whose pages may use the server beside its own; "
                             "repeatable (default: none)")
    parser.add_argument("--header-timeout", type=float, default=10.0,
                        help="seconds a connection has to send a request head (default 10)")
    parser.add_argument("--body-timeout", type=float, default=60.0,
                        help="seconds a request has to send its body (default 60)")
    parser.add_argument("--attach-timeout", type=float, default=10.0,
                        help="seconds a session made over HTTP (MCPToolClient) has to attach its WebSocket (default 10)")
    parser.add_argument("--session-kwargs", default="",
                        help="comma-separated env kwargs a session may set at reset (default: none)")
    parser.add_argument("--token-file", help=f"file holding the token clients must send (or ${TOKEN_ENV})")
    parser.add_argument("--log-level", default="warning")
    parser.add_argument("env_kwargs", nargs="*", metavar="key=value", help="env kwargs, e.g. max_turns=4")
    args = parser.parse_intermixed_args(argv)

    token = read_token(args.token_file)
    if not is_loopback(args.host) and token is None:
        raise SystemExit(
            f"seeupo-serve: binding {args.host} exposes the env (and, for AppWorld, code execution) to the network; "
            f"give a token with --token-file or ${TOKEN_ENV}, or bind 127.0.0.1"
        )
    # Loading openenv and the env's data takes seconds (more on a busy machine): say what is waited for.
    print(f"seeupo-serve: loading {args.env_id} ...", file=sys.stderr, flush=True)
    try:
        import uvicorn

        from seeupo_gym.integrations.connections import BoundedConnections
        from seeupo_gym.integrations.openenv_server import create_app
    except ImportError as error:
        raise SystemExit(f"seeupo-serve needs the serve extra: pip install 'seeupo-gym[serve]' ({error})") from None

    env_kwargs = parse_env_kwargs(args.env_kwargs)
    session_kwargs = tuple(name.strip() for name in args.session_kwargs.split(",") if name.strip())
    try:
        http = BoundedConnections.configured(max_connections=args.max_connections,
                                             max_connections_per_peer=args.max_connections_per_peer,
                                             header_timeout_s=args.header_timeout)
        app = create_app(args.env_id, env_kwargs, max_sessions=args.max_sessions, idle_timeout_s=args.idle_timeout,
                         max_request_bytes=args.max_request_bytes, body_timeout_s=args.body_timeout, token=token,
                         session_kwargs=session_kwargs, attach_timeout_s=args.attach_timeout,
                         allowed_origins=args.allow_origin)
    except Exception as error:
        raise SystemExit(f"seeupo-serve: cannot serve {args.env_id} with {env_kwargs}: {error}") from None

    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if family == socket.AF_INET6 else host
    print(f"seeupo-serve: {args.env_id} at http://{shown}:{port} (at most {args.max_sessions} sessions)", flush=True)
    if args.max_sessions > args.max_connections_per_peer:
        print(f"seeupo-serve: note: one client machine can hold at most {args.max_connections_per_peer} connections "
              f"(--max-connections-per-peer), fewer than --max-sessions {args.max_sessions}", file=sys.stderr)
    config = uvicorn.Config(
        app,
        http=http,
        # asyncio accepts up to `backlog` connections per loop turn before any of them reaches the
        # cap check: a small backlog keeps that transient number of descriptors small too.
        backlog=min(128, args.max_connections),
        log_level=args.log_level,
        ws_max_size=args.max_request_bytes,
        h11_max_incomplete_event_size=64 * 1024,  # request line and headers
        timeout_graceful_shutdown=10,
        lifespan="on",
    )
    # uvicorn handles SIGTERM with a graceful shutdown (our hook closes every env), then raises it
    # again under the handler it found: a no-op here, so the process ends normally, status 0.
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    uvicorn.Server(config).run(sockets=[sock])
    app.state.close_all()  # anything the shutdown hooks did not reach
    sys.exit(0)



def package_main(env_id: str, env_kwargs: dict[str, Any]) -> None:
    """`main()` of an OpenEnv env package (envs/*/server/app.py): `seeupo-serve env_id key=value...`
    with the command line's flags."""
    main([env_id, *sys.argv[1:], *(f"{key}={value}" for key, value in env_kwargs.items())])


if __name__ == "__main__":
    main()
