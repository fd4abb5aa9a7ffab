"""One folder per run: nothing a run writes (metrics, evaluations, TensorBoard events, logs,
checkpoints) ever lands in another run's folder.

- No ``--out-dir``: a new folder ``runs/<date>-<time>`` (``-2``, ``-3``, ... when taken),
  and ``runs/latest`` points at the newest (a symbolic link; a real ``runs/latest`` folder
  left by an older version is first renamed after its last change).
- ``--out-dir DIR``: DIR must not hold a run already (a ``run.json``, ``metrics.jsonl`` or
  ``checkpoints/``); one line refuses it otherwise.
- ``--resume DIR/checkpoints/step_N`` continues that run in DIR (``--out-dir`` may only name
  DIR): its records past step N (the steps the resumed run redoes) are dropped, later
  steps are appended, and the line says so; the summary covers the whole run.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any

from pipeline_rl.metrics import read_metrics

RUNS = Path("runs")
MARKER = "run.json"
#: What a run writes into its folder (a new run into a used folder clears these first).
RUN_ENTRIES = (MARKER, "metrics.jsonl", "eval.jsonl", "checkpoints", "tb")


class RunFolderError(ValueError):
    """A run folder that cannot be used; the message is one line naming the flag."""


@dataclass(frozen=True, slots=True)
class RunFolder:
    """The folder a run writes into. ``resumed_at``: the version a run resumed in this
    folder continues from (None: a new folder); ``elapsed_s``: the run's wall time before
    this segment; ``start_version``: the policy version the run starts at (0, or the
    ``--resume`` checkpoint's, wherever the run writes), read once, when the folder opens."""

    path: Path
    resumed_at: int | None = None
    elapsed_s: float = 0.0
    dropped: int = 0
    start_version: int = 0

    def line(self) -> str:
        if self.resumed_at is None:
            return f"run folder: {self.path}"
        return (f"run folder: {self.path} (resuming at step {self.resumed_at}: appending to its records"
                + (f", {self.dropped} rows past step {self.resumed_at} dropped)" if self.dropped else ")"))


def holds_run(path: Path) -> bool:
    return any((path / name).exists() for name in (MARKER, "metrics.jsonl", "checkpoints"))


def open_run_folder(out_dir: str | None, resume: str | None, resume_version: int = 0,
                    runs: Path = RUNS) -> RunFolder:
    """The folder this run writes into (see the module docstring), created and marked."""
    home = _run_of(resume)
    if out_dir is None and home is None:
        folder = RunFolder(_new_folder(runs))
    else:
        path = Path(out_dir) if out_dir is not None else home
        assert path is not None
        if home is not None and path.resolve() == home.resolve():
            folder = _continue(path, resume_version)
        elif holds_run(path):
            raise RunFolderError(f"--out-dir: {path} already holds a run; give a new folder, leave --out-dir "
                                 f"out (a new runs/<date>-<time>), or continue it with --resume "
                                 f"{path}/checkpoints/step_N")
        else:
            folder = RunFolder(path)
    folder = replace(folder, start_version=resume_version)
    _mark(folder)
    return folder


def _run_of(resume: str | None) -> Path | None:
    """The run folder a checkpoint belongs to (``RUN/checkpoints/step_N``), if it is one."""
    if resume is None:
        return None
    ckpt = Path(resume)
    return ckpt.parent.parent if ckpt.parent.name == "checkpoints" and holds_run(ckpt.parent.parent) else None


def _new_folder(runs: Path) -> Path:
    runs.mkdir(parents=True, exist_ok=True)
    latest = runs / "latest"
    if latest.is_dir() and not latest.is_symlink():   # an older version's single run folder
        stamp = datetime.fromtimestamp(latest.stat().st_mtime).strftime("%Y%m%d-%H%M%S")
        latest.rename(runs / f"{stamp}-old")
    base = datetime.now().strftime("%Y%m%d-%H%M%S")
    path, n = runs / base, 1
    while True:
        try:
            path.mkdir()
            break
        except FileExistsError:
            n += 1
            path = runs / f"{base}-{n}"
    tmp = runs / f".latest-{os.getpid()}"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(path.name)
    tmp.replace(latest)   # atomic: readers see the old target or the new one
    return path


def _continue(path: Path, version: int) -> RunFolder:
    """Resume in ``path`` at ``version``: keep the records of steps up to it."""
    kept, dropped = _keep(path / "metrics.jsonl", lambda rec: rec["step"] <= version)
    _, dropped_evals = _keep(path / "eval.jsonl", lambda rec: rec["step"] < version)
    elapsed = float(kept[-1].get("time_s", 0.0)) if kept else 0.0
    return RunFolder(path, resumed_at=version, elapsed_s=elapsed, dropped=dropped + dropped_evals)


def _keep(file: Path, keep: Callable[[dict[str, Any]], bool]) -> tuple[list[dict[str, Any]], int]:
    if not file.exists():
        return [], 0
    rows = read_metrics(file)
    kept = [r for r in rows if keep(r)]
    if len(kept) < len(rows):
        file.write_text("".join(json.dumps(r) + "\n" for r in kept))
    return kept, len(rows) - len(kept)


def _mark(folder: RunFolder) -> None:
    """``run.json``: when each segment of the run started (a resume adds one)."""
    folder.path.mkdir(parents=True, exist_ok=True)
    marker = folder.path / MARKER
    segments = json.loads(marker.read_text())["segments"] if marker.exists() else []
    segments.append({"started_unix_s": time.time(), "resumed_at": folder.resumed_at})
    marker.write_text(json.dumps({"segments": segments}, indent=1) + "\n")
