"""Starting a local Ray without its whole-second wait.

``ray.init`` of a new local cluster starts the GCS and the raylet, then asks the GCS
for the raylet's node record (``ray._private.services.get_node``). Ray's C++ side of that
call (``GlobalStateAccessor::GetNode``) looks once and, if the raylet has not registered
yet, sleeps a whole second before looking again: a raylet that registers 0.2-0.6 s after
it starts (measured on 2 cores) costs a full second, one that takes 1.1 s costs two.
:func:`prompt_node_wait` polls the GCS's node table every 20 ms first, so the call finds
the record on its first look: ``ray.init`` took 1.6-1.8 s with it against 2.4-3.4 s
without, on the same machine.

It touches only that one private function, for the duration of one ``ray.init``, and
falls back to Ray's own wait on any error (another Ray version, a changed internal).

:data:`FAST_CONNECT` is the same cure for a second wait, inside the raylet: its client
of the object store (and every worker's client of the raylet) connects to a socket that
may come up a few milliseconds late, and Ray retries 10 times 1 s apart. On 2 cores the
raylet lost that whole second in 5 of 8 starts (``ray.init`` 2.5 s, else 1.7 s); with
the same 10 s of patience in 20 ms steps, in none of 8.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

log = logging.getLogger(__name__)

POLL_S = 0.02
#: Ray system settings for a local start (``ray.init(_system_config=...)``): connection
#: retries every 20 ms instead of every second, 500 of them instead of 10.
FAST_CONNECT: dict[str, int] = {"raylet_client_connect_timeout_milliseconds": 20,
                                "raylet_client_num_connect_attempts": 500}
#: Ray's own limit on the raylet's registration (``raylet_start_wait_time_s``).
WAIT_S = 30.0


def _registered(accessor: Any, node_id: str) -> bool:
    return any(n.get("NodeID") == node_id and n.get("Alive") for n in accessor.get_node_table())


def _wait_registered(gcs_address: str, node_id: str) -> None:
    """Return once the GCS lists ``node_id`` alive (or after ``WAIT_S``: Ray's call decides)."""
    from ray._private.services import _get_gcs_client_options
    from ray._private.state import GlobalState

    state = GlobalState()
    state._initialize_global_state(_get_gcs_client_options(gcs_address))
    try:
        accessor = state._connect_and_get_accessor()
        deadline = time.monotonic() + WAIT_S
        while not _registered(accessor, node_id) and time.monotonic() < deadline:
            time.sleep(POLL_S)
    finally:
        state.disconnect()   # its own GCS connection: Ray's call opens another


@contextlib.contextmanager
def prompt_node_wait() -> Iterator[None]:
    """Within the block, ``ray.init`` waits for its raylet in 20 ms polls (see above)."""
    try:
        import ray._private.services as services

        original = services.get_node
    except (ImportError, AttributeError):   # another Ray: its own wait
        yield
        return

    def get_node(gcs_address: str, node_id: str) -> Any:
        try:
            _wait_registered(gcs_address, node_id)
        except Exception as e:  # a changed internal: Ray's own wait still works
            log.debug("prompt node wait unavailable (%s: %s)", type(e).__name__, e)
        return original(gcs_address, node_id)

    services.get_node = get_node
    try:
        yield
    finally:
        services.get_node = original
