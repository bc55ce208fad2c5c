"""Build the offline AppWorld "mini" task set with the real AppWorld engine.

    python scripts/build_appworld_mini.py [OUT_DIR] [--python APPWORLD_PYTHON]

A thin entry: the builder (`seeupo_gym/appworld/_build_mini.py`) imports `appworld`, so it
runs under the AppWorld interpreter (found as the env finds it). `make appworld-mini` runs
the same builder into `data/appworld-mini`.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

from seeupo_gym.appworld import find_python
from seeupo_gym.appworld.paths import MINI_BUILDER


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", nargs="?", default="data/appworld-mini")
    parser.add_argument("--python", default=None, help="the AppWorld interpreter (default: as the env finds it)")
    args = parser.parse_args()
    sys.exit(subprocess.run([str(find_python(args.python)), "-P", str(MINI_BUILDER), args.out_dir]).returncode)


if __name__ == "__main__":
    main()
