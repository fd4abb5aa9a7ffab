"""ReplayBuffer in-process: FIFO, capacity, staleness eviction, the admission
budget on scripted version timelines (staleness 0 = synchronous), several
trainer ranks, statistics."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from pipeline_rl.buffer import ReplayBuffer
from pipeline_rl.buffer.types import ProcessId
from pipeline_rl.samples import Completion, Group


def group(gid: int, version: int | list[int] = 0, worker: int = 0) -> Group:
    """A 2-completion group whose first completion starts at ``version`` (or
    carries the given per-token versions)."""
    versions = np.asarray([version, version] if isinstance(version, int) else version, np.int32)
    comp = Completion(np.arange(versions.size, dtype=np.int32), np.full(versions.size, -0.5, np.float32),
                      versions, 1.0, "stop")
    later = Completion(np.array([1], np.int32), np.array([-0.1], np.float32),
                       np.array([versions.max()], np.int32), 0.0, "length")
    return Group(gid, gid, worker, np.array([1, 2], np.int32), (comp, later))


def ids(groups: list[Group] | None) -> list[int]:
    assert groups is not None
    return [g.group_id for g in groups]


def check_conservation(buf: ReplayBuffer) -> None:
    s = buf.stats()
    assert s.groups_in == s.groups_out + sum(s.evicted.values()) + s.fill + s.held


def test_fifo_and_capacity_blocks_instead_of_dropping() -> None:
    buf = ReplayBuffer(capacity_groups=4, staleness=10, groups_per_step=2)
    for i in range(4):
        assert buf.put(group(i), timeout_s=0)
    t0 = time.monotonic()
    assert not buf.put(group(99), timeout_s=0.2)  # full: waits, then refuses (nothing dropped)
    assert time.monotonic() - t0 >= 0.19
    assert ids(buf.get_batch(2, 0, timeout_s=0)) == [0, 1]
    assert buf.put(group(4), timeout_s=0)
    assert ids(buf.get_batch(3, 0, timeout_s=0)) == [2, 3, 4]
    assert buf.get_batch(1, 0, timeout_s=0) is None  # non-blocking, empty
    s = buf.stats()
    assert (s.groups_in, s.groups_out, s.fill) == (5, 5, 0) and s.full_wait_s >= 0.19
    check_conservation(buf)


def test_blocked_put_resumes_when_consumer_takes() -> None:
    buf = ReplayBuffer(capacity_groups=2, staleness=0, groups_per_step=1)
    buf.put(group(0)), buf.put(group(1))
    done = threading.Event()

    def put_then_signal() -> None:
        buf.put(group(2), timeout_s=5)
        done.set()

    th = threading.Thread(target=put_then_signal)
    th.start()
    assert not done.wait(0.1)
    assert ids(buf.get_batch(1, 0, timeout_s=1)) == [0]
    assert done.wait(2)
    th.join()
    assert ids(buf.get_batch(2, 0, timeout_s=0)) == [1, 2]


def test_blocking_get_batch_waits_for_a_whole_batch_and_times_out_cleanly() -> None:
    buf = ReplayBuffer(capacity_groups=8, staleness=1, groups_per_step=4)
    buf.put(group(0))
    t0 = time.monotonic()
    assert buf.get_batch(3, 0, timeout_s=0.2) is None  # incomplete batch: nothing taken
    assert time.monotonic() - t0 >= 0.19 and len(buf) == 1
    threading.Timer(0.1, lambda: [buf.put(group(i)) for i in (1, 2)]).start()
    assert ids(buf.get_batch(3, 0, timeout_s=5)) == [0, 1, 2]
    assert buf.stats().consumer_wait_s >= 0.25


def test_staleness_eviction_counts_reason_and_never_hands_out_stale() -> None:
    buf = ReplayBuffer(capacity_groups=16, staleness=1, groups_per_step=2)
    # oldest token versions: 0, 3, 1, 2 (tokens of versions 2 and 3), 1 (1 and 2), 3
    versions: list[int | list[int]] = [0, 3, 1, [2, 2, 3], [1, 2], 3]
    for gid, v in enumerate(versions):
        buf.put(group(gid, v))
    batch = buf.get_batch(3, trainer_version=3, timeout_s=0)
    assert ids(batch) == [1, 3, 5]  # lags 3, 2, 2 (ids 0, 2, 4) evicted
    s = buf.stats()
    assert s.evicted == {"stale": 3} and s.lag_histogram == {0: 2, 1: 1} and s.fill == 0
    check_conservation(buf)


def test_eviction_keeps_fresh_groups_when_the_batch_is_incomplete() -> None:
    buf = ReplayBuffer(capacity_groups=8, staleness=0, groups_per_step=2)
    for gid, v in enumerate([0, 1, 0, 1]):
        buf.put(group(gid, v))
    assert buf.get_batch(3, 1, timeout_s=0) is None  # only 2 fresh
    assert buf.stats().evicted == {"stale": 2} and len(buf) == 2
    buf.put(group(4, 1))
    assert ids(buf.get_batch(3, 1, timeout_s=0)) == [1, 3, 4]  # FIFO order kept


def test_admission_budget_formula_and_refunds() -> None:
    k, gps = 1, 3
    buf = ReplayBuffer(capacity_groups=32, staleness=k, groups_per_step=gps)
    assert buf.acquire(0, 4).granted == 4
    a = buf.acquire(1, 4)
    assert (a.granted, a.version) == (2, 0)  # (k + 0 + 1) * 3 = 6 started at most
    assert buf.acquire(2, 4).granted == 0
    buf.put(group(0, worker=0)), buf.put(group(1, worker=0))
    assert buf.acquire(2, 4).granted == 0  # delivery does not free budget; training does
    assert buf.worker_lost(1) == 2  # a dead worker's undelivered grants come back
    assert buf.worker_lost(1) == 0
    assert buf.release(0, 5) == 2  # worker 0 gives back the 2 it will not use
    assert buf.acquire(2, 10).granted == 4
    buf.set_version(1)  # trainer reached version 1: one more step's worth
    assert buf.acquire(2, 10).granted == gps
    s = buf.stats().admission
    assert (s.limit, s.used, s.lost, s.outstanding, s.granted) == (9, 9, 2, 7, 13)
    buf.set_version(0)  # versions are monotone
    assert buf.stats().admission.version == 1


def test_acquire_can_wait_for_budget() -> None:
    buf = ReplayBuffer(capacity_groups=8, staleness=0, groups_per_step=2)
    assert buf.acquire(0, 2).granted == 2
    t0 = time.monotonic()
    assert buf.acquire(1, 2, timeout_s=0.1).granted == 0
    assert time.monotonic() - t0 >= 0.09
    threading.Timer(0.1, buf.set_version, args=(1,)).start()
    a = buf.acquire(1, 5, timeout_s=5)
    assert (a.granted, a.version, a.min_version) == (2, 1, 1)


def test_a_held_request_waits_without_blocking_its_caller() -> None:
    """``request``: answered at once when there is room, else on the future once the
    budget opens (the caller goes on meanwhile)."""
    buf = ReplayBuffer(capacity_groups=8, staleness=0, groups_per_step=2)
    assert buf.request(0, 2, timeout_s=5).result(timeout=0).granted == 2
    held = buf.request(1, 2, timeout_s=5)
    assert not held.done()
    buf.set_version(1)
    a = held.result(timeout=5)
    assert (a.granted, a.min_version) == (2, 1)


def test_a_request_held_for_a_lost_worker_grants_nothing() -> None:
    """The worker died while its request waited: the budget that opens later must not
    go to grants nobody will use (they would hold it forever)."""
    buf = ReplayBuffer(capacity_groups=8, staleness=0, groups_per_step=2)
    assert buf.acquire(0, 2).granted == 2
    held = buf.request(1, 2, timeout_s=5)
    time.sleep(0.05)
    buf.worker_lost(1)
    assert held.result(timeout=5).granted == 0
    buf.set_version(1)
    assert buf.stats().admission.outstanding == 2          # worker 0's, nothing for worker 1
    assert buf.acquire(1, 2).granted == 2                   # the restarted worker is served



def test_a_request_a_dead_process_sent_that_arrives_late_grants_nothing() -> None:
    """A request the dead process (pid 100) sent before it died reaches the buffer only
    after the worker was declared lost: it grants nothing; its successor (pid 200) is served."""
    buf = ReplayBuffer(capacity_groups=8, staleness=0, groups_per_step=2)
    dead = ProcessId("node-a", 100, 5000.0)
    assert buf.acquire(1, 1, requester=dead).granted == 1
    assert buf.worker_lost(1) == 1
    assert buf.acquire(1, 2, requester=ProcessId("node-a", 100, 5000.0)).granted == 0
    assert buf.stats().admission.outstanding == 0
    assert buf.acquire(1, 2, requester=ProcessId("node-a", 200, 7000.0)).granted == 2


@pytest.mark.parametrize("successor", [ProcessId("node-a", 100, 9000.0),    # the pid reused later
                                       ProcessId("node-b", 100, 5000.0)])   # the same pid on another node
def test_a_new_process_with_a_lost_process_pid_is_served(successor: ProcessId) -> None:
    """A process is its node, pid and start time: one declared lost keeps out neither a
    later process that reuses its pid nor a process with its pid on another node."""
    buf = ReplayBuffer(capacity_groups=8, staleness=0, groups_per_step=2)
    assert buf.acquire(1, 1, requester=ProcessId("node-a", 100, 5000.0)).granted == 1
    assert buf.worker_lost(1) == 1
    assert buf.acquire(1, 2, requester=successor).granted == 2


def test_the_ray_admission_names_its_process_by_node_pid_and_start() -> None:
    """What a rollout worker's requests carry: this process's id (a pickled frozen value:
    it crosses the Ray call), built once per process; another process (here the parent)
    has its own start time."""
    import os
    import pickle

    from pipeline_rl.actors.buffer_actor import RayAdmission
    from pipeline_rl.buffer.types import _process_id

    sent: list[object] = []

    class Call:
        def remote(self, *args: object) -> Call:
            sent.append(args[3])
            return self

        def future(self) -> None:
            return None

    admission = RayAdmission.__new__(RayAdmission)
    admission._buffer = type("Handle", (), {"acquire": Call()})()  # type: ignore[assignment]
    admission.request(0, 1)
    me = ProcessId.current()
    stat = Path(f"/proc/{os.getpid()}/stat").read_text().rpartition(")")[2].split()
    assert sent == [me] and me is ProcessId.current() and pickle.loads(pickle.dumps(me)) == me
    assert (me.pid, me.started) == (os.getpid(), float(stat[19])) and me.node
    parent = _process_id(os.getppid())
    assert parent.pid == os.getppid() and parent.node == me.node and parent.started <= me.started
    assert parent != me


def test_evicted_groups_return_their_budget() -> None:
    buf = ReplayBuffer(capacity_groups=8, staleness=0, groups_per_step=2)
    assert buf.acquire(0, 5).granted == 2
    buf.put(group(0, 0)), buf.put(group(1, 0))
    assert buf.get_batch(2, 1, timeout_s=0) is None  # both stale at version 1: evicted
    assert buf.stats().evicted == {"stale": 2}
    a = buf.acquire(0, 5)
    assert (a.granted, a.version, a.min_version) == (4, 1, 1)


def test_unadmitted_and_late_groups_of_a_lost_worker_still_count_as_used() -> None:
    buf = ReplayBuffer(capacity_groups=8, staleness=0, groups_per_step=2)
    assert buf.acquire(3, 2).granted == 2
    assert buf.worker_lost(3) == 2
    buf.put(group(0, worker=3))  # was in flight when the worker was declared lost
    s = buf.stats().admission
    assert (s.unadmitted, s.used, s.lost) == (1, 1, 2)
    assert buf.acquire(4, 5).granted == 1


@dataclass
class SimWorker:
    """A rollout worker on a scripted timeline: it holds weights ``weights``,
    starts every group it is granted once its weights reach ``min_version``,
    and finishes a group ``duration(start index)`` ticks after starting it."""

    worker_id: int
    weights: int = 0
    waiting: list[int] = field(default_factory=list)  # min_version per granted group
    running: list[tuple[int, int]] = field(default_factory=list)  # (finish tick, weights version)


def run_timeline(staleness: int, steps: int, gps: int = 2, workers: int = 3,
                 weight_delay: int = 0, duration: Callable[[int], int] = lambda i: 1,
                 straggler_wait_s: float = 60.0,
                 ) -> tuple[ReplayBuffer, list[list[int]], list[tuple[int, int]]]:
    """Ticks: workers put finished groups, acquire greedily and start what their
    weights allow; the trainer takes a batch when one is there, steps, and its
    weights reach the workers ``weight_delay`` ticks later. Returns the buffer,
    each step's token versions, and (trainer version, weights version) of every start."""
    buf = ReplayBuffer(capacity_groups=64, staleness=staleness, groups_per_step=gps,
                       straggler_wait_s=straggler_wait_s)
    sims = [SimWorker(w) for w in range(workers)]
    version, trained, starts, gid = 0, [], [], 0
    published: list[tuple[int, int]] = []  # (tick visible, version)
    for tick in range(steps * 40):
        for sim in sims:
            sim.weights = max([sim.weights] + [v for t, v in published if t <= tick])
            for _, v in [r for r in sim.running if r[0] <= tick]:
                buf.put(group(gid, v, sim.worker_id))
                gid += 1
            sim.running = [r for r in sim.running if r[0] > tick]
            adm = buf.acquire(sim.worker_id, 4)
            sim.waiting += [adm.min_version] * adm.granted
            ready = [m for m in sim.waiting if m <= sim.weights]
            sim.waiting = [m for m in sim.waiting if m > sim.weights]
            for _ in ready:
                sim.running.append((tick + duration(len(starts)), sim.weights))
                starts.append((version, sim.weights))
        batch = buf.get_batch(gps, version, timeout_s=0)
        if batch is not None:
            trained.append([g.oldest_version for g in batch])
            version += 1
            published.append((tick + weight_delay, version))
            if len(trained) == steps:
                break
    assert len(trained) == steps, "the timeline deadlocked"
    return buf, trained, starts


@pytest.mark.parametrize("weight_delay", [0, 2])
def test_staleness_zero_is_exactly_synchronous(weight_delay: int) -> None:
    buf, trained, starts = run_timeline(staleness=0, steps=12, weight_delay=weight_delay)
    # Every step trains only on groups generated entirely by its own weights ...
    assert trained == [[v, v] for v in range(12)]
    # ... every group was started at the trainer's current version with those weights
    # (no generation runs ahead of training) ...
    assert all(tv == wv for tv, wv in starts)
    # ... and nothing was wasted.
    s = buf.stats()
    assert s.evicted == {} and s.lag_histogram == {0: 24}


@pytest.mark.parametrize("staleness", [1, 3])
def test_positive_staleness_runs_ahead_but_within_the_bound(staleness: int) -> None:
    buf, trained, starts = run_timeline(staleness=staleness, steps=15, weight_delay=1)
    lags = [step - v for step, versions in enumerate(trained) for v in versions]
    assert max(lags) <= staleness and max(lags) > 0  # asynchronous, bounded
    assert max(tv - wv for tv, wv in starts) <= staleness
    assert buf.stats().evicted == {}  # the budget keeps eviction away


def long_tail(i: int) -> int:
    """Generation times with a long tail: most groups take 1 tick, every 7th 6 ticks."""
    return 6 if i % 7 == 3 else 1


@pytest.mark.parametrize("staleness", [1, 2])
def test_stragglers_are_waited_for_so_honest_workers_lose_nothing(staleness: int) -> None:
    buf, trained, _ = run_timeline(staleness=staleness, steps=30, weight_delay=1, duration=long_tail)
    lags = [step - v for step, versions in enumerate(trained) for v in versions]
    assert max(lags) <= staleness
    s = buf.stats()
    assert s.evicted == {} and s.straggler_timeouts == 0
    # The same timeline without the wait: long generations are overtaken and evicted.
    buf, _, _ = run_timeline(staleness=staleness, steps=30, weight_delay=1, duration=long_tail,
                             straggler_wait_s=0.0)
    assert buf.stats().evicted.get("stale", 0) > 0 and buf.stats().straggler_timeouts > 0


def test_a_straggler_is_handed_out_first_at_its_deadline() -> None:
    buf = ReplayBuffer(capacity_groups=16, staleness=1, groups_per_step=2)
    assert buf.acquire(0, 1).granted == 1  # w0's group: deadline 1
    assert buf.acquire(1, 3).granted == 3  # w1's: deadline 1
    buf.put(group(10, 0, 1)), buf.put(group(11, 0, 1))
    assert ids(buf.get_batch(2, 0, timeout_s=0)) == [10, 11]
    buf.put(group(12, 0, 1))
    buf.set_version(1)
    a = buf.acquire(1, 2)
    assert (a.granted, a.min_version) == (2, 1)
    buf.put(group(13, 1, 1)), buf.put(group(14, 1, 1))
    t0 = time.monotonic()
    assert buf.get_batch(2, 1, timeout_s=0.2) is None  # w0's group is due at version 1
    assert time.monotonic() - t0 >= 0.19
    buf.put(group(0, 0, 0))  # it arrives last, and is trained now rather than evicted later
    assert ids(buf.get_batch(2, 1, timeout_s=0)) == [12, 0]
    assert ids(buf.get_batch(2, 2, timeout_s=0)) == [13, 14]
    s = buf.stats()
    assert s.evicted == {} and s.straggler_wait_s >= 0.19 and s.lag_histogram == {0: 2, 1: 4}


@pytest.mark.parametrize("way", ["worker_lost", "release", "timeout", "full"])
def test_the_straggler_wait_ends(way: str) -> None:
    buf = ReplayBuffer(capacity_groups=3 if way == "full" else 8, staleness=0, groups_per_step=2,
                       straggler_wait_s=0.1 if way == "timeout" else 60.0)
    assert buf.acquire(0, 1).granted == 1 and buf.acquire(1, 1).granted == 1
    buf.put(group(10, 0, 1)), buf.put(group(11, 0, 1))  # unadmitted: w1 had one grant
    if way == "full":
        buf.put(group(12, 0, 1))
    elif way == "worker_lost":
        buf.worker_lost(0)
    elif way == "release":
        assert buf.release(0, 5) == 1
    assert ids(buf.get_batch(2, 0, timeout_s=5)) == [10, 11]
    assert buf.stats().straggler_timeouts == (1 if way == "timeout" else 0)


def test_an_arriving_group_fills_its_latest_possible_grant() -> None:
    from pipeline_rl.buffer.grants import grant_of as _grant_of

    assert _grant_of([1, 1, 3, 5], 3) == 2  # a group fresh enough for deadline 3 fills a 3
    assert _grant_of([1, 1, 3, 5], 9) == 3
    assert _grant_of([1, 1, 3, 5], 2) == 1
    assert _grant_of([4, 5], 0) == 0  # older than every grant (it will be evicted): the first


def test_stale_producer_ignoring_min_version_is_evicted_not_trained() -> None:
    buf = ReplayBuffer(capacity_groups=8, staleness=0, groups_per_step=2)
    assert buf.acquire(0, 9).granted == 2
    buf.put(group(0, 0)), buf.put(group(1, 0))
    assert ids(buf.get_batch(2, 0, timeout_s=0)) == [0, 1]
    assert buf.acquire(0, 9).granted == 0  # trainer at 1 but the buffer does not know yet
    buf.set_version(1)
    a = buf.acquire(0, 9)
    assert (a.granted, a.min_version) == (2, 1)
    buf.put(group(2, 0)), buf.put(group(3, 1))  # group 2 used old weights
    assert buf.get_batch(2, 1, timeout_s=0) is None
    assert buf.acquire(0, 9).granted == 1  # its slot came back
    buf.put(group(4, 1))
    assert ids(buf.get_batch(2, 1, timeout_s=0)) == [3, 4]
    assert buf.stats().evicted == {"stale": 1}


def test_several_ranks_get_disjoint_slices_of_one_atomic_step() -> None:
    buf = ReplayBuffer(capacity_groups=16, staleness=5, groups_per_step=6, num_ranks=3)
    results: dict[int, list[int]] = {}

    def rank(r: int) -> None:
        for version in range(2):
            results.setdefault(r, []).extend(ids(buf.get_batch(2, version, timeout_s=10, rank=r)))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for th in threads:
        th.start()
    for gid in range(12):
        buf.put(group(gid))
        time.sleep(0.005)
    for th in threads:
        th.join()
    assert results == {0: [0, 1, 6, 7], 1: [2, 3, 8, 9], 2: [4, 5, 10, 11]}
    assert buf.stats().held == 0
    check_conservation(buf)


def test_rank_slices_wait_for_the_whole_step_and_reject_misuse() -> None:
    buf = ReplayBuffer(capacity_groups=16, staleness=5, groups_per_step=4, num_ranks=2)
    for gid in range(3):
        buf.put(group(gid))
    assert buf.get_batch(2, 0, timeout_s=0, rank=1) is None  # 3 < 4: no rank gets anything
    buf.put(group(3))
    assert ids(buf.get_batch(2, 0, timeout_s=0, rank=1)) == [2, 3]
    assert buf.stats().held == 2
    with pytest.raises(ValueError, match="already took"):
        buf.get_batch(2, 0, timeout_s=0, rank=1)
    with pytest.raises(ValueError, match="asked for 1 groups"):
        buf.get_batch(1, 0, timeout_s=0, rank=0)
    assert ids(buf.get_batch(2, 0, timeout_s=0, rank=0)) == [0, 1]
    with pytest.raises(ValueError, match="rank 2 outside"):
        buf.get_batch(2, 0, rank=2)


def test_close_wakes_every_waiter() -> None:
    buf = ReplayBuffer(capacity_groups=1, staleness=0, groups_per_step=1)
    buf.put(group(0))
    out: list[object] = []
    threads = [threading.Thread(target=lambda: out.append(buf.put(group(1), timeout_s=30))),
               threading.Thread(target=lambda: out.append(buf.get_batch(1, 5, timeout_s=30)))]
    buf.get_batch(1, 0, timeout_s=0)  # empty it, so the getter waits
    buf.put(group(2))
    for th in threads:
        th.start()
    time.sleep(0.05)
    buf.close()
    for th in threads:
        th.join(timeout=2)
        assert not th.is_alive()


@pytest.mark.parametrize("kwargs, match", [
    (dict(capacity_groups=0, staleness=0, groups_per_step=1), "capacity_groups must be >= 1"),
    (dict(capacity_groups=4, staleness=-1, groups_per_step=1), "staleness"),
    (dict(capacity_groups=4, staleness=0, groups_per_step=8), "could never fit"),
    (dict(capacity_groups=8, staleness=0, groups_per_step=3, num_ranks=2), "divide evenly"),
])
def test_bad_construction_is_a_one_line_error(kwargs: dict[str, int], match: str) -> None:
    with pytest.raises(ValueError, match=match) as err:
        ReplayBuffer(**kwargs)
    assert "\n" not in str(err.value)


def test_stats_as_dict_is_flat_scalars() -> None:
    buf = ReplayBuffer(capacity_groups=4, staleness=0, groups_per_step=1)
    buf.put(group(0, 0)), buf.put(group(1, 1))
    buf.get_batch(1, 1, timeout_s=0)
    buf.reject("not_msgpack")
    d = buf.stats().as_dict()
    assert d["evicted/stale"] == 1 and d["rejected/not_msgpack"] == 1 and d["lag/0"] == 1
    assert all(isinstance(v, (int, float)) for v in d.values())


def equal_group(gid: int, reward: float = 1.0, version: int = 0, worker: int = 0) -> Group:
    """A 2-completion group whose rewards are equal (no signal)."""
    comps = tuple(Completion(np.array([1], np.int32), np.array([-0.1], np.float32), np.array([version], np.int32),
                             reward, "stop") for _ in range(2))
    return Group(gid, gid, worker, np.array([1, 2], np.int32), comps)


def test_zero_variance_groups_are_dropped_counted_and_give_their_budget_back() -> None:
    buf = ReplayBuffer(capacity_groups=8, staleness=0, groups_per_step=2, skip_zero_variance=True)
    assert buf.acquire(0, 10).granted == 2          # staleness 0: one step's groups at a time
    assert buf.put(equal_group(0)) and buf.put(group(1))   # the equal one is taken, and dropped
    s = buf.stats()
    assert (s.zero_variance, s.groups_in, s.fill) == (1, 1, 1)
    assert buf.acquire(0, 10).granted == 1          # its slot came back: the step still gets 2 groups
    assert buf.get_batch(2, 0, timeout_s=0) is None  # only one group with signal yet
    assert buf.put(equal_group(2, reward=0.0)) and buf.put(group(3))
    assert ids(buf.get_batch(2, 0, timeout_s=0)) == [1, 3]    # every trained group carries signal
    s = buf.stats()
    assert s.zero_variance == 2 and s.as_dict()["zero_variance"] == 2 and s.admission.outstanding == 0
    check_conservation(buf)                          # dropped groups never entered groups_in


def test_zero_variance_groups_are_kept_by_default() -> None:
    buf = ReplayBuffer(capacity_groups=8, staleness=0, groups_per_step=2)
    assert buf.put(equal_group(0)) and buf.put(group(1))
    assert ids(buf.get_batch(2, 0, timeout_s=0)) == [0, 1]
    assert buf.stats().zero_variance == 0
