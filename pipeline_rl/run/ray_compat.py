"""The one module that reads Ray's internals, each read where Ray has no public API for
it, with a fallback when the internal is missing or changed (another Ray release). Nothing
here (nor anywhere in the package) assigns to anything of Ray's; ``tests/test_ray_public.py``
audits that, and that no other module imports ``ray._private`` or ``ray._raylet``.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


def actor_key(handle: object) -> str:
    """A stable key for an actor handle across calls and pickling (a restarted actor keeps
    it). Ray has no public accessor for an actor's id from its handle (only from inside the
    actor, ``get_runtime_context().get_actor_id()``), so this reads the handle's private
    ``_actor_id``; fallback: the handle object's own identity (a plain object in tests, or
    a Ray without the attribute: keys then hold per handle object, not per actor)."""
    actor_id = getattr(handle, "_actor_id", None)
    hex_id = getattr(actor_id, "hex", None)
    return str(hex_id()) if callable(hex_id) else f"local-{id(handle)}"


def actor_table() -> list[dict[str, Any]]:
    """Every actor the GCS knows of, as Ray's own global state returns it (``ActorID``,
    ``JobID``, ``State``, ``Pid``, ``ActorClassName``, ...). Ray's public state API
    (``ray.util.state.list_actors``) asks the dashboard's API server over HTTP, which a
    benchmark cannot count on; the GCS's table is read through ``ray._private.state``.
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
