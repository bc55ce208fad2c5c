#!/usr/bin/env bash
# Builds what scripts/gpu_check.sh installs on a GPU machine without network: this project's wheel and
# the dependencies a CUDA image with torch, transformers, accelerate, pytest and pytest-xdist lacks,
# as CPython 3.12 manylinux x86_64 wheels (no dependencies followed: the list is the whole bundle).
# Run it where there is network; it refuses a bundle over 64 MiB (what a GPU session may carry).
#
#   bash scripts/gpu_check_wheels.sh            # -> gpu-wheels/ (git-ignored; a GPU session carries it)
#   bash scripts/gpu_check_wheels.sh DIR        # elsewhere
#   EXTRA="bfcl-eval==2026.3.23" bash scripts/gpu_check_wheels.sh   # add packages
#
# Downloads go through pip's own configured index (pip.conf, $PIP_INDEX_URL). DIR is emptied and
# refilled only when it is empty or was made by this script (it holds the marker file
# .gpu-check-wheels); any other folder is refused untouched.
# The versions are the ones this project's tests run with (.venv); pydantic-core must match pydantic.
set -euo pipefail
case ${1:-} in
  -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
  -*) echo "gpu_check_wheels.sh: unknown option '$1' (--help)" >&2; exit 2 ;;
esac
[ $# -le 1 ] || { echo "gpu_check_wheels.sh: one folder at most (--help)" >&2; exit 2; }
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=${1:-$root/gpu-wheels}
marker=.gpu-check-wheels
PY=${PY:-python3}
LIMIT_MIB=64
DEPS=(
  gymnasium==1.4.0 cloudpickle==3.1.3 farama-notifications==0.0.6 tenacity==9.2.1 gguf==0.19.0
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 peft==0.21.2
  mpmath==1.3.0 psutil==7.2.2 pytest-timeout==2.4.0
  httpx==0.29.0 httpcore==1.0.9 h11==0.16.0 anyio==4.16.0 sniffio==1.3.1
)
# shellcheck disable=SC2206
[ -n "${EXTRA:-}" ] && DEPS+=($EXTRA)
if [ -e "$out" ] && [ -n "$(ls -A "$out" 2>/dev/null)" ] && [ ! -f "$out/$marker" ]; then
  echo "gpu_check_wheels.sh: $out holds files this script did not make; name an empty or new folder" >&2
  exit 2
fi
[ ! -e "$out" ] || [ -d "$out" ] || { echo "gpu_check_wheels.sh: $out is not a folder" >&2; exit 2; }
mkdir -p "$out"; touch "$out/$marker"
find "$out" -mindepth 1 -maxdepth 1 ! -name "$marker" -exec rm -rf {} +  # a previous bundle of this script
"$PY" -m pip download --disable-pip-version-check --no-deps --only-binary=:all: --quiet \
  --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
  -d "$out" "${DEPS[@]}"
src=$(mktemp -d); trap 'rm -rf "$src"' EXIT  # built from a copy: setuptools writes build/ beside its source
tar -C "$root" --exclude=__pycache__ -cf - seeupo_gym agents algorithms pyproject.toml README.md LICENSE | tar -C "$src" -xf -
"$PY" -m pip wheel --disable-pip-version-check --no-deps --quiet -w "$out" "$src"
bytes=$(du -cb "$out"/*.whl | tail -1 | cut -f1)
ls -S "$out" | head -5 | while read -r f; do printf '  %6.2f MiB  %s\n' "$(echo "$(stat -c %s "$out/$f") / 1048576" | bc -l)" "$f"; done
mib=$(echo "$bytes / 1048576" | bc -l)
printf 'gpu wheels: %d files, %.2f MiB in %s (limit %d MiB)\n' "$(ls "$out"/*.whl | wc -l)" "$mib" "$out" $LIMIT_MIB
[ "$bytes" -le $(( LIMIT_MIB * 1048576 )) ] || { echo "gpu wheels: over ${LIMIT_MIB} MiB, drop some of EXTRA" >&2; exit 1; }
