"""Codec benchmark: encode + decode groups/s for groups of 8 completions x 256 tokens.

Decoding validates everything and yields a columnar ``Group`` (what the buffer's
receiver does); the per-completion objects are built lazily, in the trainer
process, and a second figure includes building them.

Usage: ``python -m benchmarks.codec [--seconds 3] [--json PATH]``. One core, one
thread; prints one line and optionally writes ``{"groups_per_s": ...}``. The validator's
machine code is loaded and one pass is run before the clock starts (a receiver does so at
start-up: ``prepare_decoder``). ``cpu_share``: the fraction of a core the thread got
while timed -- below 1 on a busy machine, where groups/s falls with it.

``--keys``: also the codec through a loopback ZeroMQ PUSH/PULL pair in this process, plain
and with the run key, back to back: PLAIN (a password from the run key checked once per
connection: the buffer's link on loopback) and CURVE (each message encrypted and
authenticated: the buffer's link on a network address); reports each and keyed / plain
(``keys_ratio``: PLAIN, ``keys_ratio_curve``: CURVE).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import zmq

from benchmarks.common import Outcome, main as bench_main
from pipeline_rl.buffer.auth import Mechanism, make_client, make_server
from pipeline_rl.run_key import RunKey
from pipeline_rl.samples import Completion, Group
from pipeline_rl.wire import decode_group, encode_group, prepare_decoder


def make_group(group_id: int, n: int = 8, tokens: int = 256, prompt_tokens: int = 32,
               seed: int = 0) -> Group:
    """A realistic group: random token ids, log-probs <= 0, one version switch mid-sequence."""
    rng = np.random.default_rng(seed + group_id)
    comps = []
    for _ in range(n):
        versions = np.full(tokens, 3, dtype=np.int32)
        versions[tokens // 2:] = 4
        comps.append(Completion(
            token_ids=rng.integers(0, 32000, tokens, dtype=np.int32),
            logprobs=-rng.random(tokens, dtype=np.float32),
            versions=versions, reward=float(rng.random()), finish_reason="stop"))
    return Group(group_id, group_id, 0, rng.integers(0, 32000, prompt_tokens, dtype=np.int32),
                 tuple(comps))


def measure(seconds: float, n: int = 8, tokens: int = 256) -> dict[str, float]:
    """Round-trip as many groups as fit in ``seconds``; returns groups/s and bytes per message."""
    groups = [make_group(i, n, tokens) for i in range(64)]
    size = len(encode_group(groups[0]))
    prepare_decoder()
    for g in groups:
        decode_group(encode_group(g))
    done, start, cpu = 0, time.perf_counter(), time.process_time()
    while time.perf_counter() - start < seconds:
        for g in groups:
            decode_group(encode_group(g))
        done += len(groups)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    full, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds / 2:
        for g in groups:
            decode_group(encode_group(g)).completions  # also build the Completion objects
        full += len(groups)
    full_elapsed = time.perf_counter() - start
    return {"groups_per_s": done / elapsed, "message_bytes": float(size),
            "mb_per_s": done * size / elapsed / 1e6, "cpu_share": cpu / elapsed,
            "groups_per_s_materialized": full / full_elapsed}


def measure_link(seconds: float, key: RunKey | None, n: int = 8, tokens: int = 256,
                 mechanism: Mechanism = "plain") -> float:
    """Groups/s of encode -> loopback PUSH/PULL -> decode, one message in flight, in this
    process (``key``: ``mechanism`` on both sockets, with the ZAP handler the buffer uses)."""
    from pipeline_rl.buffer.auth import ZapHandler

    groups = [make_group(i, n, tokens) for i in range(64)]
    prepare_decoder()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context(io_threads=1)
    zap = ZapHandler(ctx, key, lambda _: None, mechanism) if key is not None else None
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    try:
        if key is not None:
            make_server(pull, key, mechanism)
            make_client(push, key, mechanism)
        push.connect(f"tcp://127.0.0.1:{pull.bind_to_random_port('tcp://127.0.0.1')}")
        for g in groups:   # the handshake and a warm pass, off the clock
            push.send(encode_group(g))
            decode_group(pull.recv(copy=False).buffer)
        done, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            for g in groups:
                push.send(encode_group(g))
                decode_group(pull.recv(copy=False).buffer)
            done += len(groups)
        return done / (time.perf_counter() - start)
    finally:
        push.close(0)
        pull.close(0)
        if zap is not None:
            zap.close()
        ctx.term()


def run(args: argparse.Namespace) -> Outcome:
    res = measure(args.seconds)
    if args.keys:
        res["link_groups_per_s"] = measure_link(args.seconds, None)
        res["link_keyed_groups_per_s"] = measure_link(args.seconds, RunKey.new())
        res["link_curve_groups_per_s"] = measure_link(args.seconds, RunKey.new(), mechanism="curve")
        res["keys_ratio"] = res["link_keyed_groups_per_s"] / res["link_groups_per_s"]
        res["keys_ratio_curve"] = res["link_curve_groups_per_s"] / res["link_groups_per_s"]
    keyed = (f"; through a loopback ZeroMQ pair {res['link_groups_per_s']:,.0f} groups/s plain, "
             f"{res['link_keyed_groups_per_s']:,.0f} with the run key (PLAIN): keyed / plain "
             f"{res['keys_ratio']:.2f}; {res['link_curve_groups_per_s']:,.0f} with CURVE: "
             f"{res['keys_ratio_curve']:.2f}" if args.keys else "")
    return Outcome(res, f"codec: {res['groups_per_s']:,.0f} groups/s encode+decode (8 x 256 tokens, "
                   f"{res['message_bytes'] / 1024:.1f} KiB/message, {res['mb_per_s']:.0f} MB/s, one thread "
                   f"with {res['cpu_share']:.2f} of a core); "
                   f"{res['groups_per_s_materialized']:,.0f} groups/s when the trainer-side Completion "
                   "objects are built too" + keyed)


def main(argv: list[str] | None = None) -> int:
    def flags(p: argparse.ArgumentParser) -> None:
        p.add_argument("--seconds", type=float, default=3.0, help="Measuring time (default 3).")
        p.add_argument("--keys", action="store_true",
                       help="Also through a loopback ZeroMQ pair, plain and with the run key (PLAIN and CURVE).")

    return bench_main("codec", __doc__, argv, run, flags=flags)


if __name__ == "__main__":
    raise SystemExit(main())
