"""The grader: scores an episode's final state where no model code ever ran.

Run by the AppWorld interpreter inside the grader sandbox:  python -P grader.py CONTROL_FD

It sees the full task data (ground truth included) and, under `experiments/`, only the final
DB change files the host copied out of the finished episode. Each evaluation runs in a fresh
fork of this warm parent, so no evaluation's state reaches the next. The change files are SQL
statements written by the episode's process, i.e. by model code: the grader replays them itself
(`_replay`), only data changes SQLite attributes to the app's own tables, and hashes the final
rows itself (`_own_hashes`).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import socket
import sqlite3
import sys

import limits
import wire

EXPERIMENT = "seeupo"


def main() -> None:
    control = socket.socket(fileno=int(sys.argv[1]))
    if len(sys.argv) > 2:  # under gVisor, the filter bubblewrap would have loaded: before anything else runs
        limits.load_seccomp(limits.read_filter(sys.argv[2]))
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

    completed = _use_own_root(task_id)
    tracker = evaluate_task(task_id=task_id, experiment_name=EXPERIMENT, suppress_errors=True, save_report=False)
    return {**tracker.to_dict(), "completed": completed}


def _use_own_root(task_id: str) -> bool:
    """Point AppWorld at a root of the grader's own, in its scratch, holding:
    - the task data; where there are no `base_dbs` (the offline mini set stores full DBs per
      task, and the episode's changes are relative to those) the task's DBs are the base;
    - the final DBs, which the grader builds itself: each app's start DB with the episode's
      changes (`.jsonl`, written by the episode's process, i.e. by model code) replayed under
      SQLite's authorizer (`_replay`);
    - record and model hashes of its own (`_own_hashes`). AppWorld finds changed rows by their
      record hash and changed tables by their model hash, and the episode wrote both, so
      trusting them would let model code hide changes.
    Returns whether the final state holds a completed task (the supervisor's task has a status).
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
    changed: dict[str, set[str]] = {}
    for name in sorted(os.listdir(os.path.join(given, relative))):
        if not name.endswith(".jsonl"):
            continue
        app, changes = name[: -len(".jsonl")], os.path.join(given, relative, name)
        start_db = os.path.join(own, "data", "base_dbs", app + ".db")
        if os.path.getsize(changes) == 0 or not os.path.isfile(start_db):
            shutil.copyfile(changes, os.path.join(own, relative, name))  # no changes: AppWorld reads the start
            continue
        final_db = os.path.join(own, relative, app + ".db")
        _replay(start_db, changes, final_db)
        changed[app] = _own_hashes(start_db, final_db)
    start_hashes = os.path.join(given, "data", "tasks", task_id, "dbs", "model_hashes.json")
    start = json.load(open(start_hashes)) if os.path.isfile(start_hashes) else {}
    with open(os.path.join(own, relative, "model_hashes.json"), "w") as file:
        json.dump(_end_model_hashes(start, changed), file)
    os.environ["APPWORLD_ROOT"] = own
    supervisor = os.path.join(own, relative, "supervisor.db")
    return _task_completed(supervisor if os.path.isfile(supervisor) else os.path.join(own, "data", "base_dbs", "supervisor.db"))


_DATA_CHANGE = re.compile(r"\s*(INSERT|UPDATE|DELETE)\b", re.IGNORECASE)
_QUERY = re.compile(r"\b(SELECT|WITH|RECURSIVE)\b", re.IGNORECASE)
MAX_VALUE_BYTES = 16 * 2**20  # the longest string or blob a replayed statement may make
# SQLite virtual-machine steps one app's replay may take (~0.1-0.2 s of CPU). The ORM's own
# statements touch a few rows by key (each mini task's ground truth: under 10,000 steps), but
# model-written SQL can join a table to itself many times (`UPDATE ... FROM` 14 copies of a
# 4-row table: 4**14 rows), and without a bound the grader spent its whole CPU limit and died.
MAX_REPLAY_STEPS = 10_000_000
PROGRESS_EVERY = 1_000


def _replay(start_db: str, changes_path: str, final_db: str) -> int:
    """Replay an app's saved changes on a copy of its start DB, as AppWorld does, but only data
    changes SQLite itself attributes: each statement must be an INSERT, UPDATE or DELETE
    (AppWorld's ORM writes nothing else), and SQLite's authorizer, which resolves table names as
    SQLite does (schema-qualified and quoted ones included), allows writes only to the start
    DB's own tables in `main`, reads, and nothing else (no function calls, ATTACH, PRAGMA,
    CREATE, DROP, ALTER). The whole replay may take MAX_REPLAY_STEPS of SQLite's steps (returns
    how many it took, to PROGRESS_EVERY). Raises ValueError on the first statement it refuses
    or that goes over."""
    shutil.copyfile(start_db, final_db)
    connection = sqlite3.connect(final_db)
    try:
        connection.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, MAX_VALUE_BYTES)
        tables = {name.lower() for (name,) in connection.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        tables |= {"sqlite_master", "sqlite_sequence"}  # written by SQLite itself (FTS, AUTOINCREMENT)
        refused: list[str] = []

        def authorize(action: int, first: str | None, second: str | None, database: str | None, _: str | None) -> int:
            if action in (sqlite3.SQLITE_INSERT, sqlite3.SQLITE_UPDATE, sqlite3.SQLITE_DELETE):
                if database == "main" and (first or "").lower() in tables:
                    return sqlite3.SQLITE_OK
            elif action in (sqlite3.SQLITE_READ, sqlite3.SQLITE_SELECT, sqlite3.SQLITE_TRANSACTION):
                return sqlite3.SQLITE_OK  # SQLite's own FTS statements read; model statements hold no SELECT
            elif action == sqlite3.SQLITE_PRAGMA and first == "data_version":
                return sqlite3.SQLITE_OK  # asked by FTS itself
            refused.append(f"{action}:{first}:{second}:{database}")
            return sqlite3.SQLITE_DENY

        connection.set_authorizer(authorize)
        steps = 0

        def over_budget() -> bool:  # True interrupts the statement
            nonlocal steps
            steps += PROGRESS_EVERY
            return steps > MAX_REPLAY_STEPS

        connection.set_progress_handler(over_budget, PROGRESS_EVERY)
        with open(changes_path) as file:
            for number, line in enumerate(file, start=1):
                if not line.strip():
                    continue
                change = json.loads(line)
                statement, parameters, many = (change + [None, False])[:3] if isinstance(change, list) else (None,) * 3
                if not (isinstance(statement, str) and _DATA_CHANGE.match(statement) and not _QUERY.search(statement)):
                    raise ValueError(f"{os.path.basename(changes_path)}:{number} is not a data change: {str(statement)[:80]!r}")
                try:
                    if many:
                        connection.executemany(statement, parameters or [])
                    else:
                        connection.execute(statement, parameters or [])
                except sqlite3.Error as error:
                    why = f" (refused: {refused[-1]})" if refused else ""
                    if steps > MAX_REPLAY_STEPS:
                        why = f" (the replay took over {MAX_REPLAY_STEPS} SQLite steps)"
                    raise ValueError(f"{os.path.basename(changes_path)}:{number} does not replay: {error}{why}") from None
        connection.commit()
    finally:
        connection.close()
    return steps


def _table_rows(connection: sqlite3.Connection, table: str) -> tuple[list[str], list[tuple]]:
    columns = [row[1] for row in connection.execute(f'PRAGMA table_info("{table}")')]
    return columns, list(connection.execute(f'SELECT * FROM "{table}"'))


def _own_hashes(start_db: str, final_db: str) -> set[str]:
    """Compare every table of the final DB with the start DB; give each row whose data changed
    (or that is new) a record hash of the grader's own and each unchanged row its start hash
    back. Returns the names (lower case) of the tables whose rows changed."""
    start = sqlite3.connect(f"file:{start_db}?mode=ro", uri=True)
    final = sqlite3.connect(final_db)
    changed: set[str] = set()
    try:
        names = [name for (name,) in final.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
                 if not name.startswith("sqlite_")]
        for table in names:
            columns, rows = _table_rows(final, table)
            try:
                start_columns, start_rows = _table_rows(start, table)
            except sqlite3.Error:
                start_columns, start_rows = columns, []
            if "record_hash" in columns and "id" in columns and start_columns == columns:
                at, key = columns.index("record_hash"), columns.index("id")
                data = lambda row: row[:at] + row[at + 1:]  # noqa: E731
                before = {row[key]: row for row in start_rows}
                fixes = []
                for row in rows:
                    old = before.pop(row[key], None)
                    if old is not None and data(old) == data(row):
                        if old[at] != row[at]:
                            fixes.append((old[at], row[key]))
                    else:
                        changed.add(table.lower())
                        digest = hashlib.sha256(repr(data(row)).encode("utf-8", "backslashreplace")).digest()
                        fixes.append(("seeupo:" + base64.b64encode(digest[:9]).decode(), row[key]))
                if before:
                    changed.add(table.lower())  # deleted rows
                final.executemany(f'UPDATE "{table}" SET record_hash = ? WHERE id = ?', fixes)
            elif sorted(map(repr, rows)) != sorted(map(repr, start_rows)):
                changed.add(table.lower())
        final.commit()
    finally:
        start.close()
        final.close()
    return changed


def _task_completed(supervisor_db: str) -> bool:
    try:
        connection = sqlite3.connect(f"file:{supervisor_db}?mode=ro", uri=True)
        try:
            statuses = [status for (status,) in connection.execute("SELECT status FROM tasks")]
        finally:
            connection.close()
    except sqlite3.Error:
        return False
    return any(status in ("success", "fail") for status in statuses)


def _end_model_hashes(start: dict, changed: dict[str, set[str]]) -> dict[str, dict[str, int]]:
    from appworld.apps import get_all_apps
    from appworld.apps.model_lib import import_models_module

    hashes = {}
    for app in [*get_all_apps(), "admin"]:
        hashes[app] = {}
        tables = changed.get(app, set())
        for name, model in import_models_module(app).SQLModel.names_and_models():
            before = int(start.get(app, {}).get(name, 0))
            table = str(model.__tablename__).lower()
            touched = table in tables or any(other.startswith(table + "_") for other in tables)  # its FTS tables
            hashes[app][name] = -1 - before if touched else before  # start hashes are >= 0
    return hashes


if __name__ == "__main__":
    main()
