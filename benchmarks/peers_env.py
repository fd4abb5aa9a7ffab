"""How each side of ``python -m benchmarks.peers`` is installed.

TRL runs in a virtual environment of its own (:func:`trl_python`), as its users install
it: TRL and its dependencies only, never vLLM. It is built once under
``.cache/peers-trl-venv`` and reused while its pins are unchanged (a stamp file records
them): ``trl`` and ``accelerate`` as the ``peers`` extra of ``pyproject.toml`` pins them,
``transformers`` and ``datasets`` at the versions the project's own environment runs (so
both sides load the model with the same code), torch 2.13.0 held by the constraint
``torch==2.13.0+cpu`` as ``scripts/setup.sh`` holds the project's, and ``pydantic``: the
one package of the project's own that the adapter (``benchmarks.peers_trl`` reads the
task through ``pipeline_rl``'s configuration) needs beyond TRL's.

``project`` (``--trl-env project``) runs TRL from the project's environment instead, where
vLLM is installed and imported by nothing TRL does but still found: the suite's quick test
uses it (no environment to build, offline).

:func:`installed` asks an interpreter which versions it imports, so the report states
what each side ran.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tomllib
from importlib.metadata import version
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT

VENV = ROOT / ".cache" / "peers-trl-venv"
TORCH = "torch==2.13.0+cpu"
TORCH_INDEX = "https://download.pytorch.org/whl/cpu"
#: Versions taken from the project's environment (same model code on both sides; the adapter's pydantic).
SAME_AS_PROJECT = ("transformers", "datasets", "pydantic")
#: What each side's report lists (a module missing from an interpreter is reported as absent).
TRL_MODULES = ("torch", "transformers", "trl", "accelerate", "datasets", "vllm")
PROJECT_MODULES = ("torch", "transformers", "vllm", "deepspeed", "ray")
_STAMP = ".peers_pins"


def pins() -> list[str]:
    """The TRL environment's requirements (see the module docstring)."""
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["peers"]
    return [*extra, *(f"{name}=={version(name)}" for name in SAME_AS_PROJECT)]


def stamp() -> str:
    return "\n".join([*pins(), f"constraint {TORCH}", f"python {sys.version_info[0]}.{sys.version_info[1]}"])


def trl_python(venv: Path = VENV, log: Any = print) -> Path:
    """The clean TRL environment's interpreter, built first where missing or stale."""
    py = venv / "bin" / "python"
    want = stamp()
    if py.is_file() and (venv / _STAMP).is_file() and (venv / _STAMP).read_text() == want:
        return py
    log(f"peers: building TRL's own environment at {venv} (once; a few minutes): {', '.join(pins())}, {TORCH}")
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    constraints = venv / "constraints.txt"
    constraints.write_text(TORCH + "\n")
    pip = [str(py), "-m", "pip", "--disable-pip-version-check", "install", "-q", "-c", str(constraints)]
    # torch first, from the configured index or PyTorch's CPU index (as scripts/setup.sh does).
    if subprocess.run([*pip, TORCH], check=False, capture_output=True).returncode != 0:
        subprocess.run([*pip, TORCH, "--extra-index-url", TORCH_INDEX], check=True)
    subprocess.run([*pip, *pins()], check=True)
    got = installed(py, TRL_MODULES)
    if got["versions"].get("vllm") is not None:
        raise RuntimeError(f"{venv}: vLLM was installed with TRL's requirements")
    (venv / _STAMP).write_text(want)
    return py


def installed(python: Path | str, modules: tuple[str, ...]) -> dict[str, Any]:
    """What ``python`` runs: its environment (``sys.prefix``) and the version of each of
    ``modules`` it imports (None: not installed there)."""
    code = ("import importlib, importlib.util, json, sys\n"
            f"mods = {list(modules)!r}\n"
            "v = {m: (getattr(importlib.import_module(m), '__version__', '?') if importlib.util.find_spec(m) else None)"
            " for m in mods}\n"
            "print(json.dumps({'prefix': sys.prefix, 'versions': v}))")
    done = subprocess.run([str(python), "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def describe(side: str, info: dict[str, Any]) -> str:
    """One line: the side, its environment and the versions it imports."""
    have = ", ".join(f"{m} {v}" for m, v in info["versions"].items() if v is not None)
    absent = [m for m, v in info["versions"].items() if v is None]
    return f"{side}: {info['prefix']} ({have}" + (f"; no {', '.join(absent)}" if absent else "") + ")"
