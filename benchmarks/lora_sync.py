"""A LoRA run's weight sync against full weights, part by part, on one machine, in one sitting.

For a model wrapped as the trainer wraps it (``--lora.rank``, all seven projections by
default; ``B`` drawn non-zero, as after training), it reports:

- **bytes per version**: the adapter's update against the full update, in the served dtype
  (float32 on CPU) and in bfloat16 (a GPU's);
- **gather** (the trainer's copy-out, on the critical path): adapter against full, p50;
- **merged serving**: the worker's fold ``W0 + alpha/r B A`` of the weights the adapter
  targets (``weight_sync.receive.lora_update.Merger``; with every other part of a fused layer), then
  their load into a shadow of a vLLM engine's model, as the in-process engine stages it
  (``weight_sync.receive.loaders.Shadow``, the direct path), and the swap of the shadow into the live
  model between two steps (the stall: a partial load swaps only what it changed), p50 each,
  against the same for a full update;
- **native serving**: the adapter replaced in place in a vLLM engine started with LoRA
  (``weight_sync.receive.vllm_adapter.replace_lora``), p50.

- **generation under updates** (``--generate-s``, 0 skips it): the rollout worker's engine
  (``InprocessEngine``, the run's defaults) keeps ``--sequences`` sequences of
  ``--tokens`` tokens in flight (``ignore_eos``: the same work whatever the weights) while
  another thread stages a version every ``--update-every-s`` seconds and the loop applies
  it between steps, as a rollout worker does: generated tokens/s with full-weight updates
  against merged adapter updates, on one core. The policy's own answer lengths, which
  move a run's tokens/s, are held fixed here: what is left is what each serving does to
  generation.

The transfer itself is the shm path's copy of the bytes (``benchmarks.weight_sync`` measures
it per path); here its size is what changes. Usage: ``python -m benchmarks.lora_sync
[--model smollm2-135m-instruct] [--rank 16] [--reps 5] [--generate-s 40] [--update-every-s 12.5]
[--quick]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import Outcome, at_least, hardware, main as bench_main


def _p50(fn: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _model_dir(args: argparse.Namespace) -> str:
    if args.quick:
        from pipeline_rl.models.tiny_llama import build_tiny_model

        out = Path(tempfile.mkdtemp(prefix="lora_sync_"))
        build_tiny_model(out, hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128)
        return str(out)
    from pipeline_rl.models.pretrained import is_pretrained_name, pretrained_model_dir

    return str(pretrained_model_dir(args.model)) if is_pretrained_name(args.model) else args.model


def _engine(model_dir: str, rank: int | None) -> Any:
    """An in-process vLLM engine on CPU, float32 (with LoRA when ``rank`` is given)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    lora: dict[str, Any] = {} if rank is None else {
        "enable_lora": True, "max_loras": 1, "max_lora_rank": max(8, 1 << (rank - 1).bit_length())}
    from pipeline_rl.rollout.engines import vllm_compat as compat

    with compat.hidden_from_vllm_kernel_scan("llvmlite.binding.ffi"):
        return LLMEngine.from_engine_args(EngineArgs(
            model=model_dir, dtype="float32", max_model_len=256, max_num_seqs=4, enforce_eager=True,
            kv_cache_memory_bytes=1 << 26, disable_log_stats=True, **lora))


@dataclass(frozen=True, slots=True)
class Generation:
    """One serving's generation under updates: generated tokens/s, the versions applied while
    generating, and the p50 of staging one version (beside generation, in another thread)."""

    tokens_per_s: float
    versions: int
    stage_s_p50: float


def _generation_under_updates(model_dir: str, serving: Any, update: Any, args: argparse.Namespace) -> Generation:
    """Tokens/s of the in-process engine generating fixed-length sequences for ``--generate-s``
    seconds while ``update`` (its tensors, under a new version each time) is staged every
    ``--update-every-s`` seconds from another thread; ``serving``: LoRA serving or None."""
    import threading

    from pipeline_rl.config import RolloutConfig
    from pipeline_rl.rollout.engines.engine import GenRequest, SamplingConfig, engine_config
    from pipeline_rl.rollout.engines.engine_inprocess import InprocessEngine
    from pipeline_rl.weight_sync.message import CheckedUpdate

    engine = InprocessEngine(engine_config(RolloutConfig(), model_dir, lora=serving))
    try:
        sampling = SamplingConfig(max_new_tokens=args.tokens, temperature=1.0, ignore_eos=True)
        prompt = tuple(engine.encode("Tom has 3 apples and buys 4 more. How many apples does he have?"))
        serial = 0

        def top_up() -> None:
            nonlocal serial
            while engine.num_unfinished() < args.sequences:
                engine.add(GenRequest(f"g{serial}", prompt, sampling))
                serial += 1

        stop = threading.Event()
        loads: list[float] = []

        def updates() -> None:
            version = 1
            while not stop.wait(args.update_every_s):
                t0 = time.perf_counter()
                engine.stage(CheckedUpdate(version, update.tensors, update.num_bytes))
                loads.append(time.perf_counter() - t0)
                version += 1

        top_up()
        for _ in range(args.tokens):   # warm: one batch through before the clock starts
            engine.step()
        top_up()
        stager = threading.Thread(target=updates, daemon=True)
        tokens, applied, t0 = 0, 0, time.perf_counter()
        stager.start()
        while time.perf_counter() - t0 < args.generate_s:
            applied += engine.apply_staged() is not None
            tokens += sum(len(f.token_ids) for f in engine.step())
            top_up()
        wall = time.perf_counter() - t0
        stop.set()
        stager.join()
        return Generation(tokens / wall, applied, statistics.median(loads) if loads else 0.0)
    finally:
        engine.close()


def run(args: argparse.Namespace) -> Outcome:
    import torch
    from transformers import AutoModelForCausalLM

    from pipeline_rl.config.lora_config import LoraConfig
    from pipeline_rl.rollout.engines import vllm_compat as compat
    from pipeline_rl.training.lora import adapter_parameters, wrap
    from pipeline_rl.weight_sync.publish.gather import gather_weights
    from pipeline_rl.weight_sync.receive.loaders import make_shadow
    from pipeline_rl.weight_sync.receive.lora_update import LORA_ID, LoraServing, Merger, peft_config_dict
    from pipeline_rl.weight_sync.message import as_checked
    from pipeline_rl.weight_sync.receive.vllm_adapter import replace_lora

    at_least(args, rank=1, reps=1, generate_s=0, update_every_s=0.01, sequences=1, tokens=1)
    if args.quick:
        args.generate_s, args.update_every_s = min(args.generate_s, 2.0), min(args.update_every_s, 0.5)
    torch.set_num_threads(1)
    model_dir = _model_dir(args)
    lora = LoraConfig(rank=args.rank)
    model = wrap(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), lora, model_dir, 0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 1e-3)
    named = adapter_parameters(model)
    targets = tuple(sorted({n.rsplit(".", 3)[-3] for n, _ in named}))
    serving = LoraServing(args.rank, lora.alpha, targets, "merged")
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)   # full fine-tuning's
    full = gather_weights(base, 1, zero_stage=0)
    adapter = gather_weights(model, 1, zero_stage=0, named=named)
    bf16_full = gather_weights(base, 1, zero_stage=0, dtype="bfloat16").num_bytes
    bf16_adapter = gather_weights(model, 1, zero_stage=0, dtype="bfloat16", named=named).num_bytes
    gather_adapter = _p50(lambda: gather_weights(model, 1, zero_stage=0, named=named), args.reps)
    gather_full = _p50(lambda: gather_weights(base, 1, zero_stage=0), args.reps)
    checked = as_checked(adapter)
    merger = Merger(model_dir, serving)
    plain = _engine(model_dir, None)
    shadow = make_shadow(compat.inprocess_model(plain))
    assert shadow is not None
    names = shadow.partial_names(merger.targeted)
    merge_s = _p50(lambda: merger.merge(1, checked.tensors, names), args.reps)
    merged = merger.merge(1, checked.tensors, names)
    vllm_config = plain.vllm_config
    merged_load = _p50(lambda: shadow.load(merged, vllm_config, partial=names is not None), args.reps)
    merged_swap = _p50(shadow.swap_into, max(args.reps, 21))   # the stall: live <-> shadow, between steps
    full_checked = as_checked(full)
    full_load = _p50(lambda: shadow.load(full_checked, vllm_config), args.reps)
    full_swap = _p50(shadow.swap_into, max(args.reps, 21))
    compat.shutdown_inprocess(plain)
    with_lora = _engine(model_dir, args.rank)
    lora_model = compat.inprocess_model(with_lora)
    tensors, config = dict(checked.tensors), peft_config_dict(serving)
    native = _p50(lambda: replace_lora(lora_model, LORA_ID, tensors, config), args.reps)
    generation: dict[str, Generation] = {}
    if args.generate_s > 0:
        generation["full"] = _generation_under_updates(model_dir, None, full_checked, args)
        generation["merged"] = _generation_under_updates(model_dir, serving, checked, args)
    result = {
        "generation": {mode: asdict(g) for mode, g in generation.items()},
        "generation_settings": {"sequences": args.sequences, "tokens": args.tokens,
                                "update_every_s": args.update_every_s, "generate_s": args.generate_s},
        "model": args.model if not args.quick else "tiny", "rank": args.rank, "alpha": lora.alpha,
        "targets": list(targets), "reps": args.reps, "hardware": hardware(),
        "bytes_full": full.num_bytes, "bytes_adapter": adapter.num_bytes,
        "bytes_ratio": adapter.num_bytes / full.num_bytes,
        "bytes_full_bf16": bf16_full, "bytes_adapter_bf16": bf16_adapter,
        "gather_adapter_s": gather_adapter, "gather_full_s": gather_full,
        "merged_merge_s": merge_s, "merged_load_s": merged_load, "merged_bytes": merged.num_bytes,
        "full_load_s": full_load, "merged_swap_s": merged_swap, "full_swap_s": full_swap,
        "native_replace_s": native,
    }
    md = "\n".join([
        f"LoRA weight sync, {result['model']}, rank {args.rank} on {','.join(targets)} "
        f"(p50 of {args.reps}; one core, float32)",
        "",
        "| part | adapter | full weights | ratio |",
        "|---|---|---|---|",
        f"| bytes per version (float32) | {adapter.num_bytes / 1e6:.1f} MB | {full.num_bytes / 1e6:.1f} MB | "
        f"{result['bytes_ratio']:.3f} |",
        f"| bytes per version (bfloat16) | {bf16_adapter / 1e6:.1f} MB | {bf16_full / 1e6:.1f} MB | "
        f"{bf16_adapter / bf16_full:.3f} |",
        f"| trainer's gather | {gather_adapter * 1e3:.1f} ms | {gather_full * 1e3:.1f} ms | "
        f"{gather_adapter / gather_full:.3f} |",
        f"| merged: fold W0 + alpha/r B A (targeted weights, {merged.num_bytes / 1e6:.0f} MB) | "
        f"{merge_s * 1e3:.1f} ms | - | - |",
        f"| merged: load into the engine's shadow / a full update's | {merged_load * 1e3:.1f} ms | "
        f"{full_load * 1e3:.1f} ms | {merged_load / full_load:.3f} |",
        f"| merged: fold and load / a full update's load | {(merge_s + merged_load) * 1e3:.1f} ms | "
        f"{full_load * 1e3:.1f} ms | {(merge_s + merged_load) / full_load:.3f} |",
        f"| merged: the swap between two steps (the stall) / a full update's | {merged_swap * 1e3:.2f} ms | "
        f"{full_swap * 1e3:.2f} ms | {merged_swap / full_swap:.3f} |",
        f"| native: adapter replaced in place | {native * 1e3:.1f} ms | - | - |",
        *_generation_rows(generation, args),
    ])
    return Outcome(result, md)


def _generation_rows(generation: dict[str, Generation], args: argparse.Namespace) -> list[str]:
    if not generation:
        return []
    full, merged = generation["full"], generation["merged"]
    return [f"| generation under updates: tokens/s, merged serving / full weights ({args.sequences} sequences "
            f"of {args.tokens} tokens, a version every {args.update_every_s:g} s, {args.generate_s:g} s) | "
            f"{merged.tokens_per_s:.1f} ({merged.versions} versions) | "
            f"{full.tokens_per_s:.1f} ({full.versions} versions) | "
            f"{merged.tokens_per_s / full.tokens_per_s:.3f} |",
            f"| generation under updates: staging one version beside generation, p50 | "
            f"{merged.stage_s_p50 * 1e3:.0f} ms | {full.stage_s_p50 * 1e3:.0f} ms | "
            f"{merged.stage_s_p50 / max(1e-9, full.stage_s_p50):.3f} |"]


def _flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct", help="A model folder or a named pretrained model.")
    p.add_argument("--rank", type=int, default=16, help="Adapter rank (all seven projections).")
    p.add_argument("--reps", type=int, default=5, help="Repetitions per timed part (p50 reported).")
    p.add_argument("--generate-s", type=float, default=40.0,
                   help="Seconds of generation under updates per serving (0 skips that part; default 40).")
    p.add_argument("--update-every-s", type=float, default=12.5,
                   help="A version staged every this many seconds while generating (default 12.5: the "
                        "LoRA run's median pipeline step on the real model, 2 cores).")
    p.add_argument("--sequences", type=int, default=32, help="Sequences in flight while generating (default 32).")
    p.add_argument("--tokens", type=int, default=32, help="Tokens per generated sequence (default 32).")


def main(argv: list[str] | None = None) -> int:
    return bench_main("lora_sync", __doc__, argv, run, flags=_flags, quick="The tiny built-in-size model "
                      "(a smoke run, what the tests run).")


if __name__ == "__main__":
    raise SystemExit(main())
