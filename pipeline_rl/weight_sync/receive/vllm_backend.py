"""The weight-transfer backend vLLM builds inside its worker (``vllm_adapter.BACKEND``,
registered by ``vllm_adapter.register``): :class:`WeightReceiver`, the one
``receiver.Receiver`` plus step 3 of ``weight_sync.channels.channel``, the load.

The run key's rendezvous secret reaches it from the rollout worker that drives the
engine, in the init message the worker passes to its own engine (field
:data:`LOCAL_SECRET`, added by that worker, never by the trainer, and taken out before the
message is decoded): in-process, or over vLLM's local connection to its engine core.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.weight_transfer.base import WeightTransferEngine

from pipeline_rl.weight_sync.channels.channel import InitInfo, UpdateInfo, decode_init_info, decode_update_info
from pipeline_rl.weight_sync.message import CheckedUpdate, WeightUpdate, as_checked, read_weight_spec
from pipeline_rl.weight_sync.receive.lora_update import AdapterServer, LoraServing
from pipeline_rl.weight_sync.receive.receiver import Received, Receiver, make_stager
from pipeline_rl.weight_sync.channels.shm import StatusCell
from pipeline_rl.weight_sync.receive.vllm_adapter import complete_backend, load_served_weights

#: The init message's field that carries the rendezvous secret from a rollout worker to its
#: own engine (hex).
LOCAL_SECRET = "local_secret"


def with_local_secret(init_info: dict[str, Any], secret: bytes) -> dict[str, Any]:
    """``init_info`` as a rollout worker hands it to its own engine: with the secret."""
    return {**init_info, LOCAL_SECRET: secret.hex()}


@complete_backend   # vLLM 0.26's base also declares its trainer half abstract
class WeightReceiver(WeightTransferEngine[Any, Any]):
    """vLLM worker backend: every path's receiving half (``receiver.Receiver``) and the
    load. ``init_transfer_engine`` joins the trainer's gloo or nccl group (shm, ipc and
    the object store need none); ``start_weight_update`` forgets any unapplied update;
    ``update_weights`` *receives into staging and checks* (a bad update is refused with
    ``WeightUpdateError``, nothing loaded); ``finish_weight_update`` *loads* it into
    ``self.model`` (vLLM calls it only while generation is paused). :meth:`take_received`
    hands a checked host update to a caller that loads it elsewhere (the in-process
    engine's shadow). Invariant: the model is touched only by ``finish_weight_update``,
    and only with a complete, checked update."""

    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: Any, model: Any) -> None:
        super().__init__(config, vllm_config, device, model)
        lora = LoraServing.from_additional(getattr(vllm_config, "additional_config", None))
        self._loads = ModelLoads(model, vllm_config)
        #: A LoRA run's serving (None: full weights): updates are the adapter, checked against its spec.
        self.adapter = AdapterServer(vllm_config.model_config.model, lora, model,
                                     self._loads.load) if lora is not None else None
        spec = self.adapter.spec if self.adapter is not None else read_weight_spec(vllm_config.model_config.model)
        self._rx = Receiver(spec, device=device)
        self._received: Received | None = None
        self._stager: Any = None   # core_staging.CoreStager: loads beside generation (AsyncLLM on CPU)
        self._staged = False

    def parse_init_info(self, init_dict: dict[str, Any]) -> InitInfo:  # type: ignore[override]
        fields = dict(init_dict)
        self._rx.secret = bytes.fromhex(str(fields.pop(LOCAL_SECRET, "")))
        return decode_init_info(fields)

    def parse_update_info(self, update_dict: dict[str, Any]) -> UpdateInfo:  # type: ignore[override]
        return decode_update_info(update_dict)

    def init_transfer_engine(self, init_info: InitInfo) -> None:  # type: ignore[override]
        self._rx.join(init_info)

    def start_weight_update(self) -> None:
        self._received = None

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # vLLM's base would also synchronise an accelerator; every receive here is done when it returns.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: UpdateInfo) -> None:  # type: ignore[override]
        """Receive into staging and check; a host update with a status cell starts loading
        into the shadow beside generation (``core_staging``)."""
        received = self._rx.receive(update_info)
        self._received = received
        if received.host is not None and received.status is not None and self.adapter is not None:
            StatusCell(received.status, create=False).set(received.version, StatusCell.NO_SHADOW)  # loaded while paused
        elif received.host is not None and received.status is not None:
            if self._stager is None:
                self._stager = make_stager(self.model, self.vllm_config)
            self._staged = self._stager.start(received.host, received.status)

    def take_received(self) -> WeightUpdate:
        """The checked host update received since ``start_weight_update`` (handed out once)."""
        received, self._received = self._received, None
        if received is None or received.host is None:
            raise RuntimeError("weights: finish_weight_update without a received host update")
        return received.host

    def finish_weight_update(self) -> None:
        """Load what was received and checked (see the class docstring)."""
        received, self._received = self._received, None
        if received is None:
            raise RuntimeError("weights: finish_weight_update without a received update")
        opened = received.opened
        if received.copying is not None:   # a copy that failed loads nothing (the worker saw it failed)
            if not received.copying.done() or received.copying.exception() is not None:
                return
            opened = received.copying.result()
        if opened is not None:   # on this device: copy into the model, then let it go
            tensors = sorted(opened.tensors, key=lambda nt: nt[0])
            if self.adapter is not None:
                self.adapter.serve(CheckedUpdate(opened.version, tuple(tensors), 0))
            else:
                load_served_weights(self.model, tensors, self.vllm_config)
            import torch

            torch.cuda.synchronize(self.device)   # the trainer may free its buffer once this returns
            return
        if self._staged and self._stager is not None:   # loaded beside generation: swap it in
            self._staged = False
            self._stager.finish()    # a failed load changes nothing (the worker saw it failed)
            return
        assert received.host is not None
        if self.adapter is not None:
            self.adapter.serve(as_checked(received.host))
            return
        self._loads.load(as_checked(received.host))

    def shutdown(self) -> None:
        self._rx.close()


class ModelLoads:
    """Loads checked updates into one vLLM model that no step is running on: the direct CPU
    path when it covers the model, else vLLM's layerwise reload.

    Invariant: one :class:`~pipeline_rl.weight_sync.receive.loaders.DirectLoader` for the model's
    life, built at its first load and again only after a layerwise reload (which may
    re-create parameters), as the in-process engine's shadow keeps one. With a loader built
    anew for each update, the second merged LoRA update on the ``AsyncLLM`` engine (tiny
    model, CPU) left the direct path for vLLM's layerwise reload, which failed (a tensor of
    size 0 where 128 were expected)."""

    def __init__(self, model: Any, vllm_config: Any) -> None:
        self.model, self.vllm_config = model, vllm_config
        self._on_cpu = str(vllm_config.device_config.device_type) == "cpu"
        self._direct: Any = None   # DirectLoader | None, once built
        self._built = False

    def load(self, checked: CheckedUpdate) -> None:
        """Load ``checked`` (a complete update) into the model."""
        from pipeline_rl.weight_sync.receive.loaders import DirectLoader

        if self._on_cpu and not self._built:
            self._direct, self._built = DirectLoader.build(self.model), True
        if self._direct is not None and self._direct.load(checked, self.vllm_config):
            return
        load_served_weights(self.model, checked.tensors, self.vllm_config)
        if self._on_cpu:
            self._direct = DirectLoader.build(self.model)
