"""Where the AppWorld interpreter and task data are found.

AppWorld pins pydantic<2 and friends, so it never runs in the caller's interpreter: the env
starts servers with a separate Python that has `appworld` installed.

Interpreter, first found wins: the `python=` argument; `$SEEUPO_APPWORLD_PYTHON`; the
checkout's `.venv-appworld` (made by `make appworld-venv`); the managed venv made by
`python -m seeupo_gym.appworld.setup` under `$SEEUPO_HOME` (default `~/.cache/seeupo-gym`).

Data: the "mini" split is built by this project (`make appworld-mini` in a checkout, or the
setup command). The official splits (train, dev, test_normal, test_challenge) come from
`appworld download data` on a machine with internet: point `data_dir=` or
`$SEEUPO_APPWORLD_DATA` at the `data` folder it made.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

OFFICIAL_SPLITS = ("train", "dev", "test_normal", "test_challenge")
MINI_SPLIT = "mini"
SETUP_COMMAND = "python -m seeupo_gym.appworld.setup"

_REPO = Path(__file__).resolve().parents[2]
# The mini task set's builder: a script for the AppWorld interpreter (it imports appworld).
MINI_BUILDER = Path(__file__).with_name("_build_mini.py")


class AppWorldSetupError(RuntimeError):
    """The AppWorld interpreter or data is missing; the message says which command fixes it."""


def managed_home() -> Path:
    """Where the setup command puts the managed AppWorld venv and the mini data."""
    return Path(os.environ.get("SEEUPO_HOME", Path.home() / ".cache" / "seeupo-gym")).expanduser().resolve() / "appworld"


def _venv_python(venv: Path) -> Path:
    return venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def find_python(python: str | os.PathLike[str] | None = None) -> Path:
    """The AppWorld interpreter (see the module docstring for the search order)."""
    if python is not None:
        candidates = [("python=", Path(python))]
    elif os.environ.get("SEEUPO_APPWORLD_PYTHON"):
        candidates = [("$SEEUPO_APPWORLD_PYTHON", Path(os.environ["SEEUPO_APPWORLD_PYTHON"]))]
    else:
        candidates = [
            ("the checkout's .venv-appworld", _venv_python(_REPO / ".venv-appworld")),
            ("the managed venv", _venv_python(managed_home() / "venv")),
        ]
    for _, path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            _check_has_appworld(path)
            return path
    looked = "; ".join(f"{where}: {path}" for where, path in candidates)
    raise AppWorldSetupError(
        f"No AppWorld interpreter found (looked at {looked}). Create one with `{SETUP_COMMAND}` "
        "(or `make appworld-venv` in a checkout), or point python= / $SEEUPO_APPWORLD_PYTHON at a Python "
        "that has appworld installed."
    )


def _check_has_appworld(python: Path) -> None:
    probe = subprocess.run(
        [str(python), "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('appworld') is None)"],
        capture_output=True,
        timeout=60,
    )
    if probe.returncode != 0:
        raise AppWorldSetupError(
            f"{python} has no `appworld` package. Create a working interpreter with `{SETUP_COMMAND}`, or point "
            "python= / $SEEUPO_APPWORLD_PYTHON at one."
        )


def find_data_dir(split: str, data_dir: str | os.PathLike[str] | None = None) -> Path:
    """The AppWorld `data` folder that holds `datasets/<split>.txt` and `tasks/`."""
    if data_dir is not None:
        candidates = [Path(data_dir)]
    elif split == MINI_SPLIT:
        candidates = [_REPO / "data" / "appworld-mini", managed_home() / "mini"]
    elif os.environ.get("SEEUPO_APPWORLD_DATA"):
        candidates = [Path(os.environ["SEEUPO_APPWORLD_DATA"])]
    else:
        raise AppWorldSetupError(
            f"Split {split!r} needs AppWorld's official data: run `appworld download data` on a machine with "
            "internet (it deletes $APPWORLD_ROOT/data first), then pass data_dir= or set $SEEUPO_APPWORLD_DATA to "
            f"the `data` folder it made. The offline split {MINI_SPLIT!r} needs no download."
        )
    for path in candidates:
        if (path / "datasets" / f"{split}.txt").is_file():
            return path.resolve()
    looked = ", ".join(str(path) for path in candidates)
    if split == MINI_SPLIT and data_dir is None:
        fix = f"Build it with `make appworld-mini` in a checkout, or `{SETUP_COMMAND}`."
    else:
        fix = f"Known splits: {MINI_SPLIT} (built offline) and {', '.join(OFFICIAL_SPLITS)} (official data)."
    raise AppWorldSetupError(f"No AppWorld data for split {split!r} (looked for datasets/{split}.txt in {looked}). {fix}")


def read_split(data_dir: Path, split: str) -> list[str]:
    """The task ids of a split, in file order (AppWorld's own format: one id per line)."""
    lines = (data_dir / "datasets" / f"{split}.txt").read_text().splitlines()
    # AppWorld lets a line carry a tag after ":"; the task id is what precedes it.
    task_ids = [line.split(":")[0].strip() for line in lines if line.strip()]
    if not task_ids:
        raise AppWorldSetupError(f"{data_dir}/datasets/{split}.txt lists no tasks")
    return task_ids
