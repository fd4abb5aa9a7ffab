"""Starting a private local Ray through its public API: :func:`start_local`.

``ray.init(address="local", ...)`` always starts a new single-node Ray for this process,
whatever else runs on the machine: a cluster from ``ray start`` (live, or a stale record
of one in Ray's temporary folder) is never joined by accident, and ``num_cpus`` is always
accepted. Ray starts its own processes as it always does (GCS, raylet, its agents, the
dashboard's API server, the autoscaler's monitor), so ``ray status``, ``ray list`` and the
state API work against the run's Ray.

The actors' environment (:data:`pipeline_rl.runtime_env.ACTOR_ENV`) reaches them by
inheritance: it is set in this process while Ray starts (restored on return), so every
process Ray starts has it. A job ``runtime_env`` would do the same on paper, but with
one Ray cannot hand its pre-started worker processes to the actors: it starts new ones
after asking its runtime-env agent (three actors took 1.1 s to answer instead of 0.35 s).

Nothing of Ray's is patched or replaced here; ``tests/test_ray_public.py`` audits the
package for that.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from typing import Any


@contextlib.contextmanager
def environment(env: Mapping[str, str]) -> Iterator[None]:
    """``env`` in this process's environment within the block (previous values restored)."""
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def start_local(*, num_cpus: int, object_store_mb: int, env: Mapping[str, str], logging_level: int,
                log_to_driver: bool = True) -> Any:
    """Start a private single-node Ray for this process (never another cluster, see the
    module docstring); returns ``ray.init``'s context.

    ``env``: environment variables of every process Ray starts (the actors'), inherited
    from this process at start; this process's own environment is as before on return.
    ``log_to_driver``: the workers' output reaches this process's console."""
    import ray

    with environment(env):
        return ray.init(address="local", num_cpus=num_cpus, include_dashboard=False,   # the web UI needs ray[default]
                        object_store_memory=object_store_mb * 2**20, log_to_driver=log_to_driver,
                        logging_level=logging_level)
