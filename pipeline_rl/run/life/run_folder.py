"""One folder per run: nothing a run writes (metrics, evaluations, TensorBoard events, logs,
checkpoints) ever lands in another run's folder.

- No ``--out-dir``: a new folder ``runs/<date>-<time>`` (``-2``, ``-3``, ... when taken),
  and ``runs/latest`` points at the newest (a symbolic link; a real ``runs/latest`` folder
  left by an older version is first renamed after its last change).
- ``--out-dir DIR``: DIR must not hold a run already (a ``run.json``, ``metrics.jsonl`` or
  ``checkpoints/``); one line refuses it otherwise.
- ``--resume DIR/checkpoints/step_N`` continues that run in DIR (``--out-dir`` may only name
  DIR); ``--resume DIR`` means DIR's newest complete checkpoint (:func:`resolve_resume`).
  What the resumed run redoes is dropped from every record -- ``metrics.jsonl`` rows past
  step N, ``eval.jsonl`` evaluations from step N on (the resumed run evaluates at its
  start) and the same TensorBoard events -- later steps are appended, and the line says
  so; the summary covers the whole run. Each resume is marked where it happened: a
  :class:`ResumeMark` line in ``resumes.jsonl`` and, in TensorBoard, ``run/resumes`` (how
  many so far) and the text ``run/resume`` at step N. So a run resumed again and again
  keeps one row per step, one evaluation per evaluated step and one curve.
- One timeline per run folder: a resume from an older checkpoint than the newest starts a
  new timeline from it. Every checkpoint past it (complete or a killed save's ``.partial``
  or ``.old``) is moved, never deleted, to ``abandoned/resume_<K>/`` (K: the resume's
  number), outside ``checkpoints/``, and the run folder line says where; a ``best`` link
  that named one of them is removed (the keep policy points it again). So what scans
  ``checkpoints/step_*`` -- a restart, ``--resume DIR``, ``--trainer.keep_checkpoints``,
  ``best`` -- sees the live timeline only, and its scores come from ``eval.jsonl``,
  trimmed as above. The :class:`ResumeMark` lists what moved.
- A save a kill interrupted (a ``step_N.partial`` or ``step_N.old`` left behind) is
  tidied before a resume (``training.checkpoint.recover_checkpoints``): it never resumes
  unless it had finished, and the previous checkpoint stays the one to resume from (one
  past the checkpoint resumed is moved aside as it is, with the abandoned timeline).
"""

from __future__ import annotations

import json
import logging
import os
import struct
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any

from pipeline_rl.config import Config
from pipeline_rl.metrics import read_metrics

log = logging.getLogger("pipeline_rl.run.life.run_folder")

RUNS = Path("runs")
MARKER = "run.json"
RESUMES = "resumes.jsonl"
#: Where a resume from an older checkpoint moves the later ones (``abandoned/resume_<K>``).
ABANDONED = "abandoned"
#: What a run writes into its folder (a new run into a used folder clears these first).
RUN_ENTRIES = (MARKER, "metrics.jsonl", "eval.jsonl", RESUMES, "checkpoints", "tb", ABANDONED)


class RunFolderError(ValueError):
    """A run folder that cannot be used; the message is one line naming the flag."""


@dataclass(frozen=True, slots=True)
class RunFolder:
    """The folder a run writes into. ``resumed_at``: the version a run resumed in this
    folder continues from (None: a new folder); ``elapsed_s``: the run's wall time before
    this segment; ``start_version``: the policy version the run starts at (0, or the
    ``--resume`` checkpoint's, wherever the run writes), read once, when the folder opens;
    ``dropped``: the records a resume dropped (rows, evaluations, events); ``mark``: this
    resume's :class:`ResumeMark` (None unless resumed in this folder)."""

    path: Path
    resumed_at: int | None = None
    elapsed_s: float = 0.0
    dropped: int = 0
    start_version: int = 0
    mark: ResumeMark | None = None

    def line(self) -> str:
        if self.mark is None:
            return f"run folder: {self.path}"
        m = self.mark
        redone = (f", dropped what it redoes: {m.dropped_steps} step rows, {m.dropped_evals} evaluation(s), "
                  f"{m.dropped_events} TensorBoard event(s)" if self.dropped else "")
        moved = (f"; a new timeline: {len(m.abandoned)} later checkpoint(s) moved to {self.path / m.abandoned_to}"
                 if m.abandoned else "")
        return (f"run folder: {self.path} (resume {m.number}, at step {m.resumed_at}: appending to its "
                f"records{redone}{moved})")


@dataclass(frozen=True, slots=True)
class ResumeMark:
    """One resume of a run (a line of ``resumes.jsonl``): the ``number``-th, at step
    ``resumed_at`` (the checkpoint's version), from ``checkpoint``; what it dropped because
    the resumed run redoes it (``metrics.jsonl`` rows, ``eval.jsonl`` evaluations,
    TensorBoard events); ``time_s``: the run's clock at that step (the resumed run goes on
    from it); ``unix_time_s``: when the resume started; ``abandoned``: the checkpoint
    folders past ``resumed_at`` it moved aside, to ``abandoned_to`` (relative to the run
    folder; none, and "", when it resumed the newest)."""

    number: int
    resumed_at: int
    checkpoint: str
    dropped_steps: int
    dropped_evals: int
    dropped_events: int
    time_s: float
    unix_time_s: float
    abandoned: list[str] = field(default_factory=list)
    abandoned_to: str = ""


def read_resumes(path: Path) -> list[ResumeMark]:
    """The resumes of the run in folder ``path``, oldest first (none for a run never resumed)."""
    file = path / RESUMES
    return [ResumeMark(**rec) for rec in read_metrics(file)] if file.exists() else []


def resolve_resume(cfg: Config) -> Config:
    """``cfg`` with ``--resume`` naming a checkpoint: a run folder (one with ``checkpoints/``)
    stands for its newest complete checkpoint. The leftovers of a save a kill interrupted
    are tidied first (``training.checkpoint.recover_checkpoints``, one warning line each;
    for a named ``step_N``, those up to N: later ones belong to the timeline a resume in
    this folder abandons). Raises :class:`RunFolderError` when a run folder holds no
    complete checkpoint."""
    if not cfg.resume:
        return cfg
    from pipeline_rl.training.checkpoint import latest_checkpoint, recover_checkpoints, step_of

    given = Path(cfg.resume)
    run_dir = (given / "checkpoints").is_dir()
    root = given / "checkpoints" if run_dir else given.parent
    if root.name == "checkpoints" and root.is_dir():
        for done in recover_checkpoints(root, None if run_dir else step_of(given.resolve().name)):
            log.warning("--resume: a checkpoint save was interrupted: %s", done)
    if not run_dir:
        return cfg
    latest = latest_checkpoint(root)
    if latest is None:
        raise RunFolderError(f"--resume: {given} is a run folder without a complete checkpoint in {root}")
    return cfg.model_copy(update={"resume": str(latest)})


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
            folder = _continue(path, resume_version, str(resume))
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


def _continue(path: Path, version: int, checkpoint: str) -> RunFolder:
    """Resume in ``path`` at ``version``: move the checkpoints past it aside, keep the
    records of steps up to it, and mark the resume."""
    number = len(read_resumes(path)) + 1
    abandoned_to, abandoned = _abandon(path, version, number)
    kept, dropped = _keep(path / "metrics.jsonl", lambda rec: rec["step"] <= version)
    _, dropped_evals = _keep(path / "eval.jsonl", lambda rec: rec["step"] < version)
    dropped_events = sum(_trim_events(f, version) for f in sorted((path / "tb").glob("*tfevents*")))
    elapsed = float(kept[-1].get("time_s", 0.0)) if kept else 0.0
    mark = ResumeMark(number=number, resumed_at=version, checkpoint=checkpoint,
                      dropped_steps=dropped, dropped_evals=dropped_evals, dropped_events=dropped_events,
                      time_s=elapsed, unix_time_s=time.time(), abandoned=abandoned, abandoned_to=abandoned_to)
    with (path / RESUMES).open("a", encoding="utf-8") as f:
        f.write(json.dumps(asdict(mark)) + "\n")
    return RunFolder(path, resumed_at=version, elapsed_s=elapsed, dropped=dropped + dropped_evals + dropped_events,
                     mark=mark)


def _abandon(path: Path, version: int, number: int) -> tuple[str, list[str]]:
    """Move every checkpoint folder of ``path`` past ``version`` (complete or not) to a new
    ``abandoned/resume_<number>`` (``-2``, ... when taken), after removing a ``best`` link
    that names one of them or nothing; returns that folder (relative to ``path``, "" when
    nothing moved) and the names moved."""
    from pipeline_rl.training.checkpoint import step_of

    root = path / "checkpoints"
    later = sorted(d for d in root.glob("step_*") if (step_of(d.name) or 0) > version) if root.is_dir() else []
    if not later:
        return "", []
    best = root / "best"
    if best.is_symlink() and (not best.exists() or Path(os.readlink(best)).name in {d.name for d in later}):
        best.unlink()
    dest, n = path / ABANDONED / f"resume_{number}", 1
    while dest.exists():
        n += 1
        dest = path / ABANDONED / f"resume_{number}-{n}"
    dest.mkdir(parents=True)
    for d in later:
        d.rename(dest / d.name)   # the same file system: nothing is copied, nothing lost
    return str(dest.relative_to(path)), [d.name for d in later]


def _trim_events(file: Path, version: int) -> int:
    """Drop from a TensorBoard event file what a run resumed at ``version`` redoes (as
    :func:`_continue` does from the JSON records: steps past it, evaluations from it on);
    rewritten only when something goes; the number of events dropped. A record cut short
    by a kill ends the file."""
    from tensorboard.compat.proto.event_pb2 import Event

    raw, kept, seen, pos = file.read_bytes(), [], 0, 0
    while pos + 12 <= len(raw):   # a record: length (8 bytes), its CRC (4), the event, its CRC (4)
        (length,) = struct.unpack_from("<Q", raw, pos)
        end = pos + 12 + length + 4
        if end > len(raw):
            break
        record, seen = raw[pos:end], seen + 1
        event = Event.FromString(record[12:12 + length])
        is_eval = any(v.tag.startswith("eval/") for v in event.summary.value)
        if not event.HasField("summary") or event.step < version or (event.step == version and not is_eval):
            kept.append(record)
        pos = end
    if len(kept) < seen or pos != len(raw):
        tmp = file.with_name(file.name + ".tmp")
        tmp.write_bytes(b"".join(kept))
        tmp.replace(file)
    return seen - len(kept)


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


def restart_in(path: Path) -> tuple[RunFolder, str | None]:
    """The run in ``path`` started again in the same process (``run_life``, its next life):
    what a killed save left is tidied, the newest complete checkpoint (None: none yet, the run
    starts over) resumes as ``--resume`` would, with its records trimmed and the restart
    marked. Returns the folder and the checkpoint."""
    from pipeline_rl.training.checkpoint import latest_checkpoint, read_run_state, recover_checkpoints

    root = path / "checkpoints"
    if root.is_dir():
        for done in recover_checkpoints(root):
            log.warning("restart: a checkpoint save was interrupted: %s", done)
    latest = latest_checkpoint(root) if root.is_dir() else None
    version = read_run_state(latest).version if latest is not None else 0
    folder = replace(_continue(path, version, str(latest or "(the start)")), start_version=version)
    if folder.mark is not None and folder.mark.abandoned:   # none past the newest, unless unreadable
        log.warning("restart: %d later checkpoint(s) moved to %s", len(folder.mark.abandoned),
                    path / folder.mark.abandoned_to)
    _mark(folder)
    return folder, None if latest is None else str(latest)
