"""LoRA in the trainer (``--lora.*``, ``pipeline_rl.config.lora_config``): the model wrapped by PEFT,
the adapter's parameters by their wire names, the reference policy as the adapter switched off,
checkpoints in PEFT's own format and a merged model at the end.

Names. An adapter tensor travels and is saved under PEFT's saved name,
``base_model.model.<module>.lora_A.weight`` (``A``: ``[r, in]``) and ``...lora_B.weight``
(``B``: ``[out, r]``), the keys of ``adapter_model.safetensors``, which
``peft.PeftModel.from_pretrained`` and vLLM's LoRA loader read as they are; the served base
weight it changes is ``<module>.weight``, and the update it makes is ``scale * B @ A`` with
``scale = alpha / r`` (``[out, in]``); the worker's side of these names is
``pipeline_rl.weight_sync.receive.lora_update``.

Invariants: without a ``--lora`` section (``cfg.lora`` None) only :class:`FullWeights` runs and the
model is the plain Hugging Face model; with an adapter, the only trainable parameters are the adapter's (DeepSpeed is handed
just those), and the base weights never change (a checkpoint stores the adapter and the
optimizer's state of the adapter only).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline_rl.config.lora_config import DEFAULT_TARGETS, LoraConfig
from pipeline_rl.weight_sync.receive.lora_update import base_weight_name

if TYPE_CHECKING:
    import torch

#: PEFT's adapter files (``PeftModel.save_pretrained`` writes these names).
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
#: PEFT's name for the one adapter the trainer trains.
ADAPTER_NAME = "default"


def linear_module_names(model: Any) -> dict[str, tuple[int, int]]:
    """Leaf names of the model's ``nn.Linear`` modules (the LM head excluded) -> the smallest
    (in_features, out_features) seen under that name."""
    import torch

    out: dict[str, tuple[int, int]] = {}
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, torch.nn.Linear) and leaf != "lm_head":
            dims = (module.in_features, module.out_features)
            out[leaf] = min(out.get(leaf, dims), dims)
    return out


def resolve_targets(cfg: LoraConfig, available: dict[str, tuple[int, int]]) -> tuple[str, ...]:
    """The module names that get an adapter; ValueError (one line, naming the flag) when one
    asked for is not in the model, none is found, or the rank exceeds a target's size."""
    requested = cfg.requested_targets()
    if requested is None:
        targets = tuple(n for n in DEFAULT_TARGETS if n in available)
        if not targets:
            raise ValueError(f"--lora.target_modules: auto found none of {','.join(DEFAULT_TARGETS)} in the "
                             f"model (its linear layers: {','.join(sorted(available)) or 'none'}); name them")
    else:
        missing = [n for n in requested if n not in available]
        if missing:
            raise ValueError(f"--lora.target_modules: the model has no linear module named {missing[0]!r} "
                             f"(it has {','.join(sorted(available)) or 'none'})")
        targets = requested
    for name in targets:
        if cfg.rank > min(available[name]):
            raise ValueError(f"--lora.rank: {cfg.rank} exceeds {name}'s size {min(available[name])} "
                             "(an adapter that large is no longer low-rank)")
    return targets


def check_lora(lora: LoraConfig, model_dir: str) -> tuple[str, ...]:
    """Before Ray: the adapter fits the model in ``model_dir`` (built on the meta device from its
    ``config.json``: no weights read). Returns the target modules; ValueError otherwise."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return resolve_targets(lora, linear_module_names(model))


def peft_config(lora: LoraConfig, targets: Sequence[str], base_dir: str | Path) -> Any:
    """PEFT's ``LoraConfig`` of this run's adapter (what ``adapter_config.json`` holds)."""
    import peft

    alpha: Any = int(lora.alpha) if lora.alpha.is_integer() else lora.alpha   # PEFT types it int; floats work
    return peft.LoraConfig(r=lora.rank, lora_alpha=alpha, lora_dropout=lora.dropout,
                           target_modules=list(targets), bias="none", task_type="CAUSAL_LM",
                           base_model_name_or_path=str(base_dir))


def wrap(model: Any, lora: LoraConfig, base_dir: str | Path, seed: int) -> Any:
    """``model`` with a fresh adapter (PEFT's initialisation: ``B = 0``, so the wrapped model
    starts as the base; ``A`` drawn from ``seed`` alone, the same on every rank and run);
    only the adapter requires gradients. Adapter dropout, when asked for, is on in every
    pass of the trainer (the rest of the model stays in eval mode)."""
    import peft
    import torch

    targets = resolve_targets(lora, linear_module_names(model))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        wrapped = peft.get_peft_model(model, peft_config(lora, targets, base_dir), adapter_name=ADAPTER_NAME)
    if lora.dropout > 0:
        for name, module in wrapped.named_modules():
            if name.endswith(f"lora_dropout.{ADAPTER_NAME}"):
                module.train()
    return wrapped


def wire_name(param_name: str) -> str:
    """PEFT's in-memory parameter name -> its saved name (the adapter's name dropped)."""
    return param_name.replace(f".lora_A.{ADAPTER_NAME}.", ".lora_A.").replace(f".lora_B.{ADAPTER_NAME}.", ".lora_B.")


def adapter_parameters(module: Any) -> list[tuple[str, "torch.nn.Parameter"]]:
    """The adapter's parameters of the wrapped model, by their saved names, in the module's order."""
    return [(wire_name(n), p) for n, p in module.named_parameters() if p.requires_grad]


@contextlib.contextmanager
def adapter_disabled(module: Any) -> Iterator[None]:
    """The base model, for the KL penalty's reference: the same weights with the adapter off
    (no second copy of the model)."""
    with module.disable_adapter():
        yield


# -- what trains: every weight or the adapter -----------------------------------------------------

class FullWeights:
    """Full fine-tuning (no ``--lora``): every weight trains, is published, is saved as a Hugging
    Face model; a KL term needs a reference model of its own."""

    frozen_base = False   # nothing frozen: DeepSpeed saves every parameter, loads strictly

    def preload(self) -> None:
        """Import what building it needs beyond the trainer's own imports: nothing."""

    def wrap(self, model: Any, base_dir: str | Path, seed: int) -> Any:
        return model

    def published(self, module: Any) -> list[tuple[str, "torch.nn.Parameter"]] | None:
        """What a weight update carries: None, every parameter."""
        return None

    def reference_needed(self, kl: bool) -> bool:
        """Whether the KL penalty needs a second model: whenever there is a KL term."""
        return kl

    def save(self, out: Path, module: Any, state: dict[str, "torch.Tensor"], base_dir: str | Path) -> None:
        module.save_pretrained(str(out), state_dict=state)


class AdapterWeights:
    """A LoRA adapter (``--lora.rank`` > 0): only the adapter trains, is published and saved
    (PEFT's files); the base is frozen and, with its adapter off, the KL reference."""

    frozen_base = True    # DeepSpeed's state leaves the frozen base out; loads it non-strictly

    def __init__(self, lora: LoraConfig) -> None:
        self.lora = lora

    def preload(self) -> None:
        """Import what building it needs beyond the trainer's own imports: PEFT."""
        import peft  # noqa: F401

    def wrap(self, model: Any, base_dir: str | Path, seed: int) -> Any:
        return wrap(model, self.lora, base_dir, seed)

    def published(self, module: Any) -> list[tuple[str, "torch.nn.Parameter"]] | None:
        """What a weight update carries: the adapter's parameters, by saved name."""
        return adapter_parameters(module)

    def reference_needed(self, kl: bool) -> bool:
        """Never: the reference is the trained model with its adapter off (:func:`adapter_disabled`)."""
        return False

    def save(self, out: Path, module: Any, state: dict[str, "torch.Tensor"], base_dir: str | Path) -> None:
        save_adapter(out, state, self.lora, base_dir)


def trained_weights(lora: LoraConfig | None) -> FullWeights | AdapterWeights:
    """What a trainer trains, from ``cfg.lora``: the one place on the trainer's side that tells
    full fine-tuning from an adapter (the rest asks the object it returns)."""
    return FullWeights() if lora is None else AdapterWeights(lora)


# -- checkpoints ----------------------------------------------------------------------------------

def save_adapter(out: Path, tensors: dict[str, "torch.Tensor"], lora: LoraConfig, base_dir: str | Path) -> None:
    """Write ``adapter_config.json`` and ``adapter_model.safetensors`` into ``out`` (PEFT's files,
    loadable by ``peft.PeftModel.from_pretrained`` and by vLLM with LoRA enabled); ``tensors``
    by saved name."""
    targets = sorted({base_weight_name(n).rsplit(".", 2)[-2] for n in tensors})
    write_adapter(out, tensors, peft_config(lora, targets, base_dir))


def write_adapter(out: Path, tensors: dict[str, "torch.Tensor"], config: Any) -> None:
    """PEFT's two files in ``out``: ``config`` (a ``peft.LoraConfig``, only read) as
    ``adapter_config.json``, ``tensors`` (by saved name, in their own dtype) as
    ``adapter_model.safetensors``."""
    from safetensors.torch import save_file

    config.save_pretrained(str(out))
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})


def adapter_base_dir(ckpt: Path) -> str | None:
    """The base model folder an adapter checkpoint names, or None when ``ckpt`` holds no adapter."""
    try:
        return str(json.loads((ckpt / ADAPTER_CONFIG).read_text())["base_model_name_or_path"])
    except (OSError, ValueError, KeyError):
        return None


def write_merged(adapter_dir: Path, out: Path) -> Path:
    """The base named by ``adapter_dir``'s config with the adapter folded in
    (``merge_and_unload``), saved as a plain Hugging Face model (and tokenizer) in ``out``, in
    the base's own dtype."""
    import peft
    from transformers import AutoModelForCausalLM

    from pipeline_rl.training.checkpoint import copy_tokenizer_files

    base_dir = adapter_base_dir(adapter_dir)
    if base_dir is None:
        raise ValueError(f"{adapter_dir}: no {ADAPTER_CONFIG} naming the base model")
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype="auto")
    merged = peft.PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    merged.save_pretrained(str(out))
    copy_tokenizer_files(Path(base_dir), out)
    return out
