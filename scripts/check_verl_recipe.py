"""Check that the verl GPU recipe resolves: pip's resolver, wheels only, for the GPU machine's Python.

    python scripts/check_verl_recipe.py                 # scripts/verl_gpu_requirements.txt + '.[verl]'
    python scripts/check_verl_recipe.py --report out.json

Runs `pip install --dry-run --report` (nothing installed) on the recipe's pins plus this package's own
dependencies and its `verl` extra (read from pyproject.toml: the same resolve as
`pip install -r scripts/verl_gpu_requirements.txt '.[verl]'`), for CPython 3.12 on x86_64 Linux, from
PyPI only (`--isolated`: no local wheel folders or constraints of this machine). Needs network; about
1-4 minutes. Pins PyPI has only as source (SOURCE_ONLY) are built to wheels first. Prints the versions that matter and exits 1 if the resolve fails or moves a pin.

The platform list spans manylinux_2_17 .. 2_35: pip takes `--platform` literally (a manylinux_2_28 tag
alone refuses manylinux_2_17 wheels), and vLLM 0.24's llguidance ships manylinux_2_31 only, so a
GPU machine needs glibc >= 2.31 (Ubuntu 20.04+).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "scripts" / "verl_gpu_requirements.txt"
PYTHON_VERSION = "3.12"
GLIBC_MINORS = range(35, 16, -1)  # manylinux_2_35 .. manylinux_2_17
SHOWN = ("verl", "vllm", "torch", "transformers", "tokenizers", "huggingface-hub", "accelerate", "peft",
         "ray", "hydra-core", "omegaconf", "tensordict", "flashinfer-python", "numpy", "pydantic")
# Pins that PyPI has only as source: built to a wheel here (pure Python) and offered to the resolver,
# which is what `pip install -r` does on the GPU machine.
SOURCE_ONLY = ("antlr4-python3-runtime",)
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.+!-]+)$")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_recipe(path: Path = RECIPE) -> dict[str, str]:
    """The recipe's pins by canonical name. Every line is `name==version` (or a comment): a range
    there would make the recipe a different install on every day it is resolved."""
    pins: dict[str, str] = {}
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = PIN.match(line)
        if match is None:
            raise ValueError(f"{path.name}:{number}: {line!r} is not an exact pin (name==version)")
        name = canonical(match.group(1))
        if name in pins:
            raise ValueError(f"{path.name}:{number}: {match.group(1)} is pinned twice")
        pins[name] = match.group(2)
    return pins


def project_requirements(extras: tuple[str, ...] = ("verl",)) -> list[str]:
    """This package's dependencies and the named extras, as pyproject.toml declares them."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = list(project["dependencies"])
    for extra in extras:
        requirements += project["optional-dependencies"][extra]
    return requirements


def platforms() -> list[str]:
    tags = [f"manylinux_2_{minor}_x86_64" for minor in GLIBC_MINORS]
    return [*tags, "manylinux2014_x86_64", "linux_x86_64"]


def pip_command(requirements: Path, report: Path, wheels: Path) -> list[str]:
    command = [sys.executable, "-m", "pip", "install", "--isolated", "--find-links", str(wheels), "--dry-run", "--ignore-installed", "--quiet", "--report", str(report),
               "--python-version", PYTHON_VERSION, "--implementation", "cp", "--only-binary=:all:"]
    for tag in platforms():
        command += ["--platform", tag]
    return command + ["-r", str(requirements)]


def resolve(report: Path, timeout: float) -> tuple[dict[str, str], float]:
    """Run the resolver; return {canonical name: version} of what it would install, and seconds."""
    pins = read_recipe()
    with tempfile.TemporaryDirectory() as folder:
        requirements = Path(folder) / "requirements.txt"
        requirements.write_text("\n".join([*(f"{n}=={v}" for n, v in pins.items()), *project_requirements()]) + "\n")
        started = time.perf_counter()
        wheels = Path(folder) / "wheels"
        for name in SOURCE_ONLY:
            built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--isolated", "--no-deps", "--quiet", "-w", str(wheels),
                                    f"{name}=={pins[name]}"], capture_output=True, text=True, timeout=timeout)
            if built.returncode != 0:
                raise SystemExit(f"verl recipe: could not build {name}=={pins[name]}: {built.stderr.strip()[-300:]}")
        done = subprocess.run(pip_command(requirements, report, wheels), capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "PIP_NO_INPUT": "1"})
        seconds = time.perf_counter() - started
    if done.returncode != 0:
        errors = [line for line in done.stderr.splitlines() if line.startswith("ERROR")] or done.stderr.splitlines()[-5:]
        raise SystemExit("verl recipe does not resolve:\n  " + "\n  ".join(errors))
    installed = json.loads(report.read_text())["install"]
    return {canonical(item["metadata"]["name"]): item["metadata"]["version"] for item in installed}, seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", type=Path, help="keep pip's JSON report here")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds the resolver may take")
    args = parser.parse_args()
    pins = read_recipe()
    with tempfile.TemporaryDirectory() as folder:
        report = args.report or Path(folder) / "report.json"
        versions, seconds = resolve(report, args.timeout)
    moved = {name: (pin, versions.get(name)) for name, pin in pins.items() if versions.get(name) != pin}
    load = os.getloadavg()
    print(f"verl recipe: {len(versions)} packages resolve in {seconds:.0f} s (CPython {PYTHON_VERSION}, x86_64 "
          f"manylinux_2_17..2_35, wheels only; load {load[0]:.2f} {load[1]:.2f} {load[2]:.2f})")
    print("  " + ", ".join(f"{name}=={versions[name]}" for name in SHOWN if name in versions))
    if moved:
        print("verl recipe: the resolve moved pins: " + ", ".join(f"{n} {p} -> {v}" for n, (p, v) in moved.items()))
        return 1
    print("verl recipe: resolves, every pin kept")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
