#!/usr/bin/env bash
# Prepares, on a machine with a package index, the wheels a GPU machine without one needs for
# scripts/gpu_check.sh: downloads them for CPython 3.12 on x86-64 Linux into wheels/ (ignored by
# git; carried to the GPU machine next to the repository).
#
#   bash scripts/gpu_wheels.sh [--dir DIR] [REQUIREMENT ...]
#
# Without requirements it fetches what gpu_check.sh needs beyond the GPU machine's torch, pytest and
# hypothesis (about 11 MB), pinned to the versions scripts/setup.sh installed on CPU when this list
# was written: nvtx (the engine's only other import); the launcher's config stack, pydantic,
# pydantic-core, annotated-types, typing-inspection, typing-extensions, omegaconf,
# antlr4-python3-runtime, hydra-core, PyYAML; megatron-core and the packaging it requires; and what
# the trainer imports, torchmetrics, lightning-utilities, tqdm (the GPU image has some of these;
# carrying them keeps the versions tested on CPU). Each is fetched without its dependencies: name
# every one. Further requirements replace the list, e.g.
#   bash scripts/gpu_wheels.sh nvtx==0.2.17
# A requirement published without a wheel for that platform (antlr4-python3-runtime 4.9.3 has only
# a source archive) is built here into a wheel, which is kept only if it is pure Python.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="$ROOT/wheels"
PY="${PYTHON:-python3}"
DEFAULT=(
  nvtx==0.2.17
  pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0
  omegaconf==2.3.1 antlr4-python3-runtime==4.9.3 hydra-core==1.3.8 PyYAML==6.0.3
  megatron-core==0.16.1 packaging==26.3
  torchmetrics==1.9.0 lightning-utilities==0.15.3 tqdm==4.70.1
)
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64)

requirements=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dir)
      [[ $# -ge 2 && -n "$2" ]] || { echo "gpu_wheels: --dir needs a directory" >&2; exit 2; }
      DIR="$2"
      shift 2
      ;;
    -h | --help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"; exit 0 ;;
    -*) echo "gpu_wheels: unknown option '$1' (see --help)" >&2; exit 2 ;;
    *) requirements+=("$1"); shift ;;
  esac
done
((${#requirements[@]})) || requirements=("${DEFAULT[@]}")
mkdir -p "$DIR"

platform_args=()
for p in "${PLATFORMS[@]}"; do
  platform_args+=(--platform "$p")
done

log="$(mktemp)"
trap 'rm -f "$log"' EXIT
for requirement in "${requirements[@]}"; do
  if "$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp "${platform_args[@]}" -d "$DIR" "$requirement" >"$log" 2>&1; then
    echo "[gpu_wheels] $requirement: wheel downloaded"
    continue
  fi
  echo "[gpu_wheels] $requirement: no wheel for CPython 3.12 x86-64; building one from the source archive"
  build="$(mktemp -d)"
  "$PY" -m pip wheel -q --disable-pip-version-check --no-deps -w "$build" "$requirement"
  built=("$build"/*.whl)
  if [[ "${built[0]}" != *-py3-none-any.whl && "${built[0]}" != *-py2.py3-none-any.whl ]]; then
    echo "gpu_wheels: $requirement built as $(basename "${built[0]}"), which is not pure Python; not kept" >&2
    rm -rf "$build"
    exit 1
  fi
  mv "${built[0]}" "$DIR/"
  rm -rf "$build"
  echo "[gpu_wheels] $requirement: pure-Python wheel built"
done

du -ch "$DIR"/*.whl | tail -n 1 | sed "s|total|in $DIR (the device tool carries at most 64 MiB with the repository)|"
