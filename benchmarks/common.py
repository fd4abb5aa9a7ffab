"""The benchmarks' harness: one command line and one way to report (:func:`main`), one
Ray (:func:`ray_session`), one run of the real pipeline (:func:`run_pipeline`), and the
hardware every figure names.

Every benchmark runs as ``python -m benchmarks.NAME [flags]`` from the repository root and
takes, besides its own flags (``--help`` documents each): ``--json PATH`` (its figures),
``--md PATH`` (its report, which it also prints), and where it has them ``--quick`` (a
smoke run, what the tests run), ``--out DIR`` (its run folders; its JSON and
Markdown are written there too, named after it) and pipeline flags after ``--``.
What it writes carries no absolute path of the machine (:func:`portable`).
"""

from __future__ import annotations

import argparse
import contextlib
import contextvars
import shutil
import json
import logging
import os
import platform
import re
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipeline_rl.config import Config

ROOT = Path(__file__).resolve().parent.parent


class BadFlag(ValueError):
    """A bad flag value, one line naming the flag: :func:`main` exits with it as a usage error (status 2)."""


@dataclass(frozen=True, slots=True)
class Outcome:
    """What a benchmark's run hands back to :func:`main`: its figures (``--json``; None when
    a child process already reported them), its Markdown report (``--md``), the exit status,
    and ``summary``: what to print instead of the report (default: the report)."""

    result: dict[str, Any] | None
    md: str = ""
    status: int = 0
    summary: str | None = None


def main(name: str, doc: str | None, argv: list[str] | None, run: Callable[[argparse.Namespace], Outcome], *,
         flags: Callable[[argparse.ArgumentParser], object] | None = None, quick: str | None = None,
         run_flags: str | None = None, out: str | None = None, json_path: Path | None = None,
         md_path: Path | None = None, epilog: str | None = None) -> int:
    """A benchmark's entry point: parse ``argv`` (its own ``flags`` plus the common ones),
    ``run`` it, write and print what it reports; returns the exit status. ``quick``,
    ``run_flags``, ``out``: the help of ``--quick``, of the pipeline flags after ``--``
    (``args.run_flags``) and the default of ``--out``, each only where given."""
    p = argparse.ArgumentParser(prog=f"python -m benchmarks.{name}", epilog=epilog,
                                description=" ".join((doc or "").split("\n\n")[0].split()))
    if flags is not None:
        flags(p)
    if quick is not None:
        p.add_argument("--quick", action="store_true", help=quick)
    if out is not None:
        p.add_argument("--out", type=Path, default=Path(out), metavar="DIR",
                       help=f"Run folders and outputs, {name}.json and {name}.md among them (default {out}).")
    p.add_argument("--json", type=Path, default=json_path, metavar="PATH",
                   help=f"Write the figures as JSON here (default: {json_path or 'none'}).")
    p.add_argument("--md", type=Path, default=md_path, metavar="PATH",
                   help=f"Write the Markdown report here (default: {md_path or 'none'}).")
    if run_flags is not None:
        p.add_argument("run_flags", nargs="*", metavar="-- FLAGS", help=run_flags)
    undocumented = [a.option_strings or a.dest for a in p._actions if not a.help]
    if undocumented:
        raise TypeError(f"benchmarks.{name}: flags without help: {undocumented}")
    args = p.parse_args(argv)
    try:
        outcome = run(args)
    except BadFlag as e:
        p.error(str(e))
    if outcome.result is not None:
        body = json.dumps(outcome.result, indent=1)
        outputs = [(args.json, body), (args.md, outcome.md)]
        if out is not None:
            outputs += [(args.out / f"{name}.json", body), (args.out / f"{name}.md", outcome.md)]
        write_files(outputs)
    text = outcome.md if outcome.summary is None else outcome.summary
    if text:
        print(text, flush=True)
    return outcome.status


def launch_run(folder: Path, flags: list[str], log: Path, timeout_s: float = 1800) -> str:
    """The README's main job as a user runs it, a process of its own: ``launch/async_grpo.py
    --out-dir folder`` plus ``flags``, one thread per process; its output kept in ``log``
    and returned. A run that fails raises RuntimeError with its last line."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    cmd = [sys.executable, str(root / "launch" / "async_grpo.py"), "--out-dir", str(folder), *flags]
    env = os.environ | {"OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled"}
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=root, env=env, timeout=timeout_s)
    log.write_text(done.stdout + done.stderr)
    if done.returncode:
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise RuntimeError(f"{folder.name}: the run failed (exit {done.returncode}): {tail}")
    return done.stdout + done.stderr


def at_least(args: argparse.Namespace, **lows: float) -> None:
    """Raise :class:`BadFlag` for the first flag ``--NAME`` (attribute ``NAME``) below its bound."""
    for attr, low in lows.items():
        value = getattr(args, attr)
        if value < low:
            raise BadFlag(f"--{attr.replace('_', '-')} must be >= {low}, got {value}")


def write_files(outputs: list[tuple[Path | None, str]]) -> None:
    """Write each ``(path, text)`` whose path is given (parents made, a final newline), its
    paths made :func:`portable`."""
    for path, body in outputs:
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(portable(body) + "\n")


def portable(text: str) -> str:
    """``text`` with this machine's absolute paths written as anyone's: the model cache as
    ``.cache/pipeline_rl/...`` (also where ``$PIPELINE_RL_CACHE_DIR`` or a linked ``.cache`` points),
    the repository's files relative to it (``.venv``, ``.cache/peers-trl-venv``; ``.`` for
    the repository itself, also through a link in it), the home folder as ``~`` and the
    temporary folder as ``$TMPDIR``. A results page is read on other machines."""
    from pipeline_rl.models.default import cache_root

    places: dict[str, str] = {}
    cache = cache_root()
    for folder in (cache, cache.resolve()):
        places[str(folder)] = ".cache/pipeline_rl"
    for entry in (ROOT / ".cache", ROOT / ".venv"):
        places[str(entry.resolve())] = entry.name
    places[str(ROOT)] = "."
    places.setdefault(str(Path.home()), "~")
    places.setdefault(str(Path(tempfile.gettempdir()).resolve()), "$TMPDIR")
    for at in sorted((a for a in places if a not in ("", "/")), key=len, reverse=True):
        with_slash = re.compile(r"(?<![\w./~$-])" + re.escape(at) + r"/")
        alone = re.compile(r"(?<![\w./~$-])" + re.escape(at) + r"(?![\w./-])")
        name = places[at]
        under = "" if name == "." else name + "/"
        text = with_slash.sub(lambda _: under, text)
        text = alone.sub(lambda _: name, text)
    return text


def pyplot() -> Any:
    """matplotlib's pyplot, drawing into files (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def hardware() -> dict[str, Any]:
    """What the figures were measured on."""
    from pipeline_rl.resources import this_cpuinfo

    names = [line.split(":", 1)[1].strip() for line in this_cpuinfo().splitlines() if line.startswith("model name")]
    cpu = names[0] if names else platform.processor() or platform.machine()
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(mem_gib, 1),
            "gpu": None, "python": platform.python_version()}


def config(argv: list[str], *, evaluation: bool = False) -> Config:
    """The run configuration of ``argv`` (a bad flag: :class:`BadFlag`); held-out evaluation
    off unless ``evaluation`` or ``argv`` turns it on (run-level benchmarks compare training
    speed and reward)."""
    from pipeline_rl.cli import UsageError, parse_config

    try:
        return parse_config([*([] if evaluation else ["--eval.every", "0"]), *argv])[0]
    except UsageError as e:
        raise BadFlag(str(e)) from None


def repo_on_path() -> dict[str, str]:
    """``PYTHONPATH`` with this repository first: what a process started here (a Ray
    worker, a child process) needs to import ``benchmarks``."""
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}


#: Whether the Ray of the current :func:`ray_session` was started here (a benchmark's own
#: local Ray, as the command starts its own): :func:`run_pipeline` then pins the actors as
#: the command does (``--ray.pin_cores`` unset pins only on a Ray the run started itself).
_OWN_RAY: contextvars.ContextVar[bool] = contextvars.ContextVar("own_ray", default=False)


@contextlib.contextmanager
def ray_session(address: str | None = None, *, env: dict[str, str] | None = None,
                object_store_bytes: int = 200 * 2**20, num_cpus: int | None = None,
                log_to_driver: bool = False) -> Iterator[None]:
    """Ray for the block, shut down after it: the cluster at ``address``, or a local Ray
    started as the command starts it (``start_local``; ``num_cpus``, default one per core,
    and ``object_store_bytes``). Every Ray worker gets the actors' environment, this
    repository on its path and ``env``."""
    import ray

    from pipeline_rl.runtime_env import ACTOR_ENV, for_local_ray

    os.environ.update({k: v for k, v in ACTOR_ENV.items() if k not in os.environ})
    for_local_ray()
    env_vars = {**ACTOR_ENV, **repo_on_path(), **(env or {})}
    if address:
        ray.init(address=address, runtime_env={"env_vars": env_vars}, log_to_driver=log_to_driver)
    else:
        from pipeline_rl.run.local_ray import start_local

        start_local(num_cpus=num_cpus or os.cpu_count() or 2, object_store_mb=-(-object_store_bytes // 2**20),
                    env=env_vars, logging_level=logging.WARNING, log_to_driver=log_to_driver)
    token = _OWN_RAY.set(not address)
    try:
        yield
    finally:
        _OWN_RAY.reset(token)
        ray.shutdown()


def run_pipeline(cfg: Config, watch: Callable[[Any], contextlib.AbstractContextManager[object]] | None = None
                 ) -> list[dict[str, Any]]:
    """Run one configuration through the real orchestrator (as ``launch/async_grpo.py`` does,
    on the Ray of a :func:`ray_session`); ``watch(orchestrator)``: a context held while it
    trains. Returns its metrics rows. A benchmark's ``--out-dir`` is its own: a run there
    before (a re-run cell, a repeat) is cleared first, unless this one resumes it."""
    from pipeline_rl.driver import resolve_model_dir
    from pipeline_rl.metrics import read_metrics
    from pipeline_rl.run.life.one_life import Orchestrator
    from pipeline_rl.run.life.start import open_run
    from pipeline_rl.run.life.run_folder import RUN_ENTRIES

    if cfg.ray.pin_cores is None and _OWN_RAY.get():
        cfg = cfg.model_copy(update={"ray": cfg.ray.model_copy(update={"pin_cores": True})})
    if cfg.out_dir is not None and not cfg.resume:
        for name in RUN_ENTRIES:
            target = Path(cfg.out_dir) / name
            shutil.rmtree(target) if target.is_dir() else target.unlink(missing_ok=True)
    with Orchestrator(cfg, resolve_model_dir(cfg), threading.Event(), open_run(cfg)) as orch, \
            (watch(orch) if watch is not None else contextlib.nullcontext()):
        orch.train()
    return read_metrics(orch.out / "metrics.jsonl")
