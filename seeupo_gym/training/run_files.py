"""Writing a run folder's files, never through a symbolic link.

A run folder may come from someone else (a comparison to continue, a run to resume): a
`metrics.jsonl` planted as a link to a file outside would have the run append to, or truncate,
that file. So a run folder holds no links at all (`refuse_links`, when a run opens it; a link to
another disk goes on the folder itself, `--out DIR`), and every file a run writes there is opened
with O_NOFOLLOW (`open_run_file`), which also stops a link planted while the run goes on.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import IO, Any

from seeupo_gym.training.config import ConfigError

_MODES = {
    "w": os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
    "a": os.O_WRONLY | os.O_CREAT | os.O_APPEND,
}


class RunFolderError(ConfigError):
    """A run folder holding a symbolic link where the run reads or writes."""


def _link_error(path: Path) -> RunFolderError:
    return RunFolderError(f"{str(path)!r} is a symbolic link: a run folder's files are never written through links "
                          f"(one planted there would send the run's writes elsewhere); remove it, or point --out at "
                          f"the folder itself")


def refuse_links(folder: str | Path) -> None:
    """Raise RunFolderError if anything inside `folder` (at any depth) is a symbolic link."""
    for root, dirs, files in os.walk(folder):  # never descends into a linked folder
        for name in sorted(dirs + files):
            path = Path(root) / name
            if path.is_symlink():
                raise _link_error(path)


def open_run_file(path: str | Path, mode: str = "w") -> IO[Any]:
    """`open(path, mode)` for "w", "a", "wb", "ab" (text is UTF-8), refusing a link at `path`."""
    flags = _MODES[mode.replace("b", "")] | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise _link_error(Path(path)) from None
        raise
    if "b" in mode:
        return os.fdopen(fd, mode)
    return os.fdopen(fd, mode, encoding="utf-8")


def write_run_text(path: str | Path, text: str) -> None:
    with open_run_file(path, "w") as f:
        f.write(text)


def write_run_bytes(path: str | Path, data: bytes) -> None:
    with open_run_file(path, "wb") as f:
        f.write(data)
