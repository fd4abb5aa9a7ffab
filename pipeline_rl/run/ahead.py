"""What the driver imports ahead of need, on a thread, while it would otherwise only wait.

The metrics' TensorBoard writer (0.14 s of a core) and the types a step report unpickles
into were first imported between the workers' readiness and the first step's submission,
where every moment is on the run's critical path; :data:`TRAINING` is imported while the
actors start instead, when the driver only waits for them.

Not done for Ray's start: what Ray's first remote call imports (``numpy``, ``pyarrow`` and
pydantic's v1 models, for its serialization context) took the driver 0.2 s before it could
create the rollout worker, but ``ray.init`` keeps the interpreter busy while it waits, so a
thread importing them beside it only delayed its line by as much (8 alternated commands:
first step 7.68 s with the thread against 7.67 s without).

Invariants: nothing here imports torch, vLLM or DeepSpeed (tested); an import that fails
is left to fail again, with its own error, where it is really used; the driver joins the
thread before it uses these modules (``run.life.start.start_actors`` ends with the join).
"""

from __future__ import annotations

import importlib
import logging
import threading
from collections.abc import Sequence

log = logging.getLogger(__name__)

#: Imported while the actors start: what the driver needs once training begins.
TRAINING = ("tensorboard.summary.writer.event_file_writer", "pipeline_rl.reports", "pipeline_rl.buffer.types")


def import_ahead(modules: Sequence[str]) -> threading.Thread:
    """Import ``modules`` on a daemon thread; the caller joins it before it imports any of
    them itself (two threads importing the same packages at once can deadlock on a
    circular import inside them, which Python then raises in one of the threads)."""

    def load() -> None:
        for name in modules:
            try:
                importlib.import_module(name)
            except Exception:   # e.g. not installed: the user's own import will say so
                log.debug("import ahead: %s failed", name, exc_info=True)

    thread = threading.Thread(target=load, name="pipeline_rl-import-ahead", daemon=True)
    thread.start()
    return thread
