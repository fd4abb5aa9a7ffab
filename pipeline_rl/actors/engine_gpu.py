"""The GPU path of the engine layer: vLLM's ``AsyncLLM`` (engine core in its own
process) on a private asyncio loop, with in-flight weight updates by
``pause_generation(mode="keep")`` -> load -> ``resume_generation()``.

Written against vLLM's documented API of the pinned version; it cannot run on
the project's CPU machines and is NOT exercised by the test suite (see README).

Weights reach the GPU worker through a worker extension
(``worker_extension_cls``, :class:`WeightReceiver`): the validated
``WeightUpdate`` arrays travel as raw bytes in one ``collective_rpc`` and are
applied with vLLM's layerwise reload, as on CPU. This keeps the payload
contract of ``pipeline_rl.actors.weights`` (float32 numpy from the trainer via
Ray) on every machine. The faster transport for large models is vLLM's NCCL
weight-transfer engine (``init_weight_transfer_engine`` /
``start_weight_update`` / ``update_weights`` / ``finish_weight_update``) with
the trainer broadcasting; it slots into :meth:`GpuEngine.apply_update` in place
of the ``collective_rpc`` and is left for when GPU machines are available.

Token versions come from vLLM's weight-version spans: the version is set while
generation is paused, so every token is labelled by the weights that sampled it.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Coroutine, TypeVar

from pipeline_rl.actors.engine import (
    AppliedUpdate,
    EngineConfig,
    FinishedSequence,
    GenerationEngine,
    GenRequest,
)
from pipeline_rl.actors.engine_cpu import sampling_params, to_finished
from pipeline_rl.actors.weights import CheckedUpdate, read_weight_spec

_T = TypeVar("_T")
STEP_WAIT_S = 0.01  # how long step() waits for a finished sequence before returning none


class WeightReceiver:
    """vLLM worker extension (mixed into the GPU worker class by vLLM): loads raw
    float32/float16 parameter bytes with the layerwise reload."""

    model_runner: Any
    device: Any
    vllm_config: Any

    def pipeline_rl_load_weights(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                 blobs: list[bytes]) -> None:
        import torch
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        model = self.model_runner.model
        tensors = ((n, torch.frombuffer(bytearray(b), dtype=getattr(torch, d)).reshape(s).to(self.device))
                   for n, d, s, b in zip(names, dtypes, shapes, blobs))
        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            initialize_layerwise_reload(model)
            model.load_weights(tensors)
            finalize_layerwise_reload(model, self.vllm_config.model_config)


@dataclass(frozen=True, slots=True)
class _Staged:
    """An update serialised for the ``collective_rpc`` (lists line up)."""

    version: int
    num_bytes: int
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    blobs: list[bytes]


class GpuEngine(GenerationEngine):
    """``AsyncLLM`` behind the step-wise :class:`GenerationEngine` interface:
    ``add`` submits a streaming request, ``step`` returns what finished since the
    last call (waiting up to ``STEP_WAIT_S``), ``apply_update`` pauses (keep),
    loads, optionally recomputes, relabels the version and resumes."""

    def __init__(self, cfg: EngineConfig) -> None:
        from vllm import AsyncEngineArgs

        self.cfg = cfg
        self.kv_policy = cfg.kv_policy
        self._spec = read_weight_spec(cfg.model_dir)
        self._version = cfg.initial_version
        self._done: queue.Queue[FinishedSequence | BaseException] = queue.Queue()
        self._unfinished = 0
        self._stage_lock = threading.Lock()
        self._staged: _Staged | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="vllm-async", daemon=True)
        self._thread.start()
        args = AsyncEngineArgs(
            model=cfg.model_dir, dtype=cfg.dtype, seed=cfg.seed, max_model_len=cfg.max_model_len,
            max_num_seqs=cfg.max_num_seqs, gpu_memory_utilization=cfg.gpu_memory_utilization,
            logprobs_mode="processed_logprobs", enable_prefix_caching=cfg.kv_policy == "recompute",
            worker_extension_cls=f"{__name__}.WeightReceiver", disable_log_stats=True,
        )
        self._llm: Any = self._run(self._start(args))
        self._tokenizer = self._llm.tokenizer

    async def _start(self, args: Any) -> Any:
        from vllm.v1.engine.async_llm import AsyncLLM

        llm = AsyncLLM.from_engine_args(args)
        await llm.update_weight_version(str(self._version))
        return llm

    def _run(self, coro: Coroutine[Any, Any, _T]) -> _T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def add(self, request: GenRequest) -> None:
        self._unfinished += 1
        asyncio.run_coroutine_threadsafe(self._generate(request), self._loop)

    async def _generate(self, request: GenRequest) -> None:
        try:
            final = None
            prompt = {"prompt_token_ids": list(request.prompt_ids)}
            async for out in self._llm.generate(prompt, sampling_params(request.sampling), request.request_id):
                final = out
            assert final is not None and final.finished
            self._done.put(to_finished(final, self._version))
        except BaseException as e:  # surfaced to the caller by step()
            self._done.put(e)

    def step(self) -> list[FinishedSequence]:
        out: list[FinishedSequence] = []
        try:
            item = self._done.get(timeout=STEP_WAIT_S)
            while True:
                if isinstance(item, BaseException):
                    raise item
                out.append(item)
                item = self._done.get_nowait()
        except queue.Empty:
            pass
        self._unfinished -= len(out)
        return out

    def num_unfinished(self) -> int:
        return self._unfinished

    def stage(self, update: CheckedUpdate) -> bool:
        """Serialise the arrays to bytes (any thread, before the pause)."""
        blobs = _Staged(update.version, update.num_bytes, [n for n, _ in update.tensors],
                        [str(t.dtype).removeprefix("torch.") for _, t in update.tensors],
                        [list(t.shape) for _, t in update.tensors],
                        [t.numpy().tobytes() for _, t in update.tensors])
        with self._stage_lock:
            if update.version <= max(self._version, self._staged.version if self._staged else -1):
                return False
            self._staged = blobs
            return True

    def apply_staged(self) -> AppliedUpdate | None:
        with self._stage_lock:
            staged, self._staged = self._staged, None
        if staged is None:
            return None
        start = time.perf_counter()
        in_flight = self._unfinished
        self._run(self._swap(staged))
        self._version = staged.version
        return AppliedUpdate(staged.version, time.perf_counter() - start, in_flight, staged.num_bytes)

    async def _swap(self, st: "_Staged") -> None:
        await self._llm.pause_generation(mode="keep", clear_cache=False)
        try:
            await self._llm.collective_rpc("pipeline_rl_load_weights",
                                           args=(st.names, st.dtypes, st.shapes, st.blobs))
            if self.kv_policy == "recompute":
                await self._llm.reset_prefix_cache(reset_running_requests=True)
            await self._llm.update_weight_version(str(st.version))
        finally:
            await self._llm.resume_generation()

    def close(self) -> None:
        if self._loop.is_running():
            self._llm.shutdown()
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
