"""One episode's process: opens the task's world and runs its requests, then exits.

Forked by `cells.py` per episode; nothing here outlives the episode, and no process a cell
starts outlives its cell. The world is opened
without ground truth (the sandbox holds none to load). Whatever a cell does, including
raising KeyboardInterrupt or SystemExit, the host gets a reply saying what happened.
"""

from __future__ import annotations

import socket
from typing import Any

import limits
import wire

EXPERIMENT = "seeupo"


def serve(sock: socket.socket) -> None:
    world = None
    limits.adopt_orphans()
    while True:
        try:
            request, _ = wire.receive(sock)
        except (wire.WireError, OSError):
            return
        try:
            if request.get("op") == "initialize":
                world = _open_world(request)
                reply: dict[str, Any] = {"ok": True, "output": _task_summary(world)}
            elif world is None:
                reply = {"ok": False, "error": "no world is open: send initialize first"}
            elif request.get("op") == "execute":
                output = world.execute(request["code"])
                limit = int(request.get("max_chars", 1_000_000))
                reply = {"ok": True, "output": output[:limit]}
            elif request.get("op") == "task_completed":
                reply = {"ok": True, "output": bool(world.task_completed())}
            else:
                reply = {"ok": False, "error": f"unknown request {request.get('op')!r}"}
        except BaseException as error:  # noqa: BLE001  a cell may raise anything at all
            reply = {"ok": False, "error": f"{type(error).__name__}: {error}"[:2000]}
        # Processes a cell started end with it: none burns CPU or holds memory while the
        # policy thinks, and none can act between steps.
        limits.kill_descendants()
        reply["id"] = request.get("id")  # the host checks it: a reply to another request is a forgery
        wire.send(sock, reply)


def _open_world(request: dict) -> Any:
    from appworld import AppWorld

    return AppWorld(
        task_id=request["task_id"],
        experiment_name=EXPERIMENT,
        load_ground_truth=False,
        timeout_seconds=int(request["timeout_seconds"]),
        max_interactions=int(request["max_interactions"]),
        raise_on_unsafe_syntax=True,
        null_patch_unsafe_execution=True,
    )


def _task_summary(world: Any) -> dict:
    supervisor = world.task.supervisor
    return {
        "instruction": world.task.instruction,
        "supervisor": {key: str(supervisor[key]) for key in ("first_name", "last_name", "email", "phone_number")},
        "datetime": str(world.task.datetime),
    }
