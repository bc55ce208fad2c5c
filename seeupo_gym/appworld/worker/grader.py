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
import re
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
            wire.send(control, {"ok": False, "error": f"unknown request {request.get('op')!r}", "id": request.get("id")})
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
            reply["id"] = request.get("id")
            wire.send(control, reply)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        if status != 0:
            wire.send(control, {"ok": False, "error": f"the evaluation process died (wait status {status})",
                                "id": request.get("id")})


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
    - model hashes of its own. AppWorld treats a table whose hash did not change as unchanged,
      and the episode wrote its hashes, so trusting them would let model code hide changes.
      Here a table the replayed changes touch gets a hash no start hash has; the others
      keep their start hash, which is true: the final state is the start plus these changes.
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
    touched: dict[str, set[str] | None] = {}
    for name in os.listdir(os.path.join(given, relative)):
        if name.endswith(".jsonl"):
            touched[name[: -len(".jsonl")]] = _touched_tables(os.path.join(given, relative, name))
            shutil.copyfile(os.path.join(given, relative, name), os.path.join(own, relative, name))
    start_hashes = os.path.join(given, "data", "tasks", task_id, "dbs", "model_hashes.json")
    start = json.load(open(start_hashes)) if os.path.isfile(start_hashes) else {}
    with open(os.path.join(own, relative, "model_hashes.json"), "w") as file:
        json.dump(_end_model_hashes(start, touched), file)
    os.environ["APPWORLD_ROOT"] = own


_ROW_CHANGE = re.compile(r"\s*(?:INSERT(?:\s+OR\s+\w+)?\s+INTO|UPDATE(?:\s+OR\s+\w+)?|DELETE\s+FROM)\s+[\"`\[]?(\w+)",
                         re.IGNORECASE)


_QUERY = re.compile(r"\b(SELECT|WITH|RECURSIVE)\b", re.IGNORECASE)


def _touched_tables(path: str) -> set[str] | None:
    """The tables an app's saved changes write to; None when any statement may touch more
    (CREATE, DROP). Anything that is not a data change is refused."""
    tables: set[str] | None = set()
    with open(path) as file:
        for line in file:
            if not line.strip():
                continue
            statement = json.loads(line)[0]
            # AppWorld's ORM writes plain INSERT/UPDATE/DELETE rows; a SELECT inside one (a
            # recursive CTE, say) is model code asking the grader to compute, maybe forever.
            if not (isinstance(statement, str) and statement.lstrip()[:10].upper().startswith(DATA_CHANGES)
                    and not _QUERY.search(statement)):
                raise ValueError(f"{os.path.basename(path)} holds a statement that is not a data change: "
                                 f"{str(statement)[:80]!r}")
            match = _ROW_CHANGE.match(statement)
            if match is None or tables is None:
                tables = None
            else:
                tables.add(match.group(1).lower())
    return tables


def _end_model_hashes(start: dict, touched: dict[str, set[str] | None]) -> dict[str, dict[str, int]]:
    from appworld.apps import get_all_apps
    from appworld.apps.model_lib import import_models_module

    hashes = {}
    for app in [*get_all_apps(), "admin"]:
        hashes[app] = {}
        for name, model in import_models_module(app).SQLModel.names_and_models():
            before = int(start.get(app, {}).get(name, 0))
            tables = touched.get(app, set())
            changed = tables is None or str(model.__tablename__).lower() in tables or any(
                table.startswith(str(model.__tablename__).lower() + "_") for table in tables  # its FTS tables
            )
            hashes[app][name] = -1 - before if changed else before  # start hashes are >= 0
    return hashes


if __name__ == "__main__":
    main()
