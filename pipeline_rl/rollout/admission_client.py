"""A rollout worker's share of the global admission budget (docs/design.md section 2): its
one request in flight, the groups granted and not yet started, and the version they need.

Invariants: at most one request is in flight, and asking never blocks the caller (the
buffer holds a request until the budget has room or the hold passed; the answer is taken
at a later poll); grants are held until started (:meth:`Grants.start_one`) or given back
(:meth:`Grants.release_unstarted`); ``min_version`` is the bound of the grants held.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import TYPE_CHECKING

from pipeline_rl.rollout.ports import AdmissionSource

if TYPE_CHECKING:
    from pipeline_rl.buffer.types import Admission

log = logging.getLogger(__name__)


class Grants:
    """Worker ``worker_id``'s grants from ``admission``, each request held up to ``hold_s``."""

    def __init__(self, admission: AdmissionSource, worker_id: int, hold_s: float) -> None:
        self._admission, self._worker_id, self._hold_s = admission, worker_id, hold_s
        self.granted = 0       # groups granted and not started yet
        self.min_version = 0   # the weights' version those groups need
        self._asking: Future[Admission] | None = None

    @property
    def asking(self) -> bool:
        """Whether a request is in flight."""
        return self._asking is not None

    def ask(self, groups: int) -> None:
        """Ask for up to ``groups`` more (nothing when a request is in flight or ``groups`` < 1)."""
        if groups > 0 and self._asking is None:
            self._asking = self._admission.request(self._worker_id, groups, self._hold_s)

    def poll(self, wait_s: float) -> None:
        """Take the answer to the request in flight if it comes within ``wait_s``. Raises the
        request's error (the buffer is gone)."""
        if self._asking is None:
            return
        try:
            adm = self._asking.result(timeout=wait_s)
        except TimeoutError:
            return
        self._asking = None
        self._take(adm)

    def startable(self, version: int) -> bool:
        """Whether a granted group may start under weights of ``version``."""
        return self.granted > 0 and version >= self.min_version

    def start_one(self) -> None:
        self.granted -= 1

    def release_unstarted(self, answer_wait_s: float) -> None:
        """Grants not turned into groups go back to the global budget (else they would count
        as in flight forever and could stall other workers), those of the answer still in
        flight (waited for up to ``answer_wait_s``) included."""
        if self._asking is not None:
            try:
                self._take(self._asking.result(timeout=answer_wait_s))
            except Exception as e:  # noqa: BLE001 -- a lost answer's grants are refunded as lost
                log.warning("worker %d: admission answer lost at stop: %s", self._worker_id, e)
            self._asking = None
        if self.granted:
            self.give_back(self.granted)
            self.granted = 0

    def give_back(self, count: int) -> None:
        """Return ``count`` grants to the budget (a buffer gone has no budget to take them)."""
        try:
            self._admission.release(self._worker_id, count)
        except Exception as e:  # noqa: BLE001 -- only logged: the worker stops either way
            log.info("worker %d: %d grants not returned: %s", self._worker_id, count, e)

    def _take(self, adm: Admission) -> None:
        # Grants still held keep their own (older, lower) bound satisfied by a
        # higher one; a lower bound may only replace it once none is held.
        self.min_version = adm.min_version if not self.granted else max(self.min_version, adm.min_version)
        self.granted += adm.granted
