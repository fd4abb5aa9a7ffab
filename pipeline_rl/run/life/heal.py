"""Healing a run: when a trainer rank or the replay buffer dies (a killed process, an
out-of-memory kill, a Ray actor death) or a weight update fails, the run stops what is left
and starts new actors in the same process, on the same Ray, from its newest complete
checkpoint (``--run.max_restarts``, docs/failures.md). Whether a failure is healed is
:class:`RestartPolicy`'s to say; the lives themselves are run by
:func:`pipeline_rl.run.life.run_life`. What did not fail goes on into the new life
(``run/life/carry.py``): the rollout workers, renewed, unless the failure was theirs (a vLLM
start is the longest part of a restart), and the trainer ranks' spares, adopted.

Invariants: a restart continues the same folder as ``--resume`` would (records past the
checkpoint dropped, the restart marked: no step twice in ``metrics.jsonl``), with the same
configuration, seed and so data order; the steps since that checkpoint are trained again,
so at most one checkpoint interval is lost. Each restart is one console line
(:func:`restart_line`) naming the cause and what is offered to the new life (the rollout
workers to renew, the spare ranks to adopt: whether they could be is the new life's to say,
``run/life/carry.py``). A failure that would only repeat is not retried (an exception inside
an actor, a configuration or start-up error, a reward failing everywhere, the watchdog), nor
the same weight-update failure twice at the same version; ``max_restarts`` restarts in a row
without a step in between end the run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pipeline_rl.run.life.run_folder import RunFolder
from pipeline_rl.run.life.supervise import OrchestratorError

if TYPE_CHECKING:
    from pipeline_rl.run.life.carry import Carried


@dataclass(slots=True)
class RestartPolicy:
    """Whether a failure restarts the run (see the module docstring). ``streak``: restarts
    in a row not followed by a step."""

    max_restarts: int
    restarts: int = 0
    streak: int = 0
    seen: set[str] = field(default_factory=set)

    def refusal(self, e: OrchestratorError, stepped: bool) -> str | None:
        """None when ``e`` restarts the run (counted); else why not, as the run's last line
        (``e``'s own message when the failure is not one a restart heals)."""
        if not e.restartable or not self.max_restarts:
            return str(e)
        if e.repeat_key is not None and e.repeat_key in self.seen:
            return f"{e} (the same failure twice: not restarted again)"
        self.streak = 0 if stepped else self.streak
        if self.streak >= self.max_restarts:
            return (f"{e} ({self.streak} restart(s) in a row without a step in between, "
                    f"--run.max_restarts={self.max_restarts})")
        if e.repeat_key is not None:
            self.seen.add(e.repeat_key)
        self.restarts += 1
        self.streak += 1
        return None


def restarts_before(folder: RunFolder) -> int:
    """The restarts a resumed run had made up to where it resumes (its last kept row's)."""
    from pipeline_rl.metrics import read_metrics

    file = folder.path / "metrics.jsonl"
    if folder.resumed_at is None or not file.exists():
        return 0
    rows = read_metrics(file)
    return int(rows[-1].get("restarts", 0)) if rows else 0


def fault_left(fault: str | None, reached: int) -> bool:
    """Whether an injected fault (``POINT@VERSION``) goes on into the run's next life, the
    failed one having reached version ``reached``: until a life reaches its version (where it
    fires), so a fault fires once; one at version 0 fires at every start."""
    if fault is None:
        return False
    at = int(fault.partition("@")[2] or 0)
    return at == 0 or reached < at


def restart_line(restarts: int, cause: str, stopped_in_s: float | None, carried: Carried,
                 checkpoint: str | None) -> str:
    """The console line of the run's ``restarts``-th restart: its cause, how long the failed
    life's actors took to stop and what it offers the next (``carried``), where it starts from."""
    where = f"from {checkpoint}" if checkpoint else "from the start (no checkpoint was saved yet)"
    offered = "".join(f", {len(x)} {what}" for x, what in ((carried.workers, "rollout worker(s) to renew"),
                                                            (carried.spares, "spare trainer rank(s) to adopt"))
                      if x)
    stopped = f" (its actors stopped in {stopped_in_s:.1f} s{offered})" if stopped_in_s is not None else ""
    return f"async_grpo.py: restart {restarts}: {cause}{stopped}; starting again {where}"
