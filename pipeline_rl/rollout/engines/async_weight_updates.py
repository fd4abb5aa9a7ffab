"""The weight updates of the ``AsyncLLM`` engine (``engine_async.py``), its base class
:class:`AsyncWeightUpdates`: vLLM's weight-transfer calls on a running engine.

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

import threading
import time
from abc import abstractmethod
from dataclasses import dataclass, replace
from typing import Any, Coroutine, TypeVar

from pipeline_rl.rollout.engines.engine import AppliedUpdate, EngineConfig, GenerationEngine
from pipeline_rl.rollout.engines import vllm_compat as compat
from pipeline_rl.weight_sync.channels.channel import path_of
from pipeline_rl.weight_sync.dtypes import from_torch
from pipeline_rl.weight_sync.layout import UpdateLayout
from pipeline_rl.weight_sync.message import CheckedUpdate, WeightUpdate, WeightUpdateError
from pipeline_rl.weight_sync.protocol import DEFAULT_TIMEOUT_S, tagged
from pipeline_rl.weight_sync.receive.receiver import Receiver
from pipeline_rl.weight_sync.channels.shm import SharedSegment, ShmUpdateInfo, StatusCell
from pipeline_rl.weight_sync.receive.vllm_adapter import BACKEND, register

_T = TypeVar("_T")


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


class AsyncWeightUpdates(GenerationEngine):
    """vLLM's weight-transfer calls on an ``AsyncLLM`` engine, one update at a time (module
    docstring). The engine (``engine_async.AsyncEngine``) runs the loop (:meth:`_run`), sets the
    state below, and calls :meth:`_init_updates` before its ``AsyncLLM`` starts and
    :meth:`_close_updates` when it closes."""

    # Set by the engine: the AsyncLLM, how tokens get versions, the requests' adapter, their salt's version.
    cfg: EngineConfig
    _llm: Any
    _native: bool
    _record: compat.VersionRecord | None
    _lora: Any
    _labelled: int
    _unfinished: int

    def _init_updates(self, cfg: EngineConfig) -> None:
        """No update under way; the staging segment, the weight receiver writing into it and the
        status cell the engine core reports its loads in, created in that order."""
        register()
        self.backend = transfer_backend(cfg.device)
        self._spec = cfg.update_spec()   # a LoRA run's: the adapter's
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

    @abstractmethod
    def _run(self, coro: Coroutine[Any, Any, _T], timeout_s: float | None = None) -> _T:
        """``coro`` run on the engine's event loop (every call into ``AsyncLLM`` is); its result."""

    def _check(self) -> None:
        if self._broken is not None:
            raise self._broken

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

    def _close_updates(self) -> None:
        """Release the receiver, the staging segment and the status cell."""
        self._rx.close()
        self._staging.close()
        self._status.unlink()


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)
