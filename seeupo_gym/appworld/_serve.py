"""Run AppWorld's own environment server on loopback. Run by the AppWorld interpreter only:

    python -P _serve.py PORT PARENT_FD

`appworld.serve.environment.run()` binds 0.0.0.0, so uvicorn is started here with
127.0.0.1. uvicorn runs in the main thread, where AppWorld's SIGALRM code timeout works.
PARENT_FD is the read end of a pipe whose write end only the parent holds: it reads EOF
when the parent dies, however it dies, and the server then exits, so none is orphaned.
"""

from __future__ import annotations

import os
import sys
import threading


def _exit_with_parent(fd: int) -> None:
    while os.read(fd, 1):
        pass
    os._exit(0)


def main() -> None:
    port, parent_fd = int(sys.argv[1]), int(sys.argv[2])
    threading.Thread(target=_exit_with_parent, args=(parent_fd,), daemon=True).start()

    import uvicorn

    uvicorn.run("appworld.serve.environment:app", host="127.0.0.1", port=port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
