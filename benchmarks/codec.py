"""Codec benchmark: encode + decode groups/s for groups of 8 completions x 256 tokens.

Decoding validates everything and yields a columnar ``Group`` (what the buffer's
receiver does); the per-completion objects are built lazily, in the trainer
process, and a second figure includes building them.

Usage: ``python -m benchmarks.codec [--seconds 3] [--json PATH]``. One core, one
thread; prints one line and optionally writes ``{"groups_per_s": ...}``. The validator's
machine code is loaded and one pass is run before the clock starts (a receiver does so at
start-up: ``prepare_decoder``). ``cpu_share``: the fraction of a core the thread got
while timed -- below 1 on a busy machine, where groups/s falls with it.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from benchmarks.common import Outcome, main as bench_main
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


def run(args: argparse.Namespace) -> Outcome:
    res = measure(args.seconds)
    return Outcome(res, f"codec: {res['groups_per_s']:,.0f} groups/s encode+decode (8 x 256 tokens, "
                   f"{res['message_bytes'] / 1024:.1f} KiB/message, {res['mb_per_s']:.0f} MB/s, one thread "
                   f"with {res['cpu_share']:.2f} of a core); "
                   f"{res['groups_per_s_materialized']:,.0f} groups/s when the trainer-side Completion "
                   "objects are built too")


def main(argv: list[str] | None = None) -> int:
    return bench_main("codec", __doc__, argv, run, flags=lambda p: p.add_argument(
        "--seconds", type=float, default=3.0, help="Measuring time (default 3)."))


if __name__ == "__main__":
    raise SystemExit(main())
