"""The DeepSpeed trainer: batches of groups -> corrected policy-gradient step -> new weights.

One :class:`Trainer` per data-parallel rank. A step (docs/design.md):

1. advantages per group (``pipeline_rl.correction.advantages``),
2. sequences padded into micro-batches (``pipeline_rl.actors.batch``; pad, not pack),
3. per micro-batch: the trainer's log-probs of the completion tokens at the sampling
   temperature (vLLM's behaviour log-probs are ``processed_logprobs``, i.e. after temperature,
   so ``logits / rollout.temperature`` is the only consistent choice), the corrected loss
   (``pipeline_rl.correction.loss.policy_loss``), backward,
4. one optimizer step (gradient clipping in DeepSpeed), ``version += 1``.

Invariants:
- Micro-batched loss == full-batch loss: the loss normaliser ``N`` is computed over the
  *global* batch (all micro-batches, all ranks: an all-reduce of one number) and passed into
  every micro-batch's loss; DeepSpeed averages gradients over ranks, so each rank uses
  ``N / world_size``. Hence ZeRO-0 on one rank and ZeRO-2 on two ranks over the same groups
  take the same step (tested).
- Gradient accumulation is caller-managed (``managed_gradient_accumulation: false``): any
  number of micro-batches per step; ``engine.step()`` is the only accumulation boundary.
- ``version`` counts batches trained (one per :meth:`Trainer.step`, however many PPO epochs,
  i.e. optimizer steps, the batch gets): the unit of ``max_steps``, checkpoint names, lag,
  staleness eviction and the admission budget.

:class:`TrainLoop` is the continuous consumer: it takes the next batch as soon as the buffer can
give one (never a whole generation round), records the wait (trainer idle time), steps,
publishes the weights (``pipeline_rl.actors.publish``) and checkpoints every N steps.

CPU specifics (docs/design.md, platform notes): gloo, torch's AdamW (``torch_adam``: no JIT-compiled C++ op), the
shared-memory comm op skipped, ``TORCH_EXTENSIONS_DIR`` under the project, one thread.
"""

from __future__ import annotations

import importlib
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from pipeline_rl.actors.batch import LagStats, MicroBatch, build_micro_batches, lag_stats
from pipeline_rl.actors.checkpoint import (
    DEEPSPEED_DIR, DEEPSPEED_TAG, CheckpointError, RunState, checkpoint_name, copy_tokenizer_files,
    load_rng, partial_dir, publish_dir, read_run_state, save_rng, write_run_state,
)
from pipeline_rl.actors.publish import WeightPublisher, gather_weights
from pipeline_rl.actors.weights import WeightUpdate
from pipeline_rl.config import Config
from pipeline_rl.net import free_port
from pipeline_rl.correction.advantages import compute_advantages
from pipeline_rl.correction.loss import LossMetrics, PolicyBatch, loss_normalizer, policy_loss
from pipeline_rl.samples import Group

log = logging.getLogger(__name__)

PROJECT_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True, slots=True)
class StepResult:
    """What one :meth:`Trainer.step` did (this rank's view; ``loss`` is the global batch loss).

    ``version``: policy version after the step; ``num_tokens``: completion tokens in this rank's
    share; ``lag``: staleness of the batch measured against the version that consumed it;
    ``pad_frac``: padding share of the micro-batch inputs; ``grad_norm``: before clipping
    (None when DeepSpeed does not report it).
    """

    version: int
    loss: float
    metrics: LossMetrics
    step_time_s: float
    num_tokens: int
    num_seqs: int
    num_groups: int
    num_micro_batches: int
    lag: LagStats
    mixed_version_frac: float
    reward_mean: float
    pad_frac: float
    grad_norm: float | None


def deepspeed_config(cfg: Config, world_size: int) -> dict[str, Any]:
    """The DeepSpeed config dict for ``cfg`` (external API: DeepSpeed takes a dict)."""
    t = cfg.trainer
    per_rank = t.batch_size // world_size
    micro = min(t.micro_batch_size, per_rank)
    gas = -(-per_rank // micro)
    ds: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "train_batch_size": micro * gas * world_size,
        "managed_gradient_accumulation": False,
        "gradient_clipping": t.grad_clip,
        "optimizer": {"type": "AdamW", "params": {
            "lr": t.lr, "weight_decay": t.weight_decay, "betas": [0.9, 0.999], "eps": 1e-8,
            "torch_adam": True}},
        "zero_optimization": {"stage": t.zero_stage},
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    if cfg.model.dtype == "bfloat16":
        ds["bf16"] = {"enabled": True}
    return ds


def _init_distributed(rank: int, world_size: int, master_addr: str | None, master_port: int | None,
                      backend: str) -> None:
    """Join (or create) the process group; a process holds one group for its lifetime.
    Address and port: the arguments, else ``MASTER_ADDR`` / ``MASTER_PORT`` from the
    environment, else loopback and (one rank only) a free port."""
    import deepspeed
    import deepspeed.comm.comm as ds_comm
    import deepspeed.utils.groups as ds_groups
    import torch.distributed as dist

    # DeepSpeed keeps one communication backend object per process, bound to the process
    # group alive when it was made; an in-process vLLM engine destroys and re-creates the
    # default group, which would leave that object stale. Re-wrap the current group.
    ds_comm.cdb = None
    ds_groups._WORLD_GROUP = None  # DeepSpeed's cached clone of the default group, likewise
    ds_groups._ZERO_PARAM_INTRA_PARALLEL_GROUP = None
    if dist.is_initialized():
        if dist.get_rank() != rank or dist.get_world_size() != world_size:
            raise RuntimeError(f"trainer: this process is already rank {dist.get_rank()} of "
                               f"{dist.get_world_size()}, cannot become rank {rank} of {world_size}")
        if dist.get_backend() != backend:
            raise RuntimeError(f"trainer: this process already holds a {dist.get_backend()} process "
                               f"group; a trainer on this device needs {backend} (one device kind "
                               f"per process)")
        # a group made by another library (vLLM's engine in the same process) leaves no
        # LOCAL_RANK, which deepspeed.initialize requires
        os.environ.setdefault("LOCAL_RANK", "0")
        return
    master_addr = master_addr or os.environ.get("MASTER_ADDR") or "127.0.0.1"
    if master_port is None and os.environ.get("MASTER_PORT", "").isdigit():
        master_port = int(os.environ["MASTER_PORT"])
    if master_port is None:
        if world_size > 1:
            raise ValueError("trainer: master_port (or MASTER_PORT) is required with world_size > 1")
        master_port = free_port()
    os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=os.environ.get("LOCAL_RANK", "0"))
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False,
                               rank=rank, world_size=world_size)


def _prepare_cpu_deepspeed() -> None:
    """docs/design.md, platform notes: no JIT C++ builds on CPU (shm comm op skipped), extensions under the project."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(PROJECT_ROOT / ".cache" / "torch_extensions"))
    setattr(importlib.import_module("deepspeed.comm.torch"), "build_shm_op", lambda: None)


def _prepare_cuda_deepspeed() -> None:
    """DeepSpeed picks its accelerator once per process, from ``DS_ACCELERATOR`` when set (the
    test suite and CPU runs set ``cpu``); a CUDA trainer needs DeepSpeed's CUDA accelerator, else
    the engine keeps the model on the CPU. Raises when DeepSpeed already chose another one."""
    if os.environ.get("DS_ACCELERATOR", "cuda") != "cuda":
        log.info("trainer: model.device is cuda; DS_ACCELERATOR=%s replaced by cuda",
                 os.environ["DS_ACCELERATOR"])
        os.environ["DS_ACCELERATOR"] = "cuda"
    from deepspeed.accelerator import get_accelerator

    name = get_accelerator().device_name()
    if name != "cuda":
        raise RuntimeError(f"trainer: DeepSpeed already uses its {name} accelerator in this "
                           f"process; a CUDA trainer needs its own process")


class Trainer:
    """One data-parallel rank of the DeepSpeed trainer.

    ``model_dir``: a Hugging Face model folder (or a checkpoint folder of this trainer; then call
    :meth:`load_checkpoint` on it right away to restore optimizer, version and RNG).
    Multi-rank: every rank constructs a Trainer with the same ``cfg``, its ``rank``, the shared
    ``world_size`` / ``master_addr`` / ``master_port`` (or ``MASTER_ADDR`` / ``MASTER_PORT`` in
    the environment); :meth:`step`, :meth:`save_checkpoint`
    and (under ZeRO-3) :meth:`weights` are collectives that every rank calls in the same order.
    """

    def __init__(self, cfg: Config, model_dir: str | Path, rank: int = 0, world_size: int = 1, *,
                 master_addr: str | None = None, master_port: int | None = None,
                 num_threads: int | None = 1) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"trainer: rank {rank} is not in [0, {world_size})")
        if cfg.trainer.batch_size % world_size:
            raise ValueError(f"trainer.batch_size {cfg.trainer.batch_size} does not split over "
                             f"{world_size} ranks")
        self.cfg = cfg
        self.model_dir = Path(model_dir)
        self.rank, self.world_size = rank, world_size
        self.device = self._pick_device()
        if num_threads is not None and self.device.type == "cpu":
            torch.set_num_threads(num_threads)
        if self.device.type == "cpu":
            _prepare_cpu_deepspeed()
        else:
            _prepare_cuda_deepspeed()
        import deepspeed

        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
        _init_distributed(rank, world_size, master_addr, master_port,
                          "gloo" if self.device.type == "cpu" else "nccl")
        self.model = self._load_model(self.model_dir)
        self.engine, _, _, _ = deepspeed.initialize(
            model=self.model, model_parameters=[p for p in self.model.parameters() if p.requires_grad],
            config=deepspeed_config(cfg, world_size))
        self.zero_stage = cfg.trainer.zero_stage
        self.pad_id = int(self.model.config.pad_token_id or 0)
        self.ref_model = self._load_model(self.model_dir).eval().requires_grad_(False).to(self.device) \
            if cfg.algorithm.kl_coef > 0 else None
        self._version = 0
        self._steps_taken = 0
        self._grad_norm: float | None = None
        self._record_grad_norm_zero0()

    # -- properties ----------------------------------------------------------------------------

    @property
    def version(self) -> int:
        """Batches trained (the policy version of the current weights; see the module docstring)."""
        return self._version

    @property
    def weights_collective(self) -> bool:
        """True when :meth:`weights` is a collective (ZeRO-3): every rank must call it, in step,
        even ranks that do not publish."""
        return self.zero_stage == 3

    def _record_grad_norm_zero0(self) -> None:
        """DeepSpeed reports the pre-clip gradient norm under ZeRO 1-3 only; without ZeRO it
        clips through ``engine.clip_fp32_gradients`` and drops the norm, so this engine's
        method is replaced by one that clips identically and keeps the norm."""
        if self.zero_stage != 0:
            return
        from deepspeed.runtime.utils import clip_grad_norm_

        engine = self.engine

        def clip_and_record() -> None:
            norm = clip_grad_norm_(parameters=engine.module.parameters(),
                                   max_norm=engine.gradient_clipping(), mpu=engine.mpu)
            self._grad_norm = float(norm)

        engine.clip_fp32_gradients = clip_and_record

    def _pick_device(self) -> torch.device:
        want = self.cfg.model.device
        if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
            if not torch.cuda.is_available():
                raise RuntimeError("model.device: cuda requested but no CUDA device is present")
            local = int(os.environ.get("LOCAL_RANK", self.rank % max(torch.cuda.device_count(), 1)))
            torch.cuda.set_device(local)
            return torch.device("cuda", local)
        return torch.device("cpu")

    def _load_model(self, path: Path) -> Any:
        from transformers import AutoModelForCausalLM

        dtype = torch.bfloat16 if self.cfg.model.dtype == "bfloat16" else torch.float32
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
        model.config.use_cache = False
        return model

    # -- the step ------------------------------------------------------------------------------

    def step(self, groups: Sequence[Group]) -> StepResult:
        """One training step on this rank's share of the batch; collective across ranks."""
        if not groups:
            raise ValueError("trainer.step: empty batch")
        t0 = time.perf_counter()
        algo = self.cfg.algorithm
        lag = lag_stats(groups, self._version)
        mbs = [mb.to(self.device) for mb in build_micro_batches(
            groups, self._advantages(groups), micro_batch_size=self.cfg.trainer.micro_batch_size,
            pad_id=self.pad_id)]
        norm = self._global_normalizer(mbs) / self.world_size
        ref = [self._ref_logp(mb) for mb in mbs] if self.ref_model is not None else None
        epochs = algo.ppo_epochs if algo.loss == "ppo" else 1
        # PPO's proximal policy is the trainer at the start of the batch: None in the first
        # epoch (the loss then uses logp detached), that epoch's log-probs afterwards.
        prox: list[torch.Tensor] | None = None
        first: tuple[float, LossMetrics] | None = None
        for _ in range(epochs):
            loss_sum, logps, parts = self._accumulate(mbs, norm, prox, ref)
            self.engine.step()
            self._steps_taken += 1
            if first is None:
                # each rank's loss is scaled by world_size (see norm above): undo for the report
                first = (self._all_reduce_sum(loss_sum) / self.world_size, LossMetrics.merge(parts))
                prox = logps
        assert first is not None
        self._version += 1  # one version per batch, however many PPO epochs it had
        # ZeRO-0 fp32: recorded by the clip hook; otherwise (ZeRO 1-3, and DeepSpeed's bf16
        # optimizer, which clips by itself) the engine reports it
        grad_norm = self._grad_norm if self._grad_norm is not None else self.engine.get_global_grad_norm()
        rewards = [c.reward for g in groups for c in g.completions]
        real = sum(mb.num_real_tokens for mb in mbs)
        return StepResult(
            version=self._version, loss=first[0], metrics=first[1],
            step_time_s=time.perf_counter() - t0,
            num_tokens=int(sum(mb.num_completion_tokens for mb in mbs)),
            num_seqs=sum(mb.num_seqs for mb in mbs), num_groups=len(groups),
            num_micro_batches=len(mbs), lag=lag, mixed_version_frac=lag.mixed_version_frac,
            reward_mean=float(np.mean(rewards)) if rewards else 0.0,
            pad_frac=1.0 - real / max(1, sum(mb.input_ids.numel() for mb in mbs)),
            grad_norm=None if grad_norm is None else float(grad_norm))

    def _accumulate(self, mbs: Sequence[MicroBatch], norm: float, prox: Sequence[torch.Tensor] | None,
                    ref: Sequence[torch.Tensor] | None) -> tuple[float, list[torch.Tensor], list[LossMetrics]]:
        """Forward + loss + backward over every micro-batch (gradients accumulate; no step).
        Returns the summed loss, the detached log-probs and the per-micro-batch metrics."""
        loss_sum, logps, parts = 0.0, [], []
        for i, mb in enumerate(mbs):
            logp = self._token_logp(mb, grad=True)                                    # [B, L-1]
            batch = self._policy_batch(mb, logp, prox[i] if prox else None, ref[i] if ref else None)
            loss, metrics = policy_loss(batch, self.cfg.algorithm, self.cfg.correction, normalizer=norm)
            self.engine.backward(loss, scale_wrt_gas=False)
            loss_sum += float(loss.detach())
            logps.append(logp.detach())
            parts.append(metrics)
        return loss_sum, logps, parts

    def _advantages(self, groups: Sequence[Group]) -> list[np.ndarray]:
        """Per-group advantages; groups of equal size are computed together ([G, n])."""
        out: list[np.ndarray | None] = [None] * len(groups)
        by_size: dict[int, list[int]] = {}
        for i, g in enumerate(groups):
            by_size.setdefault(len(g.completions), []).append(i)
        for idx in by_size.values():
            rewards = torch.tensor([groups[i].rewards for i in idx], dtype=torch.float32)  # [G, n]
            adv = compute_advantages(self.cfg.algorithm.advantage, rewards)                  # [G, n]
            for row, i in enumerate(idx):
                out[i] = adv[row].detach().cpu().numpy()
        return [a for a in out if a is not None]

    def _token_logp(self, mb: MicroBatch, *, grad: bool) -> torch.Tensor:
        """log π(token) at the sampling temperature on target positions: [B, L-1]."""
        with torch.set_grad_enabled(grad):
            logits = self.engine(input_ids=mb.input_ids).logits                    # [B, L, V]
            return _logp_from_logits(logits, mb.input_ids, self.cfg.rollout.temperature)

    @torch.no_grad()
    def _ref_logp(self, mb: MicroBatch) -> torch.Tensor:
        assert self.ref_model is not None
        logits = self.ref_model(input_ids=mb.input_ids).logits                     # [B, L, V]
        return _logp_from_logits(logits, mb.input_ids, self.cfg.rollout.temperature)

    @staticmethod
    def _policy_batch(mb: MicroBatch, logp: torch.Tensor, prox: torch.Tensor | None,
                      ref: torch.Tensor | None) -> PolicyBatch:
        return PolicyBatch(logp=logp, behav_logp=mb.behav_logp, mask=mb.mask, advantages=mb.advantages,
                           prox_logp=prox, ref_logp=ref)

    def _global_normalizer(self, mbs: Sequence[MicroBatch]) -> float:
        """Loss normaliser N of the whole batch: summed over micro-batches and ranks."""
        local = sum(float(loss_normalizer(mb.mask, self.cfg.algorithm)) for mb in mbs)
        return self._all_reduce_sum(local)

    def _all_reduce_sum(self, value: float) -> float:
        if self.world_size == 1:
            return value
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.float64,
                         device=self.device if self.device.type == "cuda" else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return float(t.item())

    # -- inspection ----------------------------------------------------------------------------

    @torch.no_grad()
    def logprobs(self, groups: Sequence[Group]) -> list[list[np.ndarray]]:
        """The trainer's log-probs of every completion token under the current weights, at the
        sampling temperature: ``out[g][c]`` has one value per token of completion ``c`` of group
        ``g``. Collective under ZeRO-3."""
        zeros = [np.zeros(len(g.completions), dtype=np.float32) for g in groups]
        flat: dict[int, np.ndarray] = {}
        for mb in build_micro_batches(groups, zeros, micro_batch_size=self.cfg.trainer.micro_batch_size,
                                      pad_id=self.pad_id):
            mb = mb.to(self.device)
            logp = self._token_logp(mb, grad=False).float().cpu().numpy()
            mask = mb.mask.cpu().numpy() > 0
            for row, idx in enumerate(mb.index.tolist()):
                flat[idx] = logp[row][mask[row]]
        out, k = [], 0
        for g in groups:
            out.append([flat[k + i] for i in range(len(g.completions))])
            k += len(g.completions)
        return out

    # -- weights -------------------------------------------------------------------------------

    def weights(self, version: int | None = None) -> WeightUpdate:
        """Full current parameters with their version (ZeRO-3: gathered; a collective)."""
        if version is not None and version != self._version:
            raise ValueError(f"trainer.weights: asked for version {version}, trainer is at {self._version}")
        return gather_weights(self.engine.module, self._version, zero_stage=self.zero_stage)

    # -- checkpoints ---------------------------------------------------------------------------

    def save_checkpoint(self, path: str | Path, *, data_position: int = 0) -> Path:
        """Write a complete checkpoint to ``path`` (see ``pipeline_rl.actors.checkpoint``); a
        collective. ``data_position`` is stored and returned by :meth:`load_checkpoint`.
        Multi-rank runs need ``path`` on a filesystem every rank sees."""
        import torch.distributed as dist

        final = Path(path)
        part = partial_dir(final)
        if self.rank == 0:
            shutil.rmtree(part, ignore_errors=True)
            part.mkdir(parents=True)
        dist.barrier()
        self.engine.save_checkpoint(str(part / DEEPSPEED_DIR), tag=DEEPSPEED_TAG, save_latest=False)
        update = self.weights()
        if self.rank == 0:
            self._save_hf(part, update)
        save_rng(part, self.rank)
        dist.barrier()
        if self.rank == 0:
            write_run_state(part, RunState(version=self._version, data_position=data_position,
                                           world_size=self.world_size, zero_stage=self.zero_stage))
            publish_dir(part, final)
        dist.barrier()
        return final

    def _save_hf(self, out: Path, update: WeightUpdate) -> None:
        dtype = next(self.engine.module.parameters()).dtype
        state = {n: torch.from_numpy(a).to(dtype) for n, a in zip(update.names, update.arrays, strict=True)}
        self.engine.module.save_pretrained(str(out), state_dict=state)
        copy_tokenizer_files(self.model_dir, out)

    def load_checkpoint(self, path: str | Path) -> RunState:
        """Restore weights, optimizer, scheduler, version and RNG from a checkpoint; returns its
        run state (``data_position`` as saved). Call it before the first step (ZeRO-3 needs an
        untouched engine). Raises :class:`CheckpointError` with a one-line reason."""
        d = Path(path)
        state = read_run_state(d)
        if (state.world_size, state.zero_stage) != (self.world_size, self.zero_stage):
            raise CheckpointError(f"checkpoint {d}: saved by {state.world_size} rank(s) with ZeRO-"
                                  f"{state.zero_stage}; this run has {self.world_size} with ZeRO-{self.zero_stage}")
        if self._steps_taken and self.zero_stage == 3:
            raise CheckpointError(f"checkpoint {d}: load it before the first step under ZeRO-3")
        try:
            loaded, _ = self.engine.load_checkpoint(str(d / DEEPSPEED_DIR), tag=DEEPSPEED_TAG,
                                                    load_module_strict=True)
        except Exception as e:
            first = str(e).splitlines()[0] if str(e) else "unreadable"
            raise CheckpointError(f"checkpoint {d}: DeepSpeed state is corrupt ({type(e).__name__}: {first})") from None
        if loaded is None:
            raise CheckpointError(f"checkpoint {d}: DeepSpeed state {DEEPSPEED_DIR}/{DEEPSPEED_TAG} not found")
        load_rng(d, self.rank)
        self._version = state.version
        return state

    def close(self) -> None:
        """Release the engine (the process group stays: one per process)."""
        self.engine.destroy()


def _logp_from_logits(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(logits / T) of the next token: logits [B, L, V], input_ids [B, L] -> [B, L-1]."""
    scaled = logits[:, :-1].float() / temperature                                   # [B, L-1, V]
    targets = input_ids[:, 1:].unsqueeze(-1)                                        # [B, L-1, 1]
    return scaled.gather(-1, targets).squeeze(-1) - torch.logsumexp(scaled, dim=-1)  # [B, L-1]


# ------------------------------------------------------------------------------------------------
# Continuous consumption
# ------------------------------------------------------------------------------------------------

class BatchSource(Protocol):
    """Where batches come from: the ReplayBuffer itself, or an adapter over its Ray actor."""

    def get_batch(self, num_groups: int, trainer_version: int, timeout_s: float | None = None, *,
                  rank: int = 0) -> list[Group] | None: ...

    def set_version(self, version: int) -> None: ...


@dataclass(frozen=True, slots=True)
class LoopRecord:
    """One step of :class:`TrainLoop`: the step itself plus the time around it.

    ``wait_s``: blocked waiting for the batch (trainer idle); ``gather_s``: copying the weights
    out for publishing (on the critical path); ``publish_block_s``: handing them to the publisher;
    ``checkpoint``: folder written after this step, if any; ``wall_s``: the whole iteration
    (wait included), so ``sum(wait_s) / sum(wall_s)`` is the idle fraction of any window.
    """

    step: StepResult
    wait_s: float
    gather_s: float
    publish_block_s: float
    checkpoint_s: float
    checkpoint: str | None
    wall_s: float


@dataclass(frozen=True, slots=True)
class LoopSummary:
    """Totals of one :meth:`TrainLoop.run`. ``idle_frac = wait_s / wall_s``."""

    steps: int
    final_version: int
    wall_s: float
    wait_s: float
    train_s: float
    publish_s: float
    checkpoint_s: float
    data_position: int
    last_checkpoint: str | None
    records: tuple[LoopRecord, ...] = field(repr=False, default=())

    @property
    def idle_frac(self) -> float:
        return self.wait_s / self.wall_s if self.wall_s > 0 else 0.0


class TrainLoop:
    """Consume batches continuously: get -> step -> publish -> (checkpoint), until ``max_steps``.

    The trainer asks for the next ``groups_per_rank`` groups as soon as a step ends; the buffer
    answers as soon as it holds that many groups within the staleness bound, so the trainer never
    waits for a generation round. Ranks each take their own groups (disjoint: the buffer pops) and
    stay in step through the collectives inside :meth:`Trainer.step`.

    ``publisher`` is given on the rank that publishes (rank 0) and None elsewhere; under ZeRO-3
    every rank still joins the gather. ``data_position`` counts groups consumed over all ranks
    and is saved in checkpoints.
    """

    def __init__(self, trainer: Trainer, source: BatchSource, *, publisher: WeightPublisher | None = None,
                 groups_per_rank: int | None = None, checkpoint_root: str | Path | None = None,
                 checkpoint_every: int | None = None, data_position: int = 0,
                 batch_timeout_s: float | None = None, poll_s: float = 0.5) -> None:
        cfg = trainer.cfg
        self.trainer, self.source, self.publisher = trainer, source, publisher
        self.groups_per_rank = groups_per_rank or cfg.groups_per_step // trainer.world_size
        self.checkpoint_root = Path(checkpoint_root) if checkpoint_root is not None else None
        self.checkpoint_every = cfg.trainer.checkpoint_every if checkpoint_every is None else checkpoint_every
        self.data_position = data_position
        self.batch_timeout_s = batch_timeout_s or cfg.trainer.batch_timeout_s
        self.poll_s = poll_s
        self._stop = threading.Event()

    def stop(self) -> None:
        """Ask :meth:`run` to return after the current step (thread-safe)."""
        self._stop.set()

    def next_batch(self) -> tuple[list[Group] | None, float]:
        """Wait for the next batch; returns (groups or None when stopped, seconds waited).
        Raises TimeoutError after ``batch_timeout_s`` without one."""
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.batch_timeout_s
        while not self._stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"trainer: no batch of {self.groups_per_rank} groups within "
                                   f"{self.batch_timeout_s:.0f} s (trainer.batch_timeout_s)")
            poll = min(self.poll_s, left)
            t_poll = time.monotonic()
            groups = self.source.get_batch(self.groups_per_rank, self.trainer.version, poll,
                                           rank=self.trainer.rank)
            if groups:
                return groups, time.perf_counter() - t0
            if time.monotonic() - t_poll < poll / 2:   # source closed or not blocking: don't spin
                self._stop.wait(min(0.05, poll))
        return None, time.perf_counter() - t0

    def run(self, max_steps: int, on_step: Callable[[LoopRecord], None] | None = None) -> LoopSummary:
        """Train until the trainer's version reaches ``max_steps`` (a resumed run continues its
        count) or :meth:`stop`; checkpoints every ``checkpoint_every`` steps and at the end."""
        t_start = time.perf_counter()
        records: list[LoopRecord] = []
        last_ckpt: str | None = None
        tr = self.trainer
        while tr.version < max_steps and not self._stop.is_set():
            t_iter = time.perf_counter()
            groups, wait_s = self.next_batch()
            if groups is None:
                break
            step = tr.step(groups)
            self.data_position += len(groups) * tr.world_size
            gather_s, block_s = self._publish()
            if tr.rank == 0:
                self.source.set_version(tr.version)
            ckpt_s, ckpt = 0.0, None
            if self.checkpoint_every and tr.version % self.checkpoint_every == 0:
                ckpt_s, ckpt = self._checkpoint()
                last_ckpt = ckpt
            rec = LoopRecord(step, wait_s, gather_s, block_s, ckpt_s, ckpt, time.perf_counter() - t_iter)
            records.append(rec)
            if on_step is not None:
                on_step(rec)
        if records and (last_ckpt is None or records[-1].checkpoint is None):
            ckpt_s, last_ckpt = self._checkpoint()
            last = records[-1]
            records[-1] = LoopRecord(last.step, last.wait_s, last.gather_s, last.publish_block_s,
                                     last.checkpoint_s + ckpt_s, last_ckpt, last.wall_s + ckpt_s)
        return LoopSummary(
            steps=len(records), final_version=tr.version, wall_s=time.perf_counter() - t_start,
            wait_s=sum(r.wait_s for r in records), train_s=sum(r.step.step_time_s for r in records),
            publish_s=sum(r.gather_s + r.publish_block_s for r in records),
            checkpoint_s=sum(r.checkpoint_s for r in records), data_position=self.data_position,
            last_checkpoint=last_ckpt, records=tuple(records))

    def _publish(self) -> tuple[float, float]:
        if self.publisher is None and not self.trainer.weights_collective:
            return 0.0, 0.0
        t0 = time.perf_counter()
        update = self.trainer.weights()          # collective under ZeRO-3
        gather_s = time.perf_counter() - t0
        block_s = self.publisher.publish(update) if self.publisher is not None else 0.0
        return gather_s, block_s

    def _checkpoint(self) -> tuple[float, str | None]:
        if self.checkpoint_root is None:
            return 0.0, None
        t0 = time.perf_counter()
        path = self.trainer.save_checkpoint(self.checkpoint_root / checkpoint_name(self.trainer.version),
                                            data_position=self.data_position)
        return time.perf_counter() - t0, str(path)
