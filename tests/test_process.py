"""Actor process helpers: the C-heap trimmer the rollout worker calls between engine steps,
the garbage collector's start-up policy, pinning a process to its core, and keeping one off
the rollout workers' cores."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys

import pytest

from pipeline_rl.heap import HeapTrimmer
from pipeline_rl.actors.process import end_of_startup

_PIN = """
import json, os, threading
from pipeline_rl.actors.process import pin_to_core
from pipeline_rl.resources import CoreSlot

def affinities():
    return sorted({tuple(sorted(os.sched_getaffinity(int(t)))) for t in os.listdir("/proc/self/task")})

n = len(os.sched_getaffinity(0))
hold = threading.Event()
before = threading.Thread(target=hold.wait); before.start()   # a thread started before pinning
too_many = pin_to_core(CoreSlot(0, n + 1))
unchanged = affinities()
cpu = pin_to_core(CoreSlot(n - 1, n))
after = threading.Thread(target=hold.wait); after.start()     # and one started after
print(json.dumps({"too_many": too_many, "unchanged": unchanged, "cpu": cpu, "pinned": affinities()}))
hold.set()
"""

_KEEP_OFF = """
import json, os, threading
from pipeline_rl.actors.process import keep_off, set_affinity
from pipeline_rl.resources import CoreSlot

def affinities():
    return sorted({tuple(sorted(os.sched_getaffinity(int(t)))) for t in os.listdir("/proc/self/task")})

n = len(os.sched_getaffinity(0))
hold = threading.Event()
threading.Thread(target=hold.wait).start()
none = keep_off(())
too_many = keep_off((CoreSlot(0, n + 1),))
everything = keep_off(tuple(CoreSlot(i, n) for i in range(n)))
before = keep_off((CoreSlot(0, n),))
kept = affinities()
set_affinity(before)
print(json.dumps({"none": none, "too_many": too_many, "everything": everything, "before": sorted(before),
                  "kept": kept, "restored": affinities()}))
hold.set()
"""


def test_heap_trimmer_trims_at_most_once_per_interval() -> None:
    calls: list[int] = []
    trimmer = HeapTrimmer(every_s=3600.0)
    trimmer._trim = lambda pad: calls.append(pad) or 1   # record instead of trimming
    for _ in range(5):
        trimmer.maybe_trim()
    assert calls == [0] and trimmer.trims == 1 and trimmer.trim_s >= 0.0


def test_heap_trimmer_releases_freed_memory_on_glibc() -> None:
    """On glibc a real trim runs and returns; elsewhere the trimmer is a no-op."""
    trimmer = HeapTrimmer(every_s=0.0)
    blocks = [bytearray(4096 + i % 7) for i in range(20_000)]
    del blocks[::2]
    trimmer.maybe_trim()
    trimmer.maybe_trim()
    assert trimmer.trims in (0, 2)


def test_heap_trimmer_without_malloc_trim_is_a_no_op() -> None:
    trimmer = HeapTrimmer(every_s=0.0)
    trimmer._trim = None
    trimmer.maybe_trim()
    assert trimmer.trims == 0


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU affinity is Linux-only")
def test_pin_to_core_binds_every_thread_of_the_process_to_its_slot() -> None:
    """Every thread, those started before the call and after it, runs on the slot's CPU
    (the highest one for the last slot); more slots than CPUs pins nothing."""
    allowed = sorted(os.sched_getaffinity(0))
    out = subprocess.run([sys.executable, "-c", _PIN], capture_output=True, text=True, timeout=120, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["too_many"] is None
    assert got["unchanged"] == [allowed]
    assert got["cpu"] == allowed[-1]
    assert got["pinned"] == [[allowed[-1]]]


def test_end_of_startup_freezes_what_start_up_built_and_turns_collection_back_on() -> None:
    was_enabled = gc.isenabled()
    gc.disable()   # as setup_actor_process leaves it
    try:
        end_of_startup()
        assert gc.isenabled()
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        (gc.enable if was_enabled else gc.disable)()


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs CPU affinity and two CPUs")
def test_keep_off_leaves_the_workers_cores_to_them() -> None:
    """Every thread runs on every CPU but the slots' (and the old set comes back); no
    slots, more slots than CPUs, or no CPU left changes nothing."""
    allowed = sorted(os.sched_getaffinity(0))
    out = subprocess.run([sys.executable, "-c", _KEEP_OFF], capture_output=True, text=True, timeout=120,
                         check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["none"] is None and got["too_many"] is None and got["everything"] is None
    assert got["before"] == allowed
    assert got["kept"] == [allowed[1:]]
    assert got["restored"] == [allowed]


_NICE = """
import json, os
from pipeline_rl.actors.process import raise_to_parent_priority
took = raise_to_parent_priority()
print(json.dumps({"took": took, "now": os.getpriority(os.PRIO_PROCESS, 0),
                  "again": raise_to_parent_priority()}))
"""


@pytest.mark.skipif(not hasattr(os, "getpriority"), reason="needs process priorities")
def test_a_pinned_actor_rises_to_its_parents_priority_where_allowed() -> None:
    """A process started 3 steps below its parent (as Ray starts its workers below the
    raylet) rises to the parent's niceness when the system allows it, and else stays
    without an error; once there, nothing changes."""
    parent = os.getpriority(os.PRIO_PROCESS, 0)
    out = subprocess.run([sys.executable, "-c", _NICE], capture_output=True, text=True, timeout=120, check=True,
                         preexec_fn=lambda: os.nice(3))
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["again"] is None
    if got["took"] is None:   # not allowed to rise (no privilege): it stayed
        assert got["now"] == parent + 3
    else:
        assert got["took"] == parent and got["now"] == parent


_IDLE = """
import json, os, threading
from pipeline_rl.actors.process import IDLE_NICENESS, lower_to_idle_priority, restore_priority
start = os.getpriority(os.PRIO_PROCESS, 0)
before = lower_to_idle_priority()
seen = []
t = threading.Thread(target=lambda: seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
t.start(); t.join()
low = os.getpriority(os.PRIO_PROCESS, 0)
restore_priority(before)
print(json.dumps({"start": start, "before": before, "low": low, "thread": seen[0], "idle": IDLE_NICENESS,
                  "back": os.getpriority(os.PRIO_PROCESS, 0)}))
"""


@pytest.mark.skipif(not hasattr(os, "getpriority"), reason="needs process priorities")
def test_a_standby_builds_at_idle_priority_and_comes_back() -> None:
    """A process built beside the run (a standby, a spare) runs every thread, and those it
    starts later, at niceness 19, and goes back to where it was when it takes its place;
    a process that could not rise again (no privilege) is not lowered at all."""
    out = subprocess.run([sys.executable, "-c", _IDLE], capture_output=True, text=True, timeout=120, check=True,
                         preexec_fn=lambda: os.nice(3))
    got = json.loads(out.stdout.strip().splitlines()[-1])
    if got["before"] is None:   # not allowed to rise again: never lowered
        assert got["low"] == got["start"] == got["back"]
    else:
        assert got["before"] == got["start"]
        assert got["low"] == got["thread"] == got["idle"]
        assert got["back"] == got["start"]
