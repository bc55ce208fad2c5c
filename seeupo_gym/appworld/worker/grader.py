"""The grader: scores an episode's final state where no model code ever ran.

Run by the AppWorld interpreter inside the grader sandbox:  python -P grader.py CONTROL_FD

It sees the full task data (ground truth included) and, under `experiments/`, only the final
DB change files the host copied out of the finished episode. Each evaluation runs in a fresh
fork of this warm parent, so no evaluation's state reaches the next. The change files are SQL
statements written by the episode's process, i.e. by model code: only data changes are replayed.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys

import limits
import wire

EXPERIMENT = "seeupo"
DATA_CHANGES = ("INSERT", "UPDATE", "DELETE", "CREATE", "DROP")  # what AppWorld's change tracker records


def main() -> None:
    control = socket.socket(fileno=int(sys.argv[1]))
    limits.make_undumpable()
    limits.reset_scratch()
    limits.warm_up_appworld()
    wire.send(control, {"ready": True, "pid": os.getpid()})
    while True:
        try:
            request, _ = wire.receive(control)
        except (wire.WireError, OSError):
            os._exit(0)
        if request.get("op") != "evaluate":
            wire.send(control, {"ok": False, "error": f"unknown request {request.get('op')!r}"})
            continue
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:
            limits.die_with_parent(parent)
            limits.apply(request.get("limits", {}))
            try:
                reply = {"ok": True, "output": _evaluate(request["task_id"])}
            except BaseException as error:  # noqa: BLE001  report, never hang the host
                reply = {"ok": False, "error": f"{type(error).__name__}: {error}"[:2000]}
            wire.send(control, reply)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        if status != 0:
            wire.send(control, {"ok": False, "error": f"the evaluation process died (wait status {status})"})


def _evaluate(task_id: str) -> dict:
    from appworld.evaluator import evaluate_task

    _check_state(task_id)
    _use_task_dbs_as_base(task_id)
    tracker = evaluate_task(task_id=task_id, experiment_name=EXPERIMENT, suppress_errors=True, save_report=False)
    return tracker.to_dict()


def _use_task_dbs_as_base(task_id: str) -> None:
    """AppWorld rebuilds the final state as base DBs + the saved changes. Data without
    `base_dbs` (the offline mini set stores full DBs per task, and the episode's changes are
    relative to those) gets a root of its own where the task's DBs are the base."""
    root = os.environ["APPWORLD_ROOT"]
    if os.path.isdir(os.path.join(root, "data", "base_dbs")):
        return
    own = os.path.join(os.environ.get("SEEUPO_SCRATCH", "/scratch"), "evaluation-root")
    shutil.rmtree(own, ignore_errors=True)
    os.makedirs(os.path.join(own, "data"))
    for name in os.listdir(os.path.join(root, "data")):
        os.symlink(os.path.join(root, "data", name), os.path.join(own, "data", name))
    os.symlink(os.path.join(root, "data", "tasks", task_id, "dbs"), os.path.join(own, "data", "base_dbs"))
    os.symlink(os.path.join(root, "experiments"), os.path.join(own, "experiments"))
    os.environ["APPWORLD_ROOT"] = own


def _check_state(task_id: str) -> None:
    folder = os.path.join(os.environ["APPWORLD_ROOT"], "experiments", "outputs", EXPERIMENT, "tasks", task_id, "dbs")
    for name in os.listdir(folder):
        if not name.endswith(".jsonl"):
            continue
        with open(os.path.join(folder, name)) as file:
            for line in file:
                if not line.strip():
                    continue
                statement = json.loads(line)[0]
                if not (isinstance(statement, str) and statement.lstrip()[:10].upper().startswith(DATA_CHANGES)):
                    raise ValueError(f"{name} holds a statement that is not a data change: {str(statement)[:80]!r}")


if __name__ == "__main__":
    main()
