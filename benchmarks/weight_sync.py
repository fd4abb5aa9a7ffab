"""Weight-sync benchmark: how long a new policy version takes to reach generation, and
how long generation stops for it, per engine (in-process ``InprocessEngine`` vs ``AsyncLLM``)
and per transport (vLLM's weight-transfer API vs Ray's object store).

Usage::

    python -m benchmarks.weight_sync [--models default,large] [--engines inprocess,async]
        [--transports vllm,object_store] [--workers 1] [--updates 20] [--warmup 5]
        [--interval-s 0.5] [--max-num-seqs 16] [--max-new-tokens 64] [--prompt-len 16]
        [--quick] [--json PATH] [--md PATH]

Set-up (one process run, one cell after the other, never two engines at once):
a local Ray (one CPU per core); per (model, engine, transport) cell ``--workers`` fresh
rollout-worker actors of this module (:class:`SyncWorker`), each owning one engine
(``inprocess``: :class:`~pipeline_rl.rollout.engines.engine_inprocess.InprocessEngine`; ``async``:
:class:`~pipeline_rl.rollout.engines.engine_async.AsyncEngine`, engine core in its own process)
and generating continuously on a thread of its own: ``--max-num-seqs`` sequences in
flight (random-token prompts of ``--prompt-len``, ``--max-new-tokens`` tokens each,
``ignore_eos``; a finished one is replaced at once), ``engine.apply_staged()``
between two steps. The actor takes weights like ``RolloutActor``: the four vLLM
weight-transfer calls, on every path (Ray's object store is one: the worker's receiver
fetches the object), all on one staging thread. The driver is
the "trainer": a plain torch Hugging Face model of the same weights; each "trainer
step" scales every parameter by ``1 +- 1e-3``, copies them out with
``gather_weights(model, version, zero_stage=0)`` and hands the update to a real
``WeightPublisher(workers, path=...)`` (background thread, as in a run).
``--warmup`` + ``--updates`` versions are published ``--interval-s`` apart; the
warm-up ones are left out of the figures (``warmup_latency_ms`` keeps them): the first
opens the vLLM channel (or the async engine's loopback channel), and with the 27 M
model the first few updates after start-up take 0.5-2 s instead of ~0.2 s, a
start-up transient a real run pays once. Seen on both sides (object_store, 1 s
apart): the in-process engine's first two ``stage`` calls (one per buffer of its
double-buffered shadow) took 1.1 s and 0.5 s, then 75-140 ms; the first
``check_update`` (which copies the read-only arrays out of the object store) 380 ms,
then ~40 ms; the driver's first ``gather_weights`` copies 50-350 ms, then ~20 ms --
first-touch of freshly allocated ~100 MB buffers and first-time weight repacking,
while the two cores are shared.

Measured, per cell:

- ``latency_ms``: for each published version ``v``, from the moment
  ``WeightPublisher.publish`` was called with it (``stats().published_at``) until
  the last worker's generation loop got an ``AppliedUpdate`` of ``v`` (or a newer
  version, had ``v`` been superseded) out of ``engine.apply_staged()``; both
  clocks ``time.time()`` on this machine. p50/p90/max over the updates. For the
  async engine the update is already live when ``finish_weight_update`` returns;
  the loop sees it at most one ``step()`` poll (10 ms) later.
- ``stall_ms``: ``AppliedUpdate.stall_s`` of each applied update: the time no engine
  step could run, as each engine measures it (in-process: the shadow-to-live swap
  between two steps; async: from the end of ``pause_generation`` in
  ``start_weight_update`` to ``resume_generation`` in ``finish_weight_update``).
- ``bytes_per_update``; the trainer side's ``gather_ms`` (the copy on the training
  thread) and ``caller_block_ms`` (what ``publish`` blocked it); the publisher's
  per-version ``put_ms`` (object store) / ``offer_ms`` (the whole send) and the send's
  ``start``/``transfer``/
  ``finish`` phases; the worker's time per staging call (``worker_calls_ms``;
  and
  its generation rate while updates arrived (``tokens_per_s``).
- ``latency_p50_vs_object_store``: the cell's latency p50 over the ``object_store``
  cell's of the same model and engine.
- ``versions_complete``: every timed version reached generation (itself or a newer
  one); ``every_version_applied``: each one itself was applied on every worker (none
  superseded on the way: the publisher skips a version that a newer one overtook
  before it was sent, counted in ``publisher.superseded``, and the in-process engine
  drops a staged version a newer one replaces before the loop applied it).

What differs from a real run: the trainer is a plain torch model in the driver
process (no DeepSpeed, no optimizer step, no training compute competing for the
cores: an update is ``gather_weights`` of a slightly perturbed model); there is no
replay buffer, reward or admission budget (the worker only generates); prompts are
random token ids. On this 2-core machine the driver, Ray and the worker (and the
async engine's core process) share the cores, as the trainer and workers of a
2-core run do.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np

from benchmarks.common import ROOT, Outcome, at_least, hardware, main as bench_main, ray_session

RESULTS = ROOT / "benchmarks" / "results"
ENGINES = ("inprocess", "async")
#: ``vllm`` is vLLM's weight-transfer API on the automatic path (``shm`` on one machine);
#: ``shm``/``gloo`` force a path; ``object_store`` is Ray's object store.
TRANSPORTS = ("vllm", "shm", "gloo", "object_store")


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A model of the matrix: ``default`` is the built-in default model (warm-started,
    cached); the others are random-init Llamas of the given shape."""

    name: str
    hidden_size: int = 0
    num_layers: int = 0
    num_heads: int = 0
    intermediate_size: int = 0
    arch: str = "llama"            # ``qwen2``: built by ``benchmarks.archs`` at Qwen2-0.5B's shape
    served_dtype: str = "float32"  # the engine's dtype, hence the wire's
    interval_s: float | None = None   # seconds between publishes (None: --interval-s)
    updates: int | None = None        # timed updates (None: --updates)


MODELS = {
    "qwen05": ModelSpec("qwen05", arch="qwen2", served_dtype="bfloat16", interval_s=2.0, updates=10),
    "default": ModelSpec("default"),
    "large": ModelSpec("large", hidden_size=512, num_layers=8, num_heads=8, intermediate_size=1536),
    "tiny": ModelSpec("tiny", hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128),
}


# ------------------------------------------------------------------------------ the worker

class SyncWorker:
    """A rollout worker reduced to what weight sync touches (Ray actor): one engine,
    a generation loop on its own thread, weights taken on one staging thread."""

    def __init__(self, engine_kind: str, model_dir: str, max_num_seqs: int, max_new_tokens: int,
                 max_model_len: int, prompts: list[list[int]], seed: int, dtype: str = "float32") -> None:
        from pipeline_rl.runtime_env import ACTOR_ENV

        os.environ.update(ACTOR_ENV)
        import torch

        torch.set_num_threads(1)
        from pipeline_rl.rollout.engines.engine import EngineConfig, GenerationEngine, SamplingConfig

        cfg = EngineConfig(model_dir=model_dir, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                           kv_cache_gib=1.0, seed=seed, dtype=dtype)  # type: ignore[arg-type]
        t0 = time.perf_counter()
        self._engine: GenerationEngine
        if engine_kind == "inprocess":
            from pipeline_rl.rollout.engines.engine_inprocess import InprocessEngine

            self._engine = InprocessEngine(cfg)
        elif engine_kind == "async":
            from pipeline_rl.rollout.engines.engine_async import AsyncEngine

            self._engine = AsyncEngine(cfg)
        else:
            raise ValueError(f"unknown engine kind {engine_kind!r}")
        self.start_s = time.perf_counter() - t0
        self._sampling = SamplingConfig(max_new_tokens=max_new_tokens, ignore_eos=True)
        self._prompts = [tuple(p) for p in prompts]
        self._max_num_seqs = max_num_seqs
        self._stager = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stager")
        self._cond = threading.Condition()
        # version, time, stall_s, in flight, bytes, transfer_s, load_s
        self._applied: list[tuple[int, float, float, int, int, float, float]] = []
        self._calls: dict[str, list[float]] = {}
        self._error: str | None = None
        self._stop = threading.Event()
        self._steps = self._tokens = self._added = 0
        self._loop_start = 0.0
        self._thread: threading.Thread | None = None

    def ready(self) -> float:
        """Seconds the engine took to start."""
        return self.start_s

    def placement(self) -> Any:
        """Where this worker runs (the publisher picks the weight path by it)."""
        from pipeline_rl.weight_sync.channels.paths import local_placement

        return local_placement("cpu")

    # -- generation ----------------------------------------------------------------------
    def start(self) -> None:
        self._loop_start = time.perf_counter()
        self._thread = threading.Thread(target=self._loop, name="generate", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        from pipeline_rl.rollout.engines.engine import GenRequest

        engine = self._engine
        try:
            while not self._stop.is_set():
                applied = engine.apply_staged()
                if applied is not None:
                    now = time.time()
                    with self._cond:
                        self._applied.append((applied.version, now, applied.stall_s, applied.in_flight,
                                              applied.num_bytes, applied.transfer_s, applied.load_s))
                        self._cond.notify_all()
                while engine.num_unfinished() < self._max_num_seqs:
                    prompt = self._prompts[self._added % len(self._prompts)]
                    engine.add(GenRequest(f"r{self._added}", prompt, self._sampling))
                    self._added += 1
                finished = engine.step()
                with self._cond:
                    self._steps += 1
                    if finished:
                        self._tokens += sum(len(f.token_ids) for f in finished)
                        self._cond.notify_all()
        except BaseException as e:  # noqa: BLE001 - reported to the driver
            with self._cond:
                self._error = f"generation loop: {type(e).__name__}: {e}".splitlines()[0]
                self._cond.notify_all()

    # -- weights: every call on the one staging thread, as RolloutActor does -------------------
    def _take(self, name: str, call: Callable[..., Any], *args: Any) -> None:
        def timed() -> None:
            t = time.perf_counter()
            call(*args)
            dt = time.perf_counter() - t
            with self._cond:
                self._calls.setdefault(name, []).append(dt)

        self._stager.submit(timed).result()

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._take("init_weight_transfer_engine", self._engine.init_weight_transfer_engine, init_info)

    def start_weight_update(self) -> None:
        self._take("start_weight_update", self._engine.start_weight_update)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._take("update_weights", self._engine.update_weights, update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        if weight_version is None:
            raise ValueError("finish_weight_update needs the version of the weights")
        self._take("finish_weight_update", self._engine.load_received, int(weight_version))

    def receive_update(self, update_info: dict[str, Any], weight_version: str) -> float:
        """The trainer's one call per update: the three above in order (each timed)."""
        from pipeline_rl.weight_sync.protocol import receive_in_one_call

        return receive_in_one_call(self, update_info, weight_version)

    # -- driver ----------------------------------------------------------------------------
    def wait_generating(self, min_tokens: int, timeout_s: float) -> bool:
        """Block until the loop generated ``min_tokens`` tokens (steady state)."""
        return self._wait_for(lambda: self._tokens >= min_tokens, timeout_s)

    def wait_version(self, version: int, timeout_s: float) -> bool:
        """Block until an update of ``version`` or newer was applied by the loop."""
        return self._wait_for(lambda: any(v >= version for v, *_ in self._applied), timeout_s)

    def _wait_for(self, done: Callable[[], bool], timeout_s: float) -> bool:
        """Wait (under the loop's condition) until ``done()``; False on timeout; the
        loop's error, if it failed, is raised."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not done() and self._error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            if self._error is not None:
                raise RuntimeError(self._error)
        return True

    def report(self) -> dict[str, Any]:
        """Plain data (the driver cannot unpickle this module's classes)."""
        with self._cond:
            return {"version": self._engine.version, "steps": self._steps, "tokens": self._tokens,
                    "elapsed_s": time.perf_counter() - self._loop_start if self._loop_start else 0.0,
                    "applied": list(self._applied), "calls_s": {k: list(v) for k, v in self._calls.items()},
                    "error": self._error, "engine_start_s": self.start_s}

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)
        self._stager.shutdown(wait=True)
        self._engine.close()


# ------------------------------------------------------------------------------ the driver

def _pcts(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "max": None, "mean": None}
    a = np.asarray(values, dtype=np.float64)
    return {"p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "max": float(a.max()), "mean": float(a.mean())}


def model_dir_for(spec: ModelSpec, tmp: Path) -> str:
    if spec.name == "default":
        from pipeline_rl.config import Config
        from pipeline_rl.models import default_model_dir

        cfg = Config()
        return str(default_model_dir(cfg.model, cfg.task))
    if spec.arch == "qwen2":
        from benchmarks.archs import QWEN2_0_5B, build_arch_model

        return str(build_arch_model("qwen2", tmp / spec.name, seed=0, shape=QWEN2_0_5B, dtype="float32"))
    from pipeline_rl.models.tiny_llama import build_tiny_model

    return str(build_tiny_model(tmp / spec.name, hidden_size=spec.hidden_size, num_layers=spec.num_layers,
                                num_heads=spec.num_heads, intermediate_size=spec.intermediate_size, seed=0))


def random_prompts(count: int, length: int, seed: int) -> list[list[int]]:
    """Random ids of printable characters of the built-in tokenizer (ids 3..97)."""
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, 98, size=length)] for _ in range(count)]


def perturb(model: Any, version: int) -> None:
    """A stand-in for an optimizer step: every parameter scaled by ``1 +- 1e-3``."""
    import torch

    scale = 1.0 + (1e-3 if version % 2 else -1e-3)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(scale)


def plain_copy_ms(num_bytes: int, repeats: int = 3) -> float:
    """Milliseconds of one ``memcpy`` of ``num_bytes`` between two buffers already touched
    (median of ``repeats``): what moving the bytes once costs on this machine."""
    src = np.ones(num_bytes, dtype=np.uint8)
    dst = np.zeros(num_bytes, dtype=np.uint8)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t)
    return float(np.median(times)) * 1e3


def run_cell(model: Any, model_name: str, model_dir: str, engine: str, transport: str,
             args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    """One (model, engine, transport) cell: fresh workers, ``warmup + updates`` publishes."""
    import ray

    from pipeline_rl.weight_sync.publish.gather import gather_weights
    from pipeline_rl.weight_sync.publish.publisher import WeightPublisher

    spec = MODELS[model_name]
    interval_s = spec.interval_s or args.interval_s
    updates = spec.updates or args.updates
    t_cell = time.perf_counter()
    actor: Any = ray.remote(SyncWorker).options(num_cpus=0.01, max_concurrency=8, max_restarts=0)
    workers: list[Any] = [actor.remote(engine, model_dir, args.max_num_seqs, args.max_new_tokens,
                            args.prompt_len + args.max_new_tokens + 16, prompts, i, spec.served_dtype)
               for i in range(args.workers)]
    publisher: WeightPublisher | None = None
    try:
        start_s = ray.get([w.ready.remote() for w in workers])
        ray.get([w.start.remote() for w in workers])
        if not all(ray.get([w.wait_generating.remote(1, args.timeout_s) for w in workers])):
            raise RuntimeError(f"{engine}: no sequence finished within {args.timeout_s} s")
        publisher = WeightPublisher(workers, path=cast(Any, "auto" if transport == "vllm" else transport))
        total = args.warmup + updates
        gather_s: list[float] = []
        block_s: list[float] = []
        num_bytes = 0
        after_warmup = publisher.stats()
        calls_before: list[dict[str, int]] = [{} for _ in workers]
        next_t = time.perf_counter()
        for version in range(1, total + 1):
            perturb(model, version)
            t0 = time.perf_counter()
            update = gather_weights(model, version, zero_stage=0, dtype=cast(Any, spec.served_dtype),
                                    allocate=publisher.allocator())   # as the trainer does
            gather_s.append(time.perf_counter() - t0)
            num_bytes = update.num_bytes
            block_s.append(publisher.publish(update))
            del update
            if version == args.warmup:   # the warm-up lands before the timed updates start
                ray.get([w.wait_version.remote(version, args.timeout_s) for w in workers])
                publisher.flush(args.timeout_s)
                after_warmup = publisher.stats()
                calls_before = [{k: len(v) for k, v in r["calls_s"].items()}
                                for r in ray.get([w.report.remote() for w in workers])]
                next_t = time.perf_counter()
            else:
                next_t += interval_s
            time.sleep(max(0.0, next_t - time.perf_counter()))
        arrived = ray.get([w.wait_version.remote(total, args.timeout_s) for w in workers])
        if not all(arrived):
            raise RuntimeError(f"{engine}/{transport}: version {total} not applied within {args.timeout_s} s")
        publisher.flush(args.timeout_s)
        pstats = publisher.stats()
        timings = [t for t in publisher.send_timings if t.version > args.warmup]
        paths = sorted(set(publisher.paths.values()))
        publisher.close()
        publisher = None
        reports = ray.get([w.report.remote() for w in workers])
    finally:
        if publisher is not None:
            publisher.close(timeout_s=5.0)
        for w in workers:
            try:
                ray.get(w.stop.remote(), timeout=60)
            except Exception:  # noqa: BLE001 - killed below anyway
                pass
            ray.kill(w)

    published_at = dict(pstats.published_at)
    measured = [v for v in range(args.warmup + 1, total + 1)]
    latency_ms: list[float] = []
    warmup_ms: list[float] = []
    exact = True
    for v in range(1, total + 1):
        arrivals = []
        for rep in reports:
            times = [t for ver, t, *_ in rep["applied"] if ver >= v]
            if v > args.warmup:
                exact = exact and any(ver == v for ver, *_ in rep["applied"])
            arrivals.append(min(times) if times else float("nan"))
        ms = (max(arrivals) - published_at[v]) * 1e3
        (latency_ms if v > args.warmup else warmup_ms).append(ms)
    applied = [a for rep in reports for a in rep["applied"] if a[0] > args.warmup]
    stall_ms = [a[2] * 1e3 for a in applied]
    in_flight = [a[3] for a in applied]
    worker_transfer_ms = [a[5] * 1e3 for a in applied]
    load_ms = [a[6] * 1e3 for a in applied]
    calls: dict[str, list[float]] = {}
    for rep, before in zip(reports, calls_before):
        for name, values in rep["calls_s"].items():
            # per timed update, except the channel's one-off opening (in the warm-up)
            calls.setdefault(name, []).extend(values if name == "init_weight_transfer_engine"
                                              else values[before.get(name, 0):])
    timed = max(pstats.published - after_warmup.published, 1)
    tokens = sum(r["tokens"] for r in reports)
    elapsed = max(r["elapsed_s"] for r in reports)
    return {
        "model": model_name, "engine": engine, "transport": transport, "workers": args.workers,
        "paths": paths if transport != "object_store" else [],
        "plain_copy_ms": plain_copy_ms(num_bytes),
        "transfer_ms": _pcts([t.transfer_s * 1e3 for t in timings]) if timings else _pcts(worker_transfer_ms),
        "worker_transfer_ms": _pcts(worker_transfer_ms), "load_ms": _pcts(load_ms),
        "load_ms_all": load_ms,
        "updates": len(latency_ms), "bytes_per_update": num_bytes,
        "versions_published": [v for v, _ in pstats.published_at],
        "versions_applied": sorted({ver for rep in reports for ver, *_ in rep["applied"]}),
        "versions_complete": all(np.isfinite(latency_ms)) and len(latency_ms) == len(measured),
        "every_version_applied": exact,
        "latency_ms": _pcts(latency_ms), "latency_ms_all": latency_ms, "warmup_latency_ms": warmup_ms,
        "stall_ms": _pcts(stall_ms), "stall_ms_all": stall_ms,
        "in_flight_p50": float(np.median(in_flight)) if in_flight else None,
        "trainer": {"gather_ms": _pcts([s * 1e3 for s in gather_s[args.warmup:]]),
                    "caller_block_ms": _pcts([s * 1e3 for s in block_s[args.warmup:]])},
        "publisher": {"published": pstats.published, "superseded": pstats.superseded - after_warmup.superseded,
                      "offer_failures": pstats.offer_failures,
                      "put_ms_mean": (pstats.put_s - after_warmup.put_s) / timed * 1e3,
                      "offer_ms_mean": (pstats.offer_s - after_warmup.offer_s) / timed * 1e3,
                      "send_ms": {"transfer_p50": _pcts([t.transfer_s * 1e3 for t in timings])["p50"],
                                  "finish_p50": _pcts([t.finish_s * 1e3 for t in timings])["p50"],
                                  "total_p50": _pcts([t.total_s * 1e3 for t in timings])["p50"]}
                      if timings else None},
        "worker_calls_ms": {k: _pcts([s * 1e3 for s in v]) for k, v in sorted(calls.items())},
        "tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0,
        "engine_start_s": max(start_s), "cell_s": time.perf_counter() - t_cell,
    }


def add_ratios(cells: list[dict[str, Any]]) -> None:
    """``latency_p50_vs_object_store`` (and the stall's) against the object_store cell of the
    same model and engine."""
    base = {(c["model"], c["engine"]): c for c in cells if c["transport"] == "object_store"}
    for c in cells:
        ref = base.get((c["model"], c["engine"]))
        for key in ("latency", "stall"):
            ratio = None
            if ref is not None and ref[f"{key}_ms"]["p50"] and c[f"{key}_ms"]["p50"] is not None:
                ratio = c[f"{key}_ms"]["p50"] / ref[f"{key}_ms"]["p50"]
            c[f"{key}_p50_vs_object_store"] = ratio


def _f(x: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def markdown(result: dict[str, Any]) -> str:
    s = result["settings"]
    hw = result["hardware"]
    lines = [
        f"Weight sync: {s['updates']} updates per cell ({s['warmup']} warm-up left out) every "
        f"{s['interval_s']} s, {s['workers']} worker(s), {s['max_num_seqs']} sequences in flight "
        f"({s['max_new_tokens']} new tokens each). Hardware: {hw['cpu']}, {hw['cores']} cores. "
        f"Run time {result['run_s']:.0f} s.",
        "",
        "Latency: `publish()` called -> every worker's generation loop applied that version. "
        "Stall: time no engine step could run. Ratios: p50 over the object_store row's of the same "
        "model and engine. Publisher ms: the publisher thread's time per version (object_store: "
        "`ray.put` + offers; vllm: the whole send). Gather ms: `gather_weights` on the training "
        "thread (p50). Warm-up max: the slowest of the warm-up updates left out.",
        "",
        "Transfer: the bytes moving (trainer side: shared-memory write or gloo broadcast, and the "
        "worker's receive/check), beside generation. Load: into a shadow of the model beside "
        "generation (in-process: in the worker; AsyncLLM on CPU: in its engine core, then swapped "
        "in while paused). Plain copy: one `memcpy` of the update's bytes on this machine, measured "
        "in the same cell.",
        "",
        "| model | params | engine | transport (path) | MB/update | sync p50 ms | sync p90 ms | "
        "stall p50 ms | stall p90 ms | transfer p50 ms | load p50 ms | plain copy ms | "
        "sync vs object_store | publisher ms | gather ms | warm-up max ms | tokens/s |",
        "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in result["cells"]:
        params = result["models"][c["model"]]["params"]
        route = c["transport"] + (f" ({','.join(c['paths'])})" if c.get("paths") else "")
        lines.append(
            f"| {c['model']} | {params / 1e6:.2f} M | {c['engine']} | {route} | "
            f"{c['bytes_per_update'] / 1e6:.1f} | {_f(c['latency_ms']['p50'])} | {_f(c['latency_ms']['p90'])} | "
            f"{_f(c['stall_ms']['p50'], '{:.2f}')} | {_f(c['stall_ms']['p90'], '{:.2f}')} | "
            f"{_f(c['transfer_ms']['p50'])} | {_f(c['load_ms']['p50'])} | {c['plain_copy_ms']:.1f} | "
            f"{_f(c['latency_p50_vs_object_store'], '{:.2f}x')} | "
            f"{c['publisher']['put_ms_mean'] + c['publisher']['offer_ms_mean']:.1f} | "
            f"{_f(c['trainer']['gather_ms']['p50'])} | "
            f"{_f(max(c['warmup_latency_ms']) if c['warmup_latency_ms'] else None, '{:.0f}')} | "
            f"{c['tokens_per_s']:.0f} |")
    failed = result.get("failed") or []
    if failed:
        lines += ["", "Failed cells:"] + [f"- {f['model']} {f['engine']} {f['transport']}: {f['error']}"
                                          for f in failed]
    return "\n".join(lines) + "\n"


def _csv(choices: Sequence[str]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        items = [x.strip() for x in text.split(",") if x.strip()]
        bad = [x for x in items if x not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {','.join(choices)}")
        return items
    return parse


def flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", type=_csv(tuple(MODELS)), default=["default", "large"],
                   help="Models (default: default,large). default: the built-in default model; "
                        "qwen05: Qwen2-0.5B's shape (494 M params, random init, served in bfloat16, "
                        "10 updates 2 s apart); "
                        "large: random-init Llama, hidden 512, 8 layers, 8 heads, MLP 1536 (27 M params); "
                        "tiny: hidden 64, 2 layers, 2 heads, MLP 128 (smoke tests).")
    p.add_argument("--engines", type=_csv(ENGINES), default=list(ENGINES),
                   help="Engine kinds (default: inprocess,async): inprocess = InprocessEngine, async = AsyncEngine.")
    p.add_argument("--transports", type=_csv(TRANSPORTS), default=["vllm", "object_store"],
                   help="WeightPublisher transports (default: vllm,object_store): vllm (vLLM's API, "
                        "automatic path: shm here), shm or gloo (vLLM's API, path forced), object_store.")
    p.add_argument("--workers", type=int, default=1, help="Rollout-worker actors per cell (default 1).")
    p.add_argument("--updates", type=int, default=None, help="Timed updates per cell (default 20; --quick: 5).")
    p.add_argument("--warmup", type=int, default=5,
                   help="Updates published first and left out of the figures (default 5: the first opens "
                        "the channel; the first few of a 100 MB model are a start-up transient, several "
                        "times slower). Their latencies are in the JSON (warmup_latency_ms).")
    p.add_argument("--interval-s", type=float, default=0.5,
                   help="Seconds between two publishes, a training step (default 0.5).")
    p.add_argument("--max-num-seqs", type=int, default=16, help="Sequences kept in flight (default 16).")
    p.add_argument("--max-new-tokens", type=int, default=64, help="Tokens per sequence (default 64).")
    p.add_argument("--prompt-len", type=int, default=16, help="Random-token prompt length (default 16).")
    p.add_argument("--timeout-s", type=float, default=120.0,
                   help="Longest wait for an engine to generate or a version to arrive (default 120).")
    p.add_argument("--ray-logs", action="store_true", help="Show the actors' output on the console.")


def ray_for_cells(show_logs: bool) -> contextlib.AbstractContextManager[None]:
    """A local Ray (one CPU per core, 1 GiB of object store: a few 110 MB updates stay in
    memory instead of spilling) unless one is up."""
    import ray
    from ray import cloudpickle

    if __name__ != "__main__":   # imported (tests): the actor class travels by value
        cloudpickle.register_pickle_by_value(sys.modules[__name__])
    if ray.is_initialized():
        return contextlib.nullcontext()
    return ray_session(object_store_bytes=1 << 30, log_to_driver=show_logs)


def run(args: argparse.Namespace) -> Outcome:
    if args.updates is None:
        args.updates = 5 if args.quick else 20
    at_least(args, updates=1, workers=1, warmup=0)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    t_run = time.perf_counter()
    cells: list[dict[str, Any]] = []
    failed: list[dict[str, str]] = []
    models: dict[str, dict[str, Any]] = {}
    with ray_for_cells(args.ray_logs):
        with tempfile.TemporaryDirectory(prefix="weight_sync_") as tmp:
            for name in args.models:
                spec = MODELS[name]
                model_dir = model_dir_for(spec, Path(tmp))
                model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
                params = sum(p.numel() for p in model.parameters())
                cfg = model.config
                models[name] = {"params": params, "hidden_size": cfg.hidden_size,
                                "num_layers": cfg.num_hidden_layers, "num_heads": cfg.num_attention_heads,
                                "intermediate_size": cfg.intermediate_size,
                                "served_dtype": spec.served_dtype,
                                "dir": model_dir if name == "default" else None}
                print(f"weight_sync: model {name}: {params:,} params, served in {spec.served_dtype}",
                      flush=True)
                prompts = random_prompts(args.max_num_seqs, args.prompt_len, seed=0)
                for engine in args.engines:
                    for transport in args.transports:
                        try:
                            c = run_cell(model, name, model_dir, engine, transport, args, prompts)
                        except Exception as e:  # noqa: BLE001 - recorded; the other cells go on
                            error = f"{type(e).__name__}: {e}".splitlines()[0]
                            print(f"weight_sync: {name} {engine} {transport} FAILED: {error}", flush=True)
                            failed.append({"model": name, "engine": engine, "transport": transport,
                                           "error": error})
                            continue
                        cells.append(c)
                        print(f"weight_sync: {name} {engine:9s} {transport:12s} "
                              f"latency p50 {c['latency_ms']['p50']:.1f} ms p90 {c['latency_ms']['p90']:.1f} | "
                              f"stall p50 {_f(c['stall_ms']['p50'], '{:.2f}')} ms "
                              f"p90 {_f(c['stall_ms']['p90'], '{:.2f}')} | "
                              f"{c['bytes_per_update'] / 1e6:.1f} MB | engine start {c['engine_start_s']:.1f} s, "
                              f"cell {c['cell_s']:.1f} s", flush=True)
                del model
    add_ratios(cells)
    result = {
        "hardware": hardware(), "run_s": time.perf_counter() - t_run,
        "settings": {k: getattr(args, k) for k in ("models", "engines", "transports", "workers", "updates",
                                                   "warmup", "interval_s", "max_num_seqs", "max_new_tokens",
                                                   "prompt_len")},
        "models": models, "cells": cells, "failed": failed,
    }
    md = markdown(result).rstrip("\n")
    return Outcome(result, md, 1 if failed else 0,
                   summary=f"{md}\nweight_sync: {result['run_s']:.0f} s; wrote {args.json} and {args.md}")


def main(argv: list[str] | None = None) -> int:
    return bench_main("weight_sync", __doc__, argv, run, flags=flags, quick="5 updates per cell instead of 20.",
                      json_path=RESULTS / "weight_sync.json", md_path=RESULTS / "weight_sync.md")


if __name__ == "__main__":
    raise SystemExit(main())
