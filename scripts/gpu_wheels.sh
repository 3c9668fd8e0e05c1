#!/usr/bin/env bash
# Prepares, on a machine with a package index, what a GPU machine without one needs for
# scripts/gpu_check.sh, for CPython 3.12 on x86-64 Linux, under wheels/ (ignored by git; carried to
# the GPU machine next to the repository, in pieces small enough for a runner that accepts at most
# 64 MiB per upload):
#
#   wheels/small/*.whl            what the torch-only steps need (about 9 MB; travels with the
#                                 first piece, whose run runs those steps at once)
#   wheels/torchrec/*.whl         torchrec and the rest (about 4 MB; travels with the last piece)
#   wheels/torchrec/fbgemm_gpu.sha256  the checksums of the pieces below
#   wheels/fb.part00, 01, 02      fbgemm-gpu 1.6.0, the CUDA 13 build for torch 2.11 (a 443 MiB
#                                 wheel): unpacked, repacked as `tar | xz -9` and split into
#                                 pieces of at most 50 MiB, so torchrec can run there
#   wheels/gr/                    with --gr: the five source files of generative-recommenders'
#                                 Triton HSTU attention (`recsys-bench hstu_gpu --gr wheels/gr`)
#
#   bash scripts/gpu_wheels.sh [--dir DIR] [--no-fbgemm] [--gr CLONE] [REQUIREMENT ...]
#
#   --dir DIR     where to put small/, torchrec/ and the pieces (default: wheels/ in the repository)
#   --no-fbgemm   only the wheels
#   --gr CLONE    also copy generative-recommenders' Triton attention from a clone into DIR/gr
#
# The wheels are what gpu_check.sh needs beyond the GPU machine's torch, pytest and hypothesis,
# pinned to the versions scripts/setup.sh installed on CPU when this list was written. small/:
# nvtx (the engine's only other import); the launcher's config stack, pydantic, pydantic-core,
# annotated-types, typing-inspection, omegaconf, antlr4-python3-runtime, hydra-core; megatron-core.
# torchrec/: typing-extensions, PyYAML, packaging, torchmetrics, lightning-utilities, tqdm (the GPU
# image has these; carrying them keeps the versions tested on CPU), and torchrec 1.6.1 (the
# pure-Python release paired with fbgemm-gpu 1.6.0 and torch 2.11) with what it imports that the
# GPU image lacks: tensordict, cloudpickle, pyvers, iopath, portalocker. Each is fetched without
# its dependencies: name every one. Requirements given replace both lists and go to small/, e.g.
#   bash scripts/gpu_wheels.sh --no-fbgemm nvtx==0.2.17
# A requirement published without a wheel for that platform (antlr4-python3-runtime 4.9.3 has only
# a source archive) is built here into a wheel, which is kept only if it is pure Python.
# Repacking takes about 5 minutes on 2 cores (xz -9, 2 threads); a second run keeps pieces whose
# checksums still match. scripts/gpu_check.sh --stage 1, 2, 3 installs them (docs/gpu.md).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="$ROOT/wheels"
PY="${PYTHON:-python3}"
SMALL_DEFAULT=(
  nvtx==0.2.17
  pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5
  omegaconf==2.3.1 antlr4-python3-runtime==4.9.3 hydra-core==1.3.8
  megatron-core==0.16.1
)
TORCHREC_DEFAULT=(
  typing-extensions==4.16.0 PyYAML==6.0.3 packaging==26.3
  torchmetrics==1.9.0 lightning-utilities==0.15.3 tqdm==4.70.1
  torchrec==1.6.1 tensordict==0.15.3 cloudpickle==3.1.2 pyvers==0.2.3 iopath==0.1.9 portalocker==4.4.2
)
FBGEMM=fbgemm-gpu==1.6.0
#: one piece's size: of 64 MiB per upload it leaves room for the repository (4 MB) and the wheels
#: that travel with it (small/ with the first piece, torchrec/ with the last)
PIECE_SIZE=50m
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64)

requirements=()
FBGEMM_PIECES=1
GR_CLONE=""
#: what `recsys-bench hstu_gpu --gr` imports of generative-recommenders (its Triton HSTU attention)
GR_FILES=(
  generative_recommenders/__init__.py generative_recommenders/common.py generative_recommenders/ops/utils.py
  generative_recommenders/ops/triton/triton_hstu_attention.py generative_recommenders/ops/triton/triton_attention_utils.py
)
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dir)
      [[ $# -ge 2 && -n "$2" ]] || { echo "gpu_wheels: --dir needs a directory" >&2; exit 2; }
      DIR="$2"
      shift 2
      ;;
    --no-fbgemm) FBGEMM_PIECES=0; shift ;;
    --gr)
      [[ $# -ge 2 && -d "$2/generative_recommenders" ]] || { echo "gpu_wheels: --gr needs a generative-recommenders clone" >&2; exit 2; }
      GR_CLONE="$2"
      shift 2
      ;;
    -h | --help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"; exit 0 ;;
    -*) echo "gpu_wheels: unknown option '$1' (see --help)" >&2; exit 2 ;;
    *) requirements+=("$1"); shift ;;
  esac
done
if [[ -n "$GR_CLONE" ]]; then # a few source files: they travel to the GPU machine with the first run
  rm -rf "$DIR/gr"
  for file in "${GR_FILES[@]}"; do
    mkdir -p "$DIR/gr/$(dirname "$file")"
    cp "$GR_CLONE/$file" "$DIR/gr/$file"
  done
  echo "[gpu_wheels] generative-recommenders' Triton attention: ${#GR_FILES[@]} files in $DIR/gr ($(git -C "$GR_CLONE" rev-parse --short HEAD 2>/dev/null || echo 'no git'))"
fi
SMALL="$DIR/small"
TORCHREC="$DIR/torchrec"
mkdir -p "$SMALL" "$TORCHREC"
destinations=()
if ((${#requirements[@]})); then
  for requirement in "${requirements[@]}"; do destinations+=("$SMALL"); done
else
  requirements=("${SMALL_DEFAULT[@]}" "${TORCHREC_DEFAULT[@]}")
  for requirement in "${SMALL_DEFAULT[@]}"; do destinations+=("$SMALL"); done
  for requirement in "${TORCHREC_DEFAULT[@]}"; do destinations+=("$TORCHREC"); done
fi

platform_args=()
for p in "${PLATFORMS[@]}"; do
  platform_args+=(--platform "$p")
done

log="$(mktemp)"
trap 'rm -f "$log"' EXIT
for i in "${!requirements[@]}"; do
  requirement="${requirements[$i]}" dest="${destinations[$i]}"
  if "$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp "${platform_args[@]}" -d "$dest" "$requirement" >"$log" 2>&1; then
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
  mv "${built[0]}" "$dest/"
  rm -rf "$build"
  echo "[gpu_wheels] $requirement: pure-Python wheel built"
done

for dest in "$SMALL" "$TORCHREC"; do
  if compgen -G "$dest/*.whl" >/dev/null; then
    echo "[gpu_wheels] wheels: $(du -ch "$dest"/*.whl | tail -n 1 | cut -f1) in $dest"
  fi
done

((FBGEMM_PIECES)) || exit 0
# -- fbgemm-gpu in pieces ---------------------------------------------------------------------------
MANIFEST="$TORCHREC/fbgemm_gpu.sha256"
if [[ -f "$MANIFEST" ]] && (cd "$DIR" && sha256sum --quiet -c "$MANIFEST" >/dev/null 2>&1); then
  echo "[gpu_wheels] $FBGEMM: pieces already made and intact ($MANIFEST)"
else
  work="$(mktemp -d "${TMPDIR:-/tmp}/gpu_wheels.XXXXXX")"
  trap 'rm -f "$log"; rm -rf "$work"' EXIT
  "$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp "${platform_args[@]}" -d "$work" "$FBGEMM"
  wheel=("$work"/*.whl)
  echo "[gpu_wheels] $FBGEMM: $(basename "${wheel[0]}"), $(du -h "${wheel[0]}" | cut -f1); repacking (xz -9, takes minutes)"
  # A wheel is a zip of its site-packages layout: unpacked, it is the installed package.
  "$PY" -m zipfile -e "${wheel[0]}" "$work/site"
  rm -f "${wheel[0]}" "$MANIFEST" "$DIR"/fb.part*
  tar -C "$work/site" -cf - . | xz -T2 -9 >"$work/fbgemm_gpu.tar.xz"
  split -b "$PIECE_SIZE" -d -a 2 "$work/fbgemm_gpu.tar.xz" "$DIR/fb.part"
  (cd "$DIR" && sha256sum fb.part*) >"$MANIFEST"
fi
for piece in "$DIR"/fb.part*; do
  echo "[gpu_wheels] $(basename "$piece"): $(stat -c %s "$piece") bytes"
done
echo "[gpu_wheels] each run of scripts/gpu_check.sh --stage N brings fb.part0(N-1); the first also brings $SMALL, the last $TORCHREC"
