"""The DeepSpeed trainer: batches of groups -> corrected policy-gradient step -> new weights.

One :class:`Trainer` per data-parallel rank. A step (docs/design.md):

1. advantages per group (``pipeline_rl.correction.advantages``),
2. sequences padded into micro-batches (``pipeline_rl.training.batching``; pad, not pack), each
   group's prompt held once per block of micro-batches (``trainer.share_prompts``, the
   default: the prompts run once, the completions on top of their KV cache; see
   :func:`shared_prompt_logp` and ``pipeline_rl.training.accumulate``),
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

``training.rank_step.RankStep`` is what a rank does per pipeline step, wherever it runs: take the next batch
as soon as the buffer can give one (never a whole generation round), recording the wait
(trainer idle time), step, publish the weights (``pipeline_rl.weight_sync.publish.publisher``), open the
buffer's admission budget for the next version. A rank's parts (device, process group, engine,
writer, schedule, EMA, reference, gradient-norm hook), one function each and built in a fixed
order: ``training.parts``; DeepSpeed set-up: ``training.deepspeed_setup``.
"""

from __future__ import annotations

import logging
import shutil
import time
from functools import partial
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from pipeline_rl.training.accumulate import accumulate
from pipeline_rl.training.batching import (
    AnyMicroBatch, build_micro_batches, build_shared_prompt_batches, lag_stats, sum_over_ranks,
)
from pipeline_rl.training.checkpoint import (
    DEEPSPEED_DIR, DEEPSPEED_TAG, CheckpointError, RunState, capture_rng,
    load_rng, partial_dir, read_run_state, rng_file,
)
from pipeline_rl.training.checkpoint_writer import Staging, finish_part, write_weights
from pipeline_rl.training.ema import EMA_DIR
from pipeline_rl.training.lora import adapter_disabled, trained_weights
from pipeline_rl.training.logprobs import (
    micro_batch_logp, padded_logp, sampled_entropy, shared_prompt_logp,
    sharing_check_groups,
)
from pipeline_rl.training.optimizers import step_context
from pipeline_rl.training.parts import (
    check_rank, checkpoint_writer, join_process_group, lr_schedule, moving_average, place_rank, record_grad_norm,
    reference_model, skip_lone_allreduce, start_engine, trained_model,
)
from pipeline_rl.reports import LossMetrics, StepResult
from pipeline_rl.weight_sync.publish.gather import gather_weights
from pipeline_rl.weight_sync.dtypes import served_dtype
from pipeline_rl.weight_sync.message import WeightUpdate
from pipeline_rl.config import Config
from pipeline_rl.faults import kill_here, reached
from pipeline_rl.correction.advantages import group_advantages
from pipeline_rl.correction.loss import loss_normalizer, warm_up
from pipeline_rl.samples import Group

log = logging.getLogger(__name__)


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
                 num_threads: int | None = 1, gpu_memory: float | None = None) -> None:
        check_rank(cfg, rank, world_size)
        self.cfg = cfg
        self.model_dir = Path(model_dir)
        self.rank, self.world_size = rank, world_size
        self.device = place_rank(cfg.model.device, rank, num_threads=num_threads, gpu_memory=gpu_memory)
        join_process_group(self.device, rank, world_size, master_addr, master_port)
        self.trained = trained_weights(cfg.lora)   # every weight, or (LoRA) PEFT's adapter alone
        self.model = trained_model(cfg, self.model_dir, self.device.type, self.trained)
        self.engine = start_engine(cfg, self.model, world_size, self.device.type)
        self.zero_stage = cfg.trainer.zero_stage
        self._staging = Staging()           # the host memory a save's copy goes into
        self.writer = checkpoint_writer(self.engine, rank, world_size, self._staging)
        self.lr_schedule = lr_schedule(cfg, self.engine)
        self.ema = moving_average(cfg, self.engine, rank)
        skip_lone_allreduce(self.engine, world_size, self.zero_stage)
        self.pad_id = int(self.model.config.pad_token_id or 0)
        self._kl = cfg.algorithm.kl_coef > 0   # with LoRA the reference is the model with its adapter off
        self.ref_model = reference_model(cfg, self.model_dir, self.device, self.trained)
        self._version = 0
        self._steps_taken = 0
        self._grad_norm = record_grad_norm(self.engine, world_size, self.zero_stage)
        # the loss kernel's one-time load (~0.4 s) happens here, while the workers start,
        # instead of in the run's first step
        warm_up(cfg.algorithm, cfg.correction, self.device.type)
        self.share_prompts = self._shares_prompts()

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

    # -- the step ------------------------------------------------------------------------------

    def step(self, groups: Sequence[Group]) -> StepResult:
        """One training step on this rank's share of the batch; collective across ranks."""
        if not groups:
            raise ValueError("trainer.step: empty batch")
        t0 = time.perf_counter()
        algo = self.cfg.algorithm
        lag = lag_stats(groups, self._version)
        advantages = group_advantages(algo.advantage, groups,   # a batch estimator: over every rank's groups
                                      partial(sum_over_ranks, world_size=self.world_size, device=self.device))
        mbs = [mb.to(self.device) for mb in self._micro_batches(groups, advantages)]
        norm = self._global_normalizer(mbs) / self.world_size
        ref = [self._ref_logp(mb) for mb in mbs] if self._kl else None
        epochs = algo.ppo_epochs if algo.loss != "reinforce" else 1   # every ratio objective
        # PPO's proximal policy is the trainer at the start of the batch: None in the first
        # epoch (the loss then uses logp detached), that epoch's log-probs afterwards.
        prox: list[torch.Tensor] | None = None
        first: tuple[float, LossMetrics] | None = None
        entropy = 0.0
        lr = self.lr_schedule.set(self._version)
        for _ in range(epochs):
            loss_sum, logps, parts = self._accumulate(mbs, norm, prox, ref)
            with step_context(self.cfg, self.device.type):
                self.engine.step()
            if self.ema is not None:
                self.ema.update()
            self._steps_taken += 1
            if first is None:
                # each rank's loss is scaled by world_size (see norm above): undo for the report
                first = (self._all_reduce_sum(loss_sum) / self.world_size, LossMetrics.merge(parts))
                prox = logps
                entropy = sampled_entropy(logps, [mb.mask for mb in mbs])
        assert first is not None
        self._version += 1  # one version per batch, however many PPO epochs it had
        # ZeRO-0 fp32: recorded by the clip hook; otherwise (ZeRO 1-3, and DeepSpeed's bf16
        # optimizer, which clips by itself) the engine reports it
        grad_norm = self._grad_norm.last if self._grad_norm.last is not None else self.engine.get_global_grad_norm()
        rewards = [c.reward for g in groups for c in g.completions]
        real = sum(mb.num_real_tokens for mb in mbs)
        return StepResult(
            version=self._version, loss=first[0], metrics=first[1],
            step_time_s=time.perf_counter() - t0,
            num_tokens=int(sum(mb.num_completion_tokens for mb in mbs)),
            num_seqs=sum(mb.num_seqs for mb in mbs), num_groups=len(groups),
            num_micro_batches=len(mbs), lag=lag, mixed_version_frac=lag.mixed_version_frac,
            reward_mean=float(np.mean(rewards)) if rewards else 0.0,
            pad_frac=1.0 - real / max(1, sum(mb.num_slots for mb in mbs)),
            grad_norm=None if grad_norm is None else float(grad_norm), entropy=entropy, lr=lr)

    def _micro_batches(self, groups: Sequence[Group], advantages: Sequence[np.ndarray]) -> list[AnyMicroBatch]:
        """The batch in the layout this trainer runs (shared prompts or padded rows). Under
        ZeRO-3 chunked by rows only, with no token budget or pass cost: every rank must run
        the same number of forward passes (each gathers the parameters collectively), which
        row-only chunking of equal shares guarantees."""
        build = build_shared_prompt_batches if self.share_prompts else build_micro_batches
        t = self.cfg.trainer
        rows_only = t.zero_stage >= 3
        return list(build(groups, advantages, micro_batch_size=t.micro_batch_size,
                          max_tokens=0 if rows_only else t.micro_batch_tokens,
                          pass_tokens=0 if rows_only else t.pass_cost_tokens, pad_id=self.pad_id))

    def _shares_prompts(self) -> bool:
        """Whether this trainer runs shared prompts: asked for (``trainer.share_prompts``), not
        under ZeRO-3 nor gradient checkpointing (Hugging Face drops a layer's KV cache under
        it), and the model passes :meth:`_sharing_works`."""
        t = self.cfg.trainer
        return t.share_prompts and self.zero_stage < 3 and not t.gradient_checkpointing and self._sharing_works()

    def _sharing_works(self) -> bool:
        """Whether this model gives the same log-probs with shared prompts as padded rows,
        checked once on a tiny batch (prompts of 3 and 5 tokens, completions of 1-3). A
        model whose cache is not a plain per-layer KV cache (sliding windows, state-space
        layers) or that ignores ``position_ids`` fails it: it then trains on padded rows
        (one warning line)."""
        groups = sharing_check_groups(int(self.model.config.vocab_size))
        zeros = [np.zeros(len(g.completions), dtype=np.float32) for g in groups]
        padded = build_micro_batches(groups, zeros, micro_batch_size=8)[0].to(self.device)
        shared = build_shared_prompt_batches(groups, zeros, micro_batch_size=8)[0].to(self.device)
        temperature = self.cfg.rollout.temperature
        try:
            with torch.no_grad():
                a = padded_logp(self.model, padded, temperature)[padded.index.argsort()]   # rows in flat order
                b = shared_prompt_logp(self.model, shared, temperature)[shared.index.argsort()]
                a, b = a[padded.mask[padded.index.argsort()] > 0], b[shared.mask[shared.index.argsort()] > 0]
        except Exception as e:  # an architecture the continuation does not fit
            log.warning("trainer: prompts not shared (padded rows instead): %s: %s",
                        type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            return False
        diff = float((a.float() - b.float()).abs().max())
        tol = 1e-3 if self.cfg.model.trainer_dtype(self.device.type) == "float32" else 0.1
        if not diff <= tol:
            log.warning("trainer: prompts not shared (padded rows instead): log-probs differ by "
                        "%.3g with shared prompts on this model (tolerance %g)", diff, tol)
            return False
        return True

    def _accumulate(self, mbs: Sequence[AnyMicroBatch], norm: float, prox: Sequence[torch.Tensor] | None,
                    ref: Sequence[torch.Tensor] | None) -> tuple[float, list[torch.Tensor], list[LossMetrics]]:
        """Forward + loss + backward over every micro-batch (gradients accumulate; no step;
        ``pipeline_rl.training.accumulate``). Returns the summed loss, the detached log-probs
        and the per-micro-batch metrics."""
        done = accumulate(self.engine, self.cfg, mbs, norm, prox, ref)
        return done.loss_sum, done.logps, done.parts

    def _token_logp(self, mb: AnyMicroBatch, *, grad: bool) -> torch.Tensor:
        """log π(token) at the sampling temperature, laid out like ``mb.mask``."""
        with torch.set_grad_enabled(grad):
            return micro_batch_logp(self.engine, mb, self.cfg.rollout.temperature)

    @torch.no_grad()
    def _ref_logp(self, mb: AnyMicroBatch) -> torch.Tensor:
        if self.ref_model is None:   # LoRA: the same model, its adapter off
            with adapter_disabled(self.engine.module):
                return micro_batch_logp(self.engine, mb, self.cfg.rollout.temperature)
        return micro_batch_logp(self.ref_model, mb, self.cfg.rollout.temperature)

    def _global_normalizer(self, mbs: Sequence[AnyMicroBatch]) -> float:
        """Loss normaliser N of the whole batch: summed over micro-batches and ranks."""
        local = sum(float(loss_normalizer(mb.mask, self.cfg.algorithm)) for mb in mbs)
        return self._all_reduce_sum(local)

    def _all_reduce_sum(self, value: float) -> float:
        return float(sum_over_ranks(np.array([value]), self.world_size, self.device)[0])

    # -- inspection ----------------------------------------------------------------------------

    @torch.no_grad()
    def logprobs(self, groups: Sequence[Group]) -> list[list[np.ndarray]]:
        """The trainer's log-probs of every completion token under the current weights, at the
        sampling temperature: ``out[g][c]`` has one value per model token of completion ``c`` of
        group ``g`` (an episode's environment tokens have none). Collective under ZeRO-3."""
        zeros = [np.zeros(len(g.completions), dtype=np.float32) for g in groups]
        flat: dict[int, np.ndarray] = {}
        for mb in self._micro_batches(groups, zeros):
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

    def weights(self, version: int | None = None, allocate: Callable[[int], np.ndarray] | None = None,
                on_device: bool = False) -> WeightUpdate:
        """Full parameters in the engines' dtype, or with LoRA the adapter's only (ZeRO-3: a
        collective); see ``gather_weights``."""
        if version is not None and version != self._version:
            raise ValueError(f"trainer.weights: asked for version {version}, trainer is at {self._version}")
        return gather_weights(self.engine.module, self._version, zero_stage=self.zero_stage,
                              dtype=served_dtype(self.cfg.rollout.dtype, self.device.type), allocate=allocate,
                              on_device=on_device,
                              named=self.trained.published(self.engine.module))

    # -- checkpoints ---------------------------------------------------------------------------

    def save_checkpoint(self, path: str | Path, background: bool = False) -> Path:
        """Write a complete checkpoint to ``path`` (see ``pipeline_rl.training.checkpoint``); a
        collective. Its run state holds the version and the groups trained so far
        (``version * groups_per_step``). Multi-rank runs need ``path`` on a filesystem every
        rank sees. ``background``: return once the state is copied; the copy is written on
        this rank's writer thread (``training.checkpoint_writer``) and ``path`` appears when
        every rank has written its part (:meth:`wait_for_checkpoints`)."""
        import torch.distributed as dist

        self.writer.wait()   # the previous save is written (or its failure raised) first
        saved_at = time.perf_counter()
        final = Path(path)
        part = partial_dir(final)
        if self.rank == 0:
            shutil.rmtree(part, ignore_errors=True)
            part.mkdir(parents=True)
        dist.barrier()
        # DeepSpeed's files: copied now, written by the writer (checkpoint_writer.background_engine)
        self.engine.save_checkpoint(str(part / DEEPSPEED_DIR), tag=DEEPSPEED_TAG, save_latest=False,
                                    exclude_frozen_parameters=self.trained.frozen_base)
        update = self.weights(allocate=self._staging.array("weights"))   # copies
        ema = self._staging.copy(self.ema.state_dict(), "ema") if self.ema is not None else None
        rng, version = capture_rng(), self._version
        state = RunState(version=version, data_position=version * self.cfg.groups_per_step,
                         world_size=self.world_size, zero_stage=self.zero_stage)

        def write_the_rest() -> None:
            if self.rank == 0:
                write_weights(part, self.engine.module, update, self.trained, self.model_dir)
                if self.ema is not None:
                    self.ema.save(part / EMA_DIR, self.model_dir, state=ema)   # ema: its copy
            torch.save(rng, rng_file(part, self.rank))
            kill_here(self.cfg.fault, "checkpoint_write", version)   # a fault test's mid-save death
            finish_part(part, final, self.rank, self.world_size, state)
            log.info("checkpoint %s: part written %.1f s after the save", final.name, time.perf_counter() - saved_at)

        self.writer.submit(part, write_the_rest)
        if not background or reached(self.cfg.fault, "checkpoint_write", version):
            self.writer.wait()   # (a fault test dies inside this write, before the next step)
            dist.barrier()
        return final

    def wait_for_checkpoints(self, timeout_s: float | None = None) -> None:
        """Return once this rank's background checkpoint writes are done; a failed one raises
        :class:`CheckpointError` (one line)."""
        self.writer.wait(timeout_s)

    def load_checkpoint(self, path: str | Path) -> RunState:
        """Restore weights, optimizer, scheduler, version and RNG from a checkpoint; returns its
        run state. Call it before the first step (ZeRO-3 needs an
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
                                                    load_module_strict=not self.trained.frozen_base)
        except Exception as e:
            first = str(e).splitlines()[0] if str(e) else "unreadable"
            raise CheckpointError(f"checkpoint {d}: DeepSpeed state is corrupt ({type(e).__name__}: {first})") from None
        if loaded is None:
            raise CheckpointError(f"checkpoint {d}: DeepSpeed state {DEEPSPEED_DIR}/{DEEPSPEED_TAG} not found")
        load_rng(d, self.rank)
        if self.ema is not None:
            self.ema.load(d)
        self._version = state.version
        return state

    def close(self, write_timeout_s: float = 60.0) -> None:
        """Let checkpoint writes finish (up to ``write_timeout_s``), release the engine (the
        process group stays: one per process)."""
        self.writer.close(write_timeout_s)
        self.engine.destroy()


# ------------------------------------------------------------------------------------------------
# Continuous consumption
