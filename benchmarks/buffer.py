"""Transport benchmark: sustained groups/s and MB/s from 1 and 4 producer
processes into one ReplayBuffer over ZeroMQ, against the ceiling of the same
payload through a bare ZeroMQ PUSH/PULL link (no codec, no buffer).

Each buffer producer is a spawned process with a ``GroupSender`` that encodes
every group (8 completions x 256 tokens by default); the receiver thread
decodes and validates each message and a consumer thread takes batches with
``get_batch`` -- the real path end to end. The bare link sends the pre-encoded
bytes of the same group and only counts frames. The clock runs from the moment
all producers are connected until the consumer holds the last group.

    python -m benchmarks.buffer --json runs/bench/buffer.json
    python -m benchmarks.buffer --quick          # a few hundred groups, seconds
    python -m benchmarks.buffer --keys           # also with the run key, back to back
    python -m benchmarks.buffer --keys --curve   # the keyed runs with CURVE (the cluster path)

With ``--keys`` each round also runs the buffer with a run key (``pipeline_rl.run_key``)
right after the plain buffer runs, and reports keyed / plain groups/s from the same
round. The buffer binds loopback here, so the keyed runs authenticate producers with
PLAIN (a password derived from the run key, checked once per connection: the default
run's path); ``--curve`` forces CURVE instead (every message encrypted and
authenticated: the path of a buffer bound to a node's network address).

Timings on a shared 2-core machine are noisy: compare figures from one run. The buffer's
path is CPU-bound there (producers, both ZeroMQ I/O threads, the receiver and the consumer
share the cores), so other work on the machine lowers its figure; the report gives the
cores other processes used during each round (``other_cores``, from /proc/stat).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from multiprocessing.process import BaseProcess
from multiprocessing.synchronize import Barrier

import zmq

from benchmarks.common import Outcome, main as bench_main
from benchmarks.synthetic import SyntheticGroups
from pipeline_rl.buffer import BufferServer, GroupSender, ReplayBuffer
from pipeline_rl.buffer.auth import Mechanism
from pipeline_rl.buffer.sender import DEFAULT_SNDHWM
from pipeline_rl.run_key import RunKey
from pipeline_rl.wire import encode_group

_BATCH = 32


@dataclass(frozen=True)
class RunResult:
    producers: int
    groups: int
    seconds: float
    groups_per_s: float
    mb_per_s: float
    lost: int


@dataclass(frozen=True)
class Report:
    n: int
    tokens: int
    hwm: int
    repeats: int
    message_bytes: int
    groups_per_s_1: float
    groups_per_s_4: float
    mb_per_s_1: float
    mb_per_s_4: float
    bare_zmq_groups_per_s_1: float
    bare_zmq_groups_per_s: float
    bare_zmq_mb_per_s: float
    ratio_to_bare: float
    ratio_to_bare_min: float
    ratio_to_bare_max: float
    lost: int
    other_cores: list[float]  # per round: cores used by other processes on the machine meanwhile
    runs: list[RunResult]
    # --keys: the buffer with the run key (PLAIN, or CURVE with --curve), and keyed / plain from the same round (medians)
    keyed_groups_per_s_1: float | None = None
    keyed_groups_per_s_4: float | None = None
    keys_ratio_1: float | None = None
    keys_ratio_4: float | None = None
    keys_mechanism: str | None = None


def _produce_groups(address: str, worker_id: int, count: int, n: int, tokens: int, hwm: int,
                    barrier: Barrier, key: RunKey | None = None, mechanism: Mechanism | None = None) -> None:
    gen = SyntheticGroups(worker_id, n=n, tokens=tokens)
    groups = [gen.make(worker_id * 10**9 + i) for i in range(count)]
    with GroupSender(address, worker_id, send_timeout_s=60.0, sndhwm=hwm, key=key,
                     mechanism=mechanism) as sender:
        barrier.wait()
        for group in groups:
            sender.send(group)


def _produce_bare(address: str, worker_id: int, count: int, n: int, tokens: int, hwm: int,
                  barrier: Barrier) -> None:
    payload = encode_group(SyntheticGroups(worker_id, n=n, tokens=tokens).make(0))
    ctx = zmq.Context(io_threads=1)
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.connect(address)
    barrier.wait()
    for _ in range(count):
        sock.send(payload)
    sock.close(linger=60_000)
    ctx.term()


def _start(target: Callable[..., None], address: str, producers: int, count: int, n: int,
           tokens: int, hwm: int, barrier: Barrier, key: RunKey | None = None,
           mechanism: Mechanism | None = None) -> list[BaseProcess]:
    ctx = mp.get_context("spawn")
    keyed = (key, mechanism) if key is not None else ()
    procs: list[BaseProcess] = [ctx.Process(target=target, args=(address, w, count, n, tokens, hwm, barrier, *keyed),
                                            daemon=True)
             for w in range(producers)]
    for p in procs:
        p.start()
    return procs


def run_buffer(producers: int, count: int, n: int, tokens: int, hwm: int, key: RunKey | None = None,
               mechanism: Mechanism | None = None) -> RunResult:
    """The buffer's path end to end (``key``: with the run key; ``mechanism``: PLAIN, the
    loopback default, or CURVE)."""
    total = producers * count
    buf = ReplayBuffer(capacity_groups=1024, staleness=1_000_000, groups_per_step=_BATCH)
    server = BufferServer(buf, rcvhwm=hwm, key=key, mechanism=mechanism)
    barrier = mp.get_context("spawn").Barrier(producers + 1)
    procs = _start(_produce_groups, server.address, producers, count, n, tokens, hwm, barrier, key, mechanism)
    received = 0

    def consume() -> None:
        nonlocal received
        while received < total:
            batch = buf.get_batch(min(_BATCH, total - received), 0, timeout_s=30.0)
            if batch is None:
                return
            received += len(batch)

    consumer = threading.Thread(target=consume)
    barrier.wait(timeout=120)
    start = time.perf_counter()
    consumer.start()
    consumer.join()
    seconds = time.perf_counter() - start
    for p in procs:
        p.join(timeout=30)
    stats = buf.stats()
    server.close()
    lost = total - received - sum(stats.evicted.values())
    return RunResult(producers, received, seconds, received / seconds,
                     stats.bytes_in / seconds / 1e6, lost)


def run_bare(producers: int, count: int, n: int, tokens: int, hwm: int) -> RunResult:
    total = producers * count
    ctx = zmq.Context(io_threads=1)
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.RCVHWM, hwm)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    barrier = mp.get_context("spawn").Barrier(producers + 1)
    procs = _start(_produce_bare, f"tcp://127.0.0.1:{port}", producers, count, n, tokens, hwm, barrier)
    barrier.wait(timeout=120)
    start = time.perf_counter()
    nbytes = received = 0
    while received < total and sock.poll(30_000):
        nbytes += len(sock.recv(copy=False))
        received += 1
    seconds = time.perf_counter() - start
    for p in procs:
        p.join(timeout=30)
    sock.close(0)
    ctx.term()
    return RunResult(producers, received, seconds, received / seconds, nbytes / seconds / 1e6,
                     total - received)


def _cpu_clock() -> tuple[float, float, float]:
    """Wall seconds; CPU seconds the machine has run (all but idle and I/O wait, from
    /proc/stat; 0 where there is none); CPU seconds of this process and its reaped children."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:9]]
        busy = (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")
    except OSError:
        busy = 0.0
    own = sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
              for f in ("ru_utime", "ru_stime"))
    return time.perf_counter(), busy, own


def _round(total: int, shape: tuple[int, int, int], keys: Mechanism | None,
           index: int = 0) -> tuple[tuple[RunResult, ...], float]:
    """The four runs of one round (six with ``keys``), and the cores other processes used
    meanwhile. Results in the order plain 1 and 4, bare 1 and 4, keyed 1 and 4; with
    ``keys`` each keyed run is run right beside its plain one, first in odd rounds and
    second in even ones, so drift in the machine's load weighs on both alike."""
    wall, busy, own = _cpu_clock()
    key = RunKey.new()
    plain: list[RunResult] = []
    keyed: list[RunResult] = []
    for producers in (1, 4):
        order = (False, True) if index % 2 == 0 or keys is None else (True, False)
        for with_key in order:
            if with_key and keys is not None:
                keyed.append(run_buffer(producers, total // producers, *shape, key=key, mechanism=keys))
            elif not with_key:
                plain.append(run_buffer(producers, total // producers, *shape))
    runs = (*plain, run_bare(1, total, *shape), run_bare(4, total // 4, *shape), *keyed)
    wall2, busy2, own2 = _cpu_clock()
    return runs, max(0.0, (busy2 - busy) - (own2 - own)) / (wall2 - wall)


def _median_run(runs: list[RunResult]) -> RunResult:
    return sorted(runs, key=lambda r: r.groups_per_s)[len(runs) // 2]


def flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--groups", type=int, default=20_000, help="groups per run (split over producers)")
    p.add_argument("--n", type=int, default=8, help="completions per group")
    p.add_argument("--tokens", type=int, default=256, help="tokens per completion")
    p.add_argument("--hwm", type=int, default=DEFAULT_SNDHWM,
                   help="ZeroMQ high-water mark (messages) on both ends, buffer and bare runs")
    p.add_argument("--repeats", type=int, default=5,
                   help="rounds of the four runs; figures are medians, the ratio is the median "
                        "of the per-round ratios (buffer and bare run back to back)")
    p.add_argument("--keys", action="store_true",
                   help="also run the buffer with a run key in each round (PLAIN: loopback, the default "
                        "run's path) and report keyed / plain")
    p.add_argument("--curve", action="store_true",
                   help="with --keys: the keyed runs use CURVE (a buffer on a network address)")


def run(args: argparse.Namespace) -> Outcome:
    total, repeats = (400, 1) if args.quick else (args.groups, args.repeats)
    shape = (args.n, args.tokens, args.hwm)
    mechanism: Mechanism | None = ("curve" if args.curve else "plain") if args.keys else None
    rounds, other = zip(*(_round(total, shape, mechanism, i) for i in range(repeats)))
    one, four, bare1, bare4 = (_median_run([r[i] for r in rounds]) for i in range(4))
    ratios = sorted(r[1].groups_per_s / r[3].groups_per_s for r in rounds)
    keyed = _keyed(rounds)
    report = Report(
        n=args.n, tokens=args.tokens, hwm=args.hwm, repeats=repeats,
        message_bytes=len(encode_group(SyntheticGroups(0, n=args.n, tokens=args.tokens).make(0))),
        groups_per_s_1=one.groups_per_s, groups_per_s_4=four.groups_per_s,
        mb_per_s_1=one.mb_per_s, mb_per_s_4=four.mb_per_s,
        bare_zmq_groups_per_s_1=bare1.groups_per_s, bare_zmq_groups_per_s=bare4.groups_per_s,
        bare_zmq_mb_per_s=bare4.mb_per_s, ratio_to_bare=ratios[len(ratios) // 2],
        ratio_to_bare_min=ratios[0], ratio_to_bare_max=ratios[-1],
        lost=sum(r.lost for rnd in rounds for i, r in enumerate(rnd) if i not in (2, 3)), other_cores=list(other),
        runs=[r for rnd in rounds for r in rnd], keyed_groups_per_s_1=keyed.get("keyed_groups_per_s_1"),
        keyed_groups_per_s_4=keyed.get("keyed_groups_per_s_4"), keys_ratio_1=keyed.get("keys_ratio_1"),
        keys_ratio_4=keyed.get("keys_ratio_4"), keys_mechanism=mechanism)
    lines = [f"{repeats} round(s), medians:"]
    lines += [f"buffer   {r.producers} producer(s): {r.groups_per_s:9.0f} groups/s {r.mb_per_s:8.1f} MB/s"
              for r in (one, four)]
    lines += [f"bare ZMQ {r.producers} producer(s): {r.groups_per_s:9.0f} groups/s {r.mb_per_s:8.1f} MB/s"
              for r in (bare1, bare4)]
    if args.keys:
        lines += [f"keyed    {p} producer(s): {keyed[f'keyed_groups_per_s_{p}']:9.0f} groups/s (run key, {mechanism}); "
                  f"keyed / plain, same round: median {keyed[f'keys_ratio_{p}']:.2f}" for p in (1, 4)]
    lines += [f"lost: {report.lost}", f"buffer (4 producers) / bare ZMQ (4 producers), same round: median "
              f"{report.ratio_to_bare:.2f} (range {ratios[0]:.2f}-{ratios[-1]:.2f})",
              f"other processes used {sorted(other)[len(other) // 2]:.2f} cores (median; range "
              f"{min(other):.2f}-{max(other):.2f}) of {os.cpu_count()} while it ran"]
    return Outcome(asdict(report), "\n".join(lines))


def _keyed(rounds: tuple[tuple[RunResult, ...], ...]) -> dict[str, float]:
    """The keyed runs' medians and keyed / plain per round (median); empty without ``--keys``."""
    if len(rounds[0]) < 6:
        return {}
    out: dict[str, float] = {}
    for p, plain, keyed in ((1, 0, 4), (4, 1, 5)):
        out[f"keyed_groups_per_s_{p}"] = _median_run([r[keyed] for r in rounds]).groups_per_s
        ratios = sorted(r[keyed].groups_per_s / r[plain].groups_per_s for r in rounds)
        out[f"keys_ratio_{p}"] = ratios[len(ratios) // 2]
    return out


def main(argv: list[str] | None = None) -> int:
    return bench_main("buffer", __doc__, argv, run, flags=flags,
                      quick="a few hundred groups, one round: a smoke run")


if __name__ == "__main__":
    raise SystemExit(main())
