"""The checkpoint policy of a run: every rank saves under ``OUT_DIR/checkpoints/step_N`` (N =
the version it holds) every ``--trainer.checkpoint_every`` steps, every
``--trainer.checkpoint_every_s`` seconds and at the end; every failure message names the
newest complete one to ``--resume`` from, or says there is none yet."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline_rl.config import Config

if TYPE_CHECKING:
    from pipeline_rl.actors.handles import TrainerHandle
    from pipeline_rl.run.remote_calls import Calls

log = logging.getLogger("pipeline_rl.run.checkpoints")


class CheckpointPolicy:
    """When and where a run checkpoints (see the module docstring)."""

    def __init__(self, cfg: Config, out: Path) -> None:
        self._every, self._every_s = cfg.trainer.checkpoint_every, cfg.trainer.checkpoint_every_s
        self.folder = out / "checkpoints"
        self._last_t = time.monotonic()

    def due(self, version: int) -> bool:
        """A periodic checkpoint is due after the step that reached ``version``."""
        return bool((self._every and version % self._every == 0)
                    or (self._every_s and time.monotonic() - self._last_t >= self._every_s))

    def restart_clock(self) -> None:
        self._last_t = time.monotonic()

    def save(self, trainers: Sequence[TrainerHandle], version: int, calls: Calls) -> Path:
        """Every rank saves its part of ``step_<version>`` (raises the failed call's error)."""
        from pipeline_rl.training.checkpoint import checkpoint_name

        path = self.folder / checkpoint_name(version)
        refs = [t.save_checkpoint.remote(str(path)) for t in trainers]
        for ref in refs:
            calls.get(ref)
        self.restart_clock()
        log.info("checkpoint saved: %s", path)
        return path

    def resume_hint(self, message: str) -> str:
        """``message`` plus where to resume from: the newest complete checkpoint, or none."""
        from pipeline_rl.training.checkpoint import latest_checkpoint

        latest = latest_checkpoint(self.folder)
        if latest is None:
            return f"{message}; no checkpoint was saved yet"
        return f"{message}; resume with --resume {latest}"
