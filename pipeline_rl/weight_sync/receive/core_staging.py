"""Staging inside an ``AsyncLLM`` engine core on CPU: the update is loaded into a shadow
of the core's model on a thread of its own while the core keeps stepping, and
``finish_weight_update`` -- called while generation is paused -- only swaps it in.

The same shadow as the in-process engine's (``pipeline_rl.weight_sync.receive.loaders.Shadow``:
a copy of the modules sharing the KV cache, never run; double buffered), driven from
the backend (``pipeline_rl.weight_sync.receive.vllm_backend``): ``update_weights`` with a status cell
(``ShmUpdateInfo.status``) starts the load and returns at once, so the engine core's
busy loop is held only for the call; the worker polls the cell
(``StatusCell``) and pauses only once the load is done. Invariant: the live model is
touched only by :meth:`CoreStager.finish`, while paused, and only with a load that
completed; a failed load leaves the live weights as they were.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from pipeline_rl.weight_sync.receive.loaders import Shadow, make_shadow
from pipeline_rl.weight_sync.message import WeightUpdate, as_checked
from pipeline_rl.weight_sync.channels.shm import StatusCell

log = logging.getLogger(__name__)


class CoreStager:
    """One engine core's shadow and its loading thread (see module docstring)."""

    def __init__(self, model: Any, vllm_config: Any) -> None:
        self._model, self._vllm_config = model, vllm_config
        self._shadow: Shadow | None = None
        self._tried = False
        self._thread: threading.Thread | None = None
        self._ok = False

    def start(self, update: WeightUpdate, status_path: str) -> bool:
        """Begin loading ``update`` into the shadow; False (nothing started, the cell says
        NO_SHADOW) when the model cannot be shadowed: the caller loads it while paused."""
        self.wait()
        cell = StatusCell(status_path, create=False)
        if self._shadow is None and not self._tried:
            self._tried = True
            self._shadow = make_shadow(self._model)
        if self._shadow is None:
            cell.set(update.version, StatusCell.NO_SHADOW)
            return False
        shadow = self._shadow
        self._ok = False

        def load() -> None:
            try:
                shadow.load(as_checked(update), self._vllm_config)
                self._ok = True
                cell.set(update.version, StatusCell.READY)
            except BaseException as e:  # noqa: BLE001 - reported through the cell and the log
                log.error("weights v%d: loading beside generation failed: %s: %s", update.version,
                          type(e).__name__, str(e).splitlines()[0] if str(e) else "")
                cell.set(update.version, StatusCell.FAILED)

        self._thread = threading.Thread(target=load, name="weights-stage", daemon=True)
        self._thread.start()
        return True

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def finish(self) -> bool:
        """While paused: swap the loaded shadow in; False (nothing changed) when the load failed."""
        self.wait()
        if not self._ok or self._shadow is None:
            return False
        self._shadow.swap_into()
        self._ok = False
        return True
