#!/usr/bin/env bash
# Set up (or reuse) .venv with the test tools, type-check, and run the whole suite.
# Usage: scripts/test.sh [pytest args...]
# Test files run two at a time, each whole in one worker (--dist loadfile: a module's Ray and
# model fixtures are built once); a machine with more cores runs one file per two cores.
# Every test keeps to its own processes, ports and folders, so files never see each other.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --dev
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false RAY_AUTH_MODE=disabled
echo "test.sh: type check (mypy)" >&2
.venv/bin/python -m mypy
echo "test.sh: tests (pytest)" >&2
WORKERS=$(( $(nproc) / 2 > 2 ? $(nproc) / 2 : 2 ))
exec .venv/bin/python -m pytest -n "$WORKERS" --dist loadfile "$@"
