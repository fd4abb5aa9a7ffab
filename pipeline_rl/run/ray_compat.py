"""The one module that reads Ray's internals, each read where Ray has no public API for
it, with a fallback when the internal is missing or changed (another Ray release). Nothing
here (nor anywhere in the package) assigns to anything of Ray's; ``tests/test_ray_public.py``
audits that, and that no other module imports ``ray._private`` or ``ray._raylet``.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


def actor_table() -> list[dict[str, Any]]:
    """Every actor the GCS knows of, as Ray's own global state returns it (``ActorID``,
    ``JobID``, ``State``, ``Pid``, ``ActorClassName``, ...), for the soak benchmark. Ray's
    public state API (``ray.util.state.list_actors``) asks the dashboard over HTTP, and a
    run's own Ray starts without it (``include_dashboard=False``: the call then fails with
    ``ServerUnavailable``); the GCS's table is read through ``ray._private.state``.
    Fallback: the public state API, then nothing (the caller samples fewer processes)."""
    try:
        from ray._private import state

        return list(state.actors(job_id=None).values())
    except Exception as e:  # noqa: BLE001 - another Ray: try the public API
        log.debug("Ray's actor table unavailable (%s: %s)", type(e).__name__, e)
    try:
        from ray.util.state import list_actors

        return [{"ActorID": a.actor_id, "JobID": a.job_id, "State": a.state, "Pid": a.pid,
                 "ActorClassName": a.class_name} for a in list_actors(limit=10_000)]
    except Exception as e:  # noqa: BLE001 - no API server either
        log.debug("Ray's state API unavailable (%s: %s)", type(e).__name__, e)
        return []
