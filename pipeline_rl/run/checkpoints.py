"""The checkpoint policy of a run: every rank saves under ``OUT_DIR/checkpoints/step_N`` (N =
the version it holds) every ``--trainer.checkpoint_every`` steps, every
``--trainer.checkpoint_every_s`` seconds and at the end; every failure message names the
newest complete one to ``--resume`` from, or says there is none yet. Its waits for the ranks'
answers are bounded: any rank's failure is raised as it comes, and a wait ends after
:data:`_NO_PROGRESS_S` with neither an answer nor any checkpoint writing progressing.

``--trainer.keep_checkpoints K`` keeps the newest K complete checkpoints and the best one:
the checkpoint at the step an evaluation was launched after with the highest held-out
greedy accuracy (the earliest of equals), named by the link ``checkpoints/best``; the others
are deleted after each save and each evaluation. The scores of a resumed run's earlier
evaluations are read back from ``eval.jsonl``. Without evaluation there is no best."""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline_rl.config import Config

if TYPE_CHECKING:
    from pipeline_rl.actors.handles import TrainerHandle
    from pipeline_rl.run.remote_calls import Calls

log = logging.getLogger("pipeline_rl.run.checkpoints")

#: The bound on the driver's checkpoint calls (a save; the end of a run's wait for the writes):
#: no answer from a trainer rank and no change under ``checkpoints/*.partial`` for so long. A
#: rank raises its own failed or stalled write well before (30 s without progress,
#: ``training.checkpoint_progress``); a slow write that progresses never reaches it.
_NO_PROGRESS_S = 120.0
_SAY_AFTER_S = 5.0   # a longer wait says what it waits for, in one console line
_POLL_S = 0.5


class CheckpointPolicy:
    """When and where a run checkpoints (see the module docstring)."""

    def __init__(self, cfg: Config, out: Path) -> None:
        self._every, self._every_s = cfg.trainer.checkpoint_every, cfg.trainer.checkpoint_every_s
        self.folder = out / "checkpoints"
        self._last_t = time.monotonic()
        self._keep = cfg.trainer.keep_checkpoints
        self._scores: dict[int, float] = {}   # step -> held-out greedy accuracy
        if self._keep and (out / "eval.jsonl").exists():
            from pipeline_rl.metrics import read_evals

            self._scores = {e.step: e.greedy_accuracy for e in read_evals(out / "eval.jsonl")}

    def due(self, version: int) -> bool:
        """A periodic checkpoint is due after the step that reached ``version``."""
        return bool((self._every and version % self._every == 0)
                    or (self._every_s and time.monotonic() - self._last_t >= self._every_s))

    def restart_clock(self) -> None:
        self._last_t = time.monotonic()

    def save(self, trainers: Sequence[TrainerHandle], version: int, calls: Calls) -> Path:
        """Every rank copies its part of ``step_<version>`` and writes it in the background
        (``training.checkpoint_writer``); raises the first failed call's error, whichever
        rank's, a failed earlier write's among them (:meth:`_answers`: bounded)."""
        from pipeline_rl.training.checkpoint import checkpoint_name

        path = self.folder / checkpoint_name(version)
        start = time.monotonic()
        self._answers([t.save_checkpoint.remote(str(path)) for t in trainers], calls, f"checkpoint {path.name}")
        self.restart_clock()
        log.info("checkpoint %s: state copied in %.2f s, written in the background", path.name,
                 time.monotonic() - start)
        self.tidy()
        return path

    def written(self, trainers: Sequence[TrainerHandle], calls: Calls) -> None:
        """Wait until every rank has written its checkpoints (the last one is then complete),
        as long as the writing progresses (:meth:`_answers`)."""
        start = time.monotonic()
        self._answers([t.wait_for_checkpoints.remote() for t in trainers], calls, "the last checkpoint")
        log.info("checkpoints written (waited %.2f s)", time.monotonic() - start)
        self.tidy()

    def _answers(self, refs: list[object], calls: Calls, what: str) -> None:
        """Wait for every rank's answer to a checkpoint call (``refs``, by rank), all at once:
        the first failure is raised as it comes, whichever rank's. Past :data:`_SAY_AFTER_S`
        one console line says what it waits for; :class:`NoAnswer` after
        :data:`_NO_PROGRESS_S` without an answer or a change under ``*.partial``."""
        from pipeline_rl.run.remote_calls import NoAnswer
        from pipeline_rl.training.checkpoint_progress import SAMPLE_S, Progress, fingerprint

        progress = Progress(lambda: [(p.name, fingerprint(p)) for p in sorted(self.folder.glob("*.partial"))],
                            min(SAMPLE_S, _NO_PROGRESS_S / 4))
        start, said, pending = time.monotonic(), False, list(refs)
        while pending:
            late = calls.pending(pending, _POLL_S)
            for ref in (r for r in pending if r not in late):
                calls.get(ref)   # raises the rank's failure
            pending = late
            ranks = ", ".join(str(i) for i, r in enumerate(refs) if r in pending)
            if pending and not said and time.monotonic() - start > _SAY_AFTER_S:
                said = True
                writing = ", ".join(p.name for p in sorted(self.folder.glob("*.partial"))) or "nothing"
                log.info("%s: waiting for trainer rank(s) %s (being written: %s; the wait goes on "
                         "while the writing progresses)", what, ranks, writing)
            if pending and progress.idle_s() > _NO_PROGRESS_S:
                raise NoAnswer(TimeoutError(f"{what}: no answer from trainer rank(s) {ranks} and no checkpoint "
                                            f"writing progressed for {_NO_PROGRESS_S:.0f} s"))

    def evaluated(self, step: int, greedy_accuracy: float) -> None:
        """An evaluation launched after ``step`` scored ``greedy_accuracy``."""
        self._scores[step] = greedy_accuracy
        self.tidy()

    def tidy(self) -> list[Path]:
        """Point ``best`` at the best scored checkpoint and delete what ``keep_checkpoints``
        does not keep (nothing when it is 0); returns the deleted folders."""
        if not self._keep or not self.folder.is_dir():
            return []
        from pipeline_rl.training.checkpoint import RUN_STATE_FILE

        saved = sorted((int(d.name.removeprefix("step_")), d) for d in self.folder.glob("step_*")
                       if d.name.removeprefix("step_").isdigit() and (d / RUN_STATE_FILE).is_file())
        scored = [(self._scores[v], -v, d) for v, d in saved if v in self._scores]
        best = max(scored)[2] if scored else None
        if best is not None:
            link = self.folder / "best"
            tmp = self.folder / f".best-{os.getpid()}"
            tmp.unlink(missing_ok=True)
            tmp.symlink_to(best.name)
            tmp.replace(link)   # atomic: readers see the old target or the new one
        keep = {d for _, d in saved[-self._keep:]} | ({best} if best is not None else set())
        gone = [d for _, d in saved if d not in keep]
        for d in gone:
            shutil.rmtree(d, ignore_errors=True)
        return gone

    def resume_hint(self, message: str) -> str:
        """``message`` plus where to resume from: the newest complete checkpoint, or none."""
        from pipeline_rl.training.checkpoint import latest_checkpoint

        latest = latest_checkpoint(self.folder)
        if latest is None:
            return f"{message}; no checkpoint was saved yet"
        return f"{message}; resume with --resume {latest}"
