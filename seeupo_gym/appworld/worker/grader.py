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

    _use_own_root(task_id)
    tracker = evaluate_task(task_id=task_id, experiment_name=EXPERIMENT, suppress_errors=True, save_report=False)
    return tracker.to_dict()


def _use_own_root(task_id: str) -> None:
    """Point AppWorld at a root of the grader's own, in its scratch, holding:
    - the task data; where there are no `base_dbs` (the offline mini set stores full DBs per
      task, and the episode's changes are relative to those) the task's DBs are the base;
    - the episode's DB changes (`.jsonl`), each line checked to be a data change;
    - model hashes of its own that match no start hash. AppWorld treats a table whose hash
      did not change as unchanged; the episode wrote its hashes, so trusting them would let
      model code hide changes. These force a row by row comparison instead.
    """
    given = os.environ["APPWORLD_ROOT"]
    own = os.path.join(os.environ.get("SEEUPO_SCRATCH", "/scratch"), "evaluation-root")
    shutil.rmtree(own, ignore_errors=True)
    os.makedirs(os.path.join(own, "data"))
    for name in os.listdir(os.path.join(given, "data")):
        os.symlink(os.path.join(given, "data", name), os.path.join(own, "data", name))
    if not os.path.isdir(os.path.join(given, "data", "base_dbs")):
        os.symlink(os.path.join(given, "data", "tasks", task_id, "dbs"), os.path.join(own, "data", "base_dbs"))
    relative = os.path.join("experiments", "outputs", EXPERIMENT, "tasks", task_id, "dbs")
    os.makedirs(os.path.join(own, relative))
    for name in os.listdir(os.path.join(given, relative)):
        if name.endswith(".jsonl"):
            _check_changes(os.path.join(given, relative, name))
            shutil.copyfile(os.path.join(given, relative, name), os.path.join(own, relative, name))
    with open(os.path.join(own, relative, "model_hashes.json"), "w") as file:
        json.dump(_unmatched_model_hashes(), file)
    os.environ["APPWORLD_ROOT"] = own


def _check_changes(path: str) -> None:
    with open(path) as file:
        for line in file:
            if not line.strip():
                continue
            statement = json.loads(line)[0]
            if not (isinstance(statement, str) and statement.lstrip()[:10].upper().startswith(DATA_CHANGES)):
                raise ValueError(f"{os.path.basename(path)} holds a statement that is not a data change: "
                                 f"{str(statement)[:80]!r}")


def _unmatched_model_hashes() -> dict[str, dict[str, int]]:
    from appworld.apps import get_all_apps
    from appworld.apps.model_lib import import_models_module

    hashes = {}
    for app in [*get_all_apps(), "admin"]:
        models = import_models_module(app).SQLModel
        hashes[app] = {name: -1 for name, _ in models.names_and_models()}  # start hashes count up from 0
    return hashes


if __name__ == "__main__":
    main()
