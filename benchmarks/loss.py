"""Loss benchmark: forward + backward of policy_loss on a [256, 4096] batch, per correction.

Usage: ``python -m benchmarks.loss [--batch 256] [--tokens 4096] [--repeats 21]
[--reference] [--quick] [--json PATH]``. One thread. ``logπ`` is a leaf tensor that
requires grad (the loss alone is timed, not a model). Variants are interleaved
(rotating order each round) and the median of the repeats is reported, because
the machines this runs on are shared and noisy. Overhead = median(c) / median(none) - 1.
With ``--json`` it writes ``{"ms": {name: ms}, "overhead": {name: fraction}, ...}``;
``--reference`` adds the plain-torch path as ``ref:<name>``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.common import Outcome, main as bench_main
from pipeline_rl.config import AlgorithmConfig, CorrectionConfig
from pipeline_rl.correction import CORRECTIONS, PolicyBatch, policy_loss


def make_batch(batch: int, tokens: int, seed: int = 0, device: str = "cpu") -> PolicyBatch:
    """Realistic shape: lengths uniform in [T/4, T], log-probs <= 0, a generator/trainer
    mismatch of std 0.1 with 1% outliers of std 2 (so caps and bands do bite)."""
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(batch, tokens, generator=g).pow(3) * 4.0                  # [B, T]
    noise = torch.randn(batch, tokens, generator=g) * 0.1
    outlier = torch.rand(batch, tokens, generator=g) < 0.01
    noise = torch.where(outlier, torch.randn(batch, tokens, generator=g) * 2.0, noise)
    lengths = torch.randint(tokens // 4, tokens + 1, (batch,), generator=g)
    mask = torch.arange(tokens)[None, :] < lengths[:, None]                      # [B, T] bool
    adv = torch.randn(batch, generator=g)
    dev = torch.device(device)
    behav = (logp + noise).to(dev)
    return PolicyBatch(logp=logp.to(dev).requires_grad_(), behav_logp=behav,
                       mask=mask.to(dev), advantages=adv.to(dev))


def _time_once(batch: PolicyBatch, algo: AlgorithmConfig, corr: CorrectionConfig,
               use_fused: bool | None) -> float:
    batch.logp.grad = None
    cuda = batch.logp.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    loss, _ = policy_loss(batch, algo, corr, use_fused=use_fused)
    loss.backward()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def measure(batch: int, tokens: int, repeats: int, reference: bool,
            device: str = "cpu") -> dict[str, dict[str, float]]:
    """Median ms per variant and overhead vs ``none`` (and ``ref:none`` for the reference path)."""
    torch.set_num_threads(1)
    pb = make_batch(batch, tokens, device=device)
    algo = AlgorithmConfig()
    variants: list[tuple[str, CorrectionConfig, bool | None]] = [
        (name, CorrectionConfig(type=name), None) for name in CORRECTIONS]  # type: ignore[arg-type]
    if reference:
        variants += [(f"ref:{name}", corr, False) for name, corr, _ in list(variants)]
    for _, corr, fz in variants:                                   # warm-up (and JIT compile)
        _time_once(pb, algo, corr, fz)
    times: dict[str, list[float]] = {name: [] for name, _, _ in variants}
    for i in range(repeats):
        k = i % len(variants)
        for name, corr, fz in variants[k:] + variants[:k]:         # rotate the order each round
            times[name].append(_time_once(pb, algo, corr, fz))
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    overhead = {name: ms[name] / ms["ref:none" if name.startswith("ref:") else "none"] - 1.0
                for name in ms}
    best = {name: min(t) * 1e3 for name, t in times.items()}
    return {"ms": ms, "overhead": overhead, "min_ms": best}


def flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch", type=int, default=256, help="Sequences (default 256).")
    p.add_argument("--tokens", type=int, default=4096, help="Padded length (default 4096).")
    p.add_argument("--repeats", type=int, default=21, help="Timed rounds (default 21).")
    p.add_argument("--reference", action="store_true", help="Also time the plain-torch path.")
    p.add_argument("--device", default="cpu", help="cpu (default; fused kernel) or cuda "
                   "(reference path).")


def run(args: argparse.Namespace) -> Outcome:
    if args.quick:
        args.batch, args.tokens, args.repeats = 16, 256, 3
    res = measure(args.batch, args.tokens, args.repeats, args.reference, args.device)
    lines = [f"policy_loss fwd+bwd, [{args.batch}, {args.tokens}], reinforce/token, {args.device}, "
             f"one thread, median of {args.repeats}:"]
    lines += [f"  {name:18s} {ms:8.3f} ms  overhead {res['overhead'][name]:+7.1%}  (min {res['min_ms'][name]:.3f} ms)"
              for name, ms in res["ms"].items()]
    return Outcome({**res, "shape": [args.batch, args.tokens], "repeats": args.repeats, "device": args.device},
                   "\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    return bench_main("loss", __doc__, argv, run, flags=flags, quick="Tiny smoke run ([16, 256], 3 rounds).")


if __name__ == "__main__":
    raise SystemExit(main())
