"""A LoRA run's updates (``--lora.rank`` > 0): each version is the adapter alone, sent like full
weights (same channels, same paths, same :class:`WeightUpdate`), and this module is what the
worker needs to serve it.

Names and shapes. An adapter tensor is named as PEFT saves it, ``base_model.model.<M>.lora_A.weight``
(``A``: ``[r, in]``) and ``base_model.model.<M>.lora_B.weight`` (``B``: ``[out, r]``), for every
served 2-D weight ``<M>.weight`` whose module's last name is a target; :func:`adapter_spec`
derives that list from the served model's :class:`WeightSpec`, so :func:`validate_update`
checks an adapter as it checks full weights (complete, shapes, finite) before anything is
loaded.

Serving (:class:`LoraServing`, handed to the worker's vLLM backend through
``EngineArgs.additional_config[LORA_KEY]``):

- ``merged``: :class:`Merger` folds each version into the base, ``W = W0 + (alpha / r) B A``
  (float32), into an update the engine loads like full weights: in-flight semantics,
  per-token versions and the prefix-cache rule are those of full weights because it *is* a
  full-weight load; ``W0`` is read once from the model folder and kept in host memory. A
  loader that can keep what a version does not change (the in-process engine's direct CPU
  path) is given the targeted weights alone; any other gets the complete update;
- ``native``: vLLM serves the base with LoRA enabled, the adapter replaced in place from
  memory (``vllm_adapter.replace_lora``), every request under :data:`LORA_ID`.

Invariant: nothing here imports vLLM; a served weight is never changed but by a whole,
validated version.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pipeline_rl.weight_sync.message import CheckedUpdate, WeightSpec, WeightUpdateError, read_weight_spec

if TYPE_CHECKING:
    import torch

#: The key of ``EngineArgs.additional_config`` that carries :class:`LoraServing`.
LORA_KEY = "pipeline_rl_lora"
#: The prefix PEFT puts before a module's name in a saved adapter.
PEFT_PREFIX = "base_model.model."
#: Native serving: the one adapter's id and name in vLLM (every request carries it).
LORA_ID = 1
LORA_NAME = "policy"
#: The ranks vLLM's ``max_lora_rank`` accepts (an adapter of a smaller rank is padded).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass(frozen=True, slots=True)
class LoraServing:
    """What a worker needs to serve a LoRA run's updates: the adapter's rank, alpha and target
    module names (their last name), and the serving mode."""

    rank: int
    alpha: float
    targets: tuple[str, ...]
    mode: Literal["native", "merged"]

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "targets": list(self.targets)}

    @classmethod
    def of_run(cls, lora: Any, device_type: str) -> "LoraServing | None":
        """A run's (``cfg.lora``, a ``LoraConfig``) on ``device_type``; None without an adapter.
        Targets the run did not name are the defaults; :func:`adapter_spec` keeps those the
        served model has (the driver checked the named ones)."""
        if lora is None:
            return None
        return cls(rank=lora.rank, alpha=lora.alpha, targets=lora.served_targets(),
                   mode=lora.serving_mode(device_type))

    def engine_args(self) -> dict[str, Any]:
        """``EngineArgs`` keywords (vLLM's public ones): these settings for the worker's backend
        (``additional_config``) and, serving natively, LoRA enabled for one adapter."""
        args: dict[str, Any] = {"additional_config": {LORA_KEY: self.to_dict()}}
        if self.mode == "native":
            if self.rank > VLLM_LORA_RANKS[-1]:
                raise ValueError(f"--lora.rank: vLLM serves ranks up to {VLLM_LORA_RANKS[-1]} natively "
                                 f"(got {self.rank}); use --lora.serving merged")
            args.update(enable_lora=True, max_loras=1, max_cpu_loras=1,
                        max_lora_rank=min(r for r in VLLM_LORA_RANKS if r >= self.rank),
                        worker_extension_cls="pipeline_rl.weight_sync.receive.vllm_adapter.LoraWorkerExtension")
        return args

    @classmethod
    def from_additional(cls, additional: object) -> "LoraServing | None":
        """From ``vllm_config.additional_config`` (None when the run trains no adapter)."""
        raw = additional.get(LORA_KEY) if isinstance(additional, Mapping) else None
        if not isinstance(raw, Mapping):
            return None
        return cls(rank=int(raw["rank"]), alpha=float(raw["alpha"]), targets=tuple(raw["targets"]),
                   mode="native" if raw["mode"] == "native" else "merged")


def is_adapter_name(name: str) -> bool:
    return name.startswith(PEFT_PREFIX) and name.endswith((".lora_A.weight", ".lora_B.weight"))


def base_weight_name(adapter_name: str) -> str:
    """``base_model.model.M.lora_A.weight`` -> ``M.weight``: the served weight it changes."""
    return f"{adapter_name.removeprefix(PEFT_PREFIX).rsplit('.', 2)[0]}.weight"


def adapter_names(weight: str) -> tuple[str, str]:
    """``M.weight`` -> the names of its ``A`` and ``B``."""
    module = weight.removesuffix(".weight")
    return f"{PEFT_PREFIX}{module}.lora_A.weight", f"{PEFT_PREFIX}{module}.lora_B.weight"


def adapter_spec(spec: WeightSpec, lora: LoraServing) -> WeightSpec:
    """What every adapter update of the model of ``spec`` must hold: for each served 2-D
    ``<...>.<target>.weight``, its ``A`` ``[r, in]`` and ``B`` ``[out, r]``."""
    shapes: dict[str, tuple[int, ...]] = {}
    for weight, shape in spec.shapes.items():
        parts = weight.split(".")
        if len(shape) == 2 and len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in lora.targets:
            a, b = adapter_names(weight)
            shapes[a] = (lora.rank, shape[1])
            shapes[b] = (shape[0], lora.rank)
    if not shapes:
        raise WeightUpdateError(f"the served model has no weight of the adapter's targets {','.join(lora.targets)}")
    return WeightSpec(shapes)


class AdapterServer:
    """A worker's LoRA serving, one per engine, held by its vLLM backend
    (``vllm_backend.WeightReceiver.adapter``): the adapter's spec (what every update is checked
    against) and, per version, the adapter made live in ``model``: ``merged`` loads the
    complete update (:meth:`full`), ``native`` replaces vLLM's one adapter in place
    (:meth:`replace`; a zero adapter is registered at start, so a request never makes vLLM
    look for its folder and step 0 serves the base). ``version``: the adapter version
    served (-1 before the first). A version that cannot be applied raises
    :class:`WeightUpdateError` in one line."""

    def __init__(self, model_dir: str | Path, lora: LoraServing, model: Any = None,
                 load_full: Callable[[CheckedUpdate], None] | None = None) -> None:
        self.lora = lora
        self.merger = Merger(model_dir, lora) if lora.mode == "merged" else None
        self.spec = self.merger.spec if self.merger is not None else adapter_spec(read_weight_spec(model_dir), lora)
        self.version = -1
        self._model, self._load_full = model, load_full   # load_full: a complete update into model
        self._live: Any = None   # native: vLLM's adapter object now served
        if lora.mode == "native" and model is not None:
            import torch

            zeros = tuple((n, torch.zeros(shape)) for n, shape in sorted(self.spec.shapes.items()))
            self.replace(CheckedUpdate(-1, zeros, 0))

    def full(self, update: CheckedUpdate, names: frozenset[str] | None = None) -> CheckedUpdate:
        """Merged serving: ``update`` (an adapter) as the update to load: complete, or only
        ``names`` for a loader that keeps the others (:meth:`Merger.merge`)."""
        assert self.merger is not None
        return self.merger.merge(update.version, update.tensors, names)

    def replace(self, update: CheckedUpdate) -> None:
        """Native serving: vLLM's adapter replaced by ``update``'s tensors (between steps)."""
        from pipeline_rl.weight_sync.receive.vllm_adapter import replace_lora

        try:
            self._live = replace_lora(self._model, LORA_ID, dict(update.tensors), peft_config_dict(self.lora))
        except Exception as e:
            raise WeightUpdateError(f"adapter v{update.version} not applied: {type(e).__name__}: "
                                    f"{str(e).splitlines()[0] if str(e) else ''}") from e
        self.version = update.version

    def restore(self) -> None:
        """Native serving: the adapter now served registered again (vLLM's worker drops every
        adapter after a weight update through its API; ``vllm_adapter.LoraWorkerExtension``)."""
        if self._live is not None:
            from pipeline_rl.weight_sync.receive.vllm_adapter import readd_lora

            readd_lora(self._model, self._live)

    def serve(self, update: CheckedUpdate) -> None:
        """Make ``update`` (a checked adapter) live in the model no step is running on."""
        if self.merger is None:
            self.replace(update)
            return
        assert self._load_full is not None
        self._load_full(self.full(update))
        self.version = update.version


class Merger:
    """Merged serving: the base weights ``W0`` (float32, host memory, read once from the
    served model's folder) and, per version, the update ``W0 + scale * B @ A`` of every
    targeted weight, with ``W0`` of every other weight asked for.

    Each targeted weight is folded by one ``addmm`` into a buffer of its own, allocated at the
    first version and rewritten by every later one (a fresh 0.4 GB per version at the
    135 M shape cost page faults on the worker's one core, and ``W0 + B @ A`` in two steps
    three more passes over it). Invariant: the tensors of a merge are valid until the next
    merge; a caller that keeps them longer copies them."""

    def __init__(self, model_dir: str | Path, lora: LoraServing) -> None:
        from pipeline_rl.weight_sync.message import load_update

        import torch

        base = load_update(model_dir, -1)
        self._base = {n: torch.from_numpy(a) for n, a in zip(base.names, base.arrays, strict=True)}
        self.spec = adapter_spec(read_weight_spec(model_dir), lora)
        self.scale = lora.scale
        #: The served weights the adapter changes (``M.weight`` for each ``A``/``B`` pair).
        self.targeted = frozenset(base_weight_name(n) for n in self.spec.shapes)
        self._out: dict[str, "torch.Tensor"] = {}

    def merge(self, version: int, adapter: Iterable[tuple[str, "torch.Tensor"]],
              names: frozenset[str] | None = None) -> CheckedUpdate:
        """The update of ``version`` from a checked adapter's tensors (any device: the result
        is on the host, float32, ordered by name): every served weight, or only ``names``
        (a loader that keeps the others as they are; they never change in a LoRA run)."""
        import torch

        given = dict(adapter)
        tensors = []
        for name in sorted(self._base if names is None else names):
            w0 = self._base[name]
            a, b = adapter_names(name)
            if a not in given:
                tensors.append((name, w0))
                continue
            out = self._out.get(name)
            if out is None:
                out = self._out[name] = torch.empty_like(w0)
            torch.addmm(w0, given[b].to("cpu", torch.float32), given[a].to("cpu", torch.float32),
                        alpha=self.scale, out=out)                                   # [out, in]
            tensors.append((name, out))
        return CheckedUpdate(version, tuple(tensors), sum(int(t.nbytes) for _, t in tensors))


def peft_tensors(adapter: Iterable[tuple[str, "torch.Tensor"]]) -> dict[str, "torch.Tensor"]:
    """An adapter's tensors by name, as PEFT's loaders and vLLM's ``LoRAModel.from_lora_tensors``
    take them."""
    return dict(adapter)


def peft_config_dict(lora: LoraServing) -> dict[str, Any]:
    """The ``adapter_config.json`` of the served adapter, as a dict (vLLM's ``PEFTHelper``)."""
    return {"r": lora.rank, "lora_alpha": lora.alpha, "target_modules": list(lora.targets),
            "bias": "none", "peft_type": "LORA", "task_type": "CAUSAL_LM"}
