"""The rollout worker: one vLLM engine generating continuously, streaming whole
groups to the replay buffer, taking new weights between engine steps.

The loop (one thread, the only one touching the engine)::

    apply the newest offered weights (if newer)   <- between steps, never mid-step
    ask admission for as many groups as fit       <- global budget (docs/design.md section 2);
                                                     the answer is taken at a later pass
    add n requests per admitted group
    one engine step -> finished sequences
    a group whose n sequences finished -> reward pool (threads) -> GroupSender

Invariants:

- The engine is kept full: while the budget grants groups, the worker keeps
  ``rollout.max_num_seqs`` sequences in flight; it idles (counted in
  ``idle_s``) only when the budget grants nothing or the admitted groups need
  newer weights than it holds (``Admission.min_version``).
- Weight updates never stop or drain a sequence: sequences in flight continue
  under the new weights (KV policy from ``rollout.kv_policy``) and their tokens'
  versions change at the step where the update took effect.
- New weights arrive through vLLM's weight-transfer calls, which the trainer
  makes (``init_weight_transfer_engine`` / ``start_weight_update`` /
  ``update_weights`` / ``finish_weight_update``, forwarded to the engine; per update
  the three in one call, :meth:`RolloutWorker.receive_update`), or as
  an offer through Ray's object store (:meth:`RolloutWorker.offer_weights`).
  Either way they are received, validated and staged (the costly part of a
  reload) in the caller's thread -- any thread but the loop's, e.g. a Ray
  actor's concurrent method -- while the engine keeps stepping; a bad payload
  raises ``WeightUpdateError`` there and is never applied. Only the newest
  staged update is kept; the loop makes it live between two steps.
- Rewards run in a thread pool, off the engine's critical path. A reward
  function that raises (or returns a non-finite value) is logged with the
  prompt id and scores 0; it stops the worker only if it has failed on its
  first ``REWARD_FAILURES_FATAL`` calls without a single success. A send that
  fails (buffer gone, backpressure timeout) stops the worker with that error,
  and so does :meth:`RolloutWorker.fail` (the actor calls it when new weights
  cannot be taken).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np

from pipeline_rl.rollout.engine import (
    EngineConfig,
    FinishedSequence,
    GenerationEngine,
    GenRequest,
    SamplingConfig,
    engine_config,
)
from pipeline_rl.evaluation import EVAL_PREFIX, EvalRequest, EvalResult, PendingEval
from pipeline_rl.evaluation import parse_request_id as parse_eval_request_id
from pipeline_rl.evaluation import request_id as eval_request_id
from pipeline_rl.actors.process import HeapTrimmer
from pipeline_rl.weight_sync.gloo import receive_in_one_call
from pipeline_rl.weight_sync.message import WeightUpdateError, check_update, resolve_offer
from pipeline_rl.config import Config
from pipeline_rl.faults import inject, reached
from pipeline_rl.samples import I32, Completion, Group
from pipeline_rl.tasks.base import Prompt, RewardFn, Task

if TYPE_CHECKING:
    from pipeline_rl.buffer.types import Admission

log = logging.getLogger(__name__)

GROUP_ID_STRIDE = 1 << 40  # group ids: worker_id * stride + local counter (unique per run)
#: A reward function that failed this many times without ever succeeding ends the run.
REWARD_FAILURES_FATAL = 32
#: Applied updates whose stall a worker remembers (``WorkerStats.stall_ms``): a run applies
#: one update per trainer step, so keeping them all would grow the worker (and every stats
#: reply) without bound; a poller that reads the stats once per step needs the last few.
STALL_WINDOW = 256


class RewardFailed(RuntimeError):
    """The task's reward function fails on every call (it never returned a score)."""


class AdmissionSource(Protocol):
    """The global admission budget: the ``ReplayBuffer`` itself, or a Ray-handle adapter.
    ``request`` asks for up to ``max_groups`` grants without blocking the caller: the
    answer comes on the future (the source may wait up to ``timeout_s`` for a non-zero
    grant before answering). ``release`` gives back grants the worker will not use
    (returns the refund)."""

    def request(self, worker_id: int, max_groups: int,
                timeout_s: float = 0.0) -> "Future[Admission]": ...

    def release(self, worker_id: int, count: int) -> int: ...


class SenderLike(Protocol):
    """Where finished groups go (``pipeline_rl.buffer.sender.GroupSender``); thread-safe."""

    def send(self, group: Group) -> None: ...

    def close(self, linger_s: float = 5.0) -> None: ...

    @property
    def wait_s(self) -> float: ...


@dataclass(frozen=True, slots=True)
class AppliedAt:
    """When a worker's engine could first sample with weights ``version`` (``time.time()``)."""

    version: int
    at: float


@dataclass(frozen=True, slots=True)
class WorkerStats:
    """A snapshot of one worker. ``stall_ms``: for the most recent applied updates (at
    most ``STALL_WINDOW``, oldest first), the time no engine step could run;
    ``updates_applied`` counts every applied update, so the ``k`` applied since a
    previous snapshot are ``stall_ms[-k:]`` (when ``k <= STALL_WINDOW``), and
    ``stall_ms_total`` sums the stalls of all of them; ``idle_s``: time the engine
    had nothing to run; ``step_s``: time inside engine steps; ``send_wait_s``: time
    sends were blocked by a full buffer (in the reward/send threads, not the
    engine's); ``heap_trim_s``: time spent handing free heap pages back to the OS
    (``HeapTrimmer``, on the engine's thread between steps); ``applied``: when the most
    recent applied updates went live (at most ``STALL_WINDOW``, oldest first)."""

    worker_id: int
    version: int
    groups_started: int
    groups_sent: int
    tokens_generated: int
    steps: int
    step_s: float
    idle_s: float
    elapsed_s: float
    stall_ms: tuple[float, ...]
    updates_applied: int
    updates_rejected: int
    reward_errors: int
    send_wait_s: float
    in_flight_groups: int
    stall_ms_total: float = 0.0
    heap_trim_s: float = 0.0
    applied: tuple[AppliedAt, ...] = ()

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_generated / self.elapsed_s if self.elapsed_s > 0 else 0.0


@dataclass(slots=True)
class _Pending:
    """A group in flight: its prompt and the sequences finished so far (by index)."""

    group_id: int
    prompt: Prompt
    prompt_ids: tuple[int, ...]
    done: dict[int, FinishedSequence] = field(default_factory=dict)


@dataclass(slots=True)
class _Counters:
    groups_started: int = 0
    groups_sent: int = 0
    tokens: int = 0
    steps: int = 0
    step_s: float = 0.0
    idle_s: float = 0.0
    elapsed_s: float = 0.0
    updates_rejected: int = 0
    reward_errors: int = 0
    reward_ok: int = 0
    updates_applied: int = 0
    stall_ms_total: float = 0.0
    stall_ms: deque[float] = field(default_factory=lambda: deque(maxlen=STALL_WINDOW))
    applied: deque[AppliedAt] = field(default_factory=lambda: deque(maxlen=STALL_WINDOW))


#: How long beyond its hold a stopping worker waits for the answer to its last request.
_ANSWER_WAIT_S = 5.0


class RolloutWorker:
    """See the module docstring. ``engine`` and ``sender`` may be passed in (tests,
    benchmarks); otherwise they are built from ``cfg`` and ``buffer_address``."""

    def __init__(self, cfg: Config, worker_id: int, model_dir: str, buffer_address: str,
                 admission: AdmissionSource, task: Task, *, reward_fn: RewardFn | None = None,
                 eval_task: Task | None = None,
                 engine: GenerationEngine | None = None, sender: SenderLike | None = None,
                 reward_threads: int = 2, poll_s: float = 0.005, acquire_hold_s: float = 0.5,
                 idle_wait_s: float = 0.05, gpu_memory: float | None = None) -> None:
        self.cfg = cfg
        self.worker_id = worker_id
        self.n = cfg.rollout.n
        self._admission = admission
        self._task = task
        self._reward_fn: RewardFn = reward_fn if reward_fn is not None else task.reward
        self._engine = engine if engine is not None else build_engine(
            cfg, model_dir, seed=cfg.seed + worker_id, gpu_memory=gpu_memory)
        self._sender = sender if sender is not None else _connect(buffer_address, worker_id, cfg)
        self._sampling = SamplingConfig(max_new_tokens=cfg.rollout.max_new_tokens,
                                        temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                                        top_k=cfg.rollout.top_k)
        self._pool = ThreadPoolExecutor(max_workers=reward_threads, thread_name_prefix=f"reward-{worker_id}")
        self._futures: set[Future[None]] = set()
        self._pending: dict[int, _Pending] = {}
        self._granted = 0  # admitted groups not started yet
        self._min_version = 0
        self._asking: Future[Admission] | None = None  # the admission request in flight (one at most)
        self._local = 0
        self.poll_s, self.acquire_hold_s, self.idle_wait_s = poll_s, acquire_hold_s, idle_wait_s
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._c = _Counters()
        self._heap = HeapTrimmer()   # free C-heap pages back to the OS every few seconds
        self._eval_task = eval_task
        self._eval_queue: deque[PendingEval] = deque()     # asked for, not started (any thread)
        self._evals: dict[int, PendingEval] = {}           # started (loop thread only)
        self._loop_done = False                            # run() returned (until it runs again)
        self._greedy = SamplingConfig(max_new_tokens=cfg.rollout.max_new_tokens, temperature=0.0)

    # -- control (any thread) -------------------------------------------------------------
    def offer_weights(self, offer: object) -> None:
        """Offer new weights (a ``WeightUpdate`` or ``[ObjectRef]``): fetched and
        validated here, applied by the loop before its next engine step. Raises
        ``WeightUpdateError`` for a bad payload (the served weights stay)."""
        update = resolve_offer(offer)
        inject(self.cfg.fault, "weight_update", update.version)
        try:
            checked = check_update(update, self._engine.weight_spec)
        except WeightUpdateError as e:
            with self._lock:
                self._c.updates_rejected += 1
            log.error("worker %d: rejected weights v%d: %s", self.worker_id, update.version, e)
            raise
        if self._engine.stage(checked):
            self._wake.set()
        else:
            log.info("worker %d: ignoring weights v%d (not newer than v%d)", self.worker_id,
                     update.version, self._engine.version)

    # -- vLLM's weight-transfer calls, made by the trainer (any thread but the loop) ----------
    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Join the trainer's weight channel (a new one replaces the old)."""
        self._engine.init_weight_transfer_engine(init_info)

    def start_weight_update(self) -> None:
        self._engine.start_weight_update()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Receive one update's bytes; a payload that does not fit the model is refused
        here (``WeightUpdateError``), the served weights untouched."""
        try:
            self._engine.update_weights(update_info)
        except WeightUpdateError as e:
            with self._lock:
                self._c.updates_rejected += 1
            log.error("worker %d: rejected weights: %s", self.worker_id, e)
            raise

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """The received update becomes the next weights, labelled ``weight_version``
        (applied by the loop between two steps)."""
        if weight_version is None:
            raise WeightUpdateError("finish_weight_update needs the version of the weights")
        version = int(weight_version)
        inject(self.cfg.fault, "weight_update", version)
        if self._engine.finish_weight_update(version):
            self._wake.set()
        else:
            log.info("worker %d: ignoring weights v%d (not newer than v%d)", self.worker_id,
                     version, self._engine.version)

    def receive_update(self, update_info: dict[str, Any], weight_version: str) -> float:
        """Start, update and finish in one call (what the trainer's channel calls per
        update); the seconds the finish (staging) took."""
        return receive_in_one_call(self, update_info, weight_version)

    def evaluate(self, request: EvalRequest) -> Future[EvalResult]:
        """Evaluate held-out prompts (see ``pipeline_rl.evaluation``) beside
        training generation; the future is set when every answer is scored, or fails
        when the worker stops first. Any thread."""
        if self._eval_task is None:
            raise ValueError(f"worker {self.worker_id}: no evaluation task was given")
        prompts = tuple(self._eval_task.prompt(i) for i in request.prompt_ids)
        pending = PendingEval(request, prompts)
        with self._lock:
            if self._stop.is_set() or self._loop_done:   # no loop will start it: fail now, never hang
                pending.future.set_exception(RuntimeError(f"worker {self.worker_id} is stopped"))
                return pending.future
            self._eval_queue.append(pending)
        self._wake.set()
        return pending.future

    def fail(self, error: BaseException) -> None:
        """Make :meth:`run` raise ``error`` before its next step (the first failure wins)."""
        with self._lock:
            if self._error is None:
                self._error = error
        self._wake.set()

    def stop(self) -> None:
        """Ask :meth:`run` to return after the current step (in-flight groups are dropped,
        evaluations not yet answered fail)."""
        with self._lock:
            self._stop.set()
        self._wake.set()

    def stats(self) -> WorkerStats:
        c = self._c
        with self._lock:
            return WorkerStats(
                worker_id=self.worker_id, version=self._engine.version, groups_started=c.groups_started,
                groups_sent=c.groups_sent, tokens_generated=c.tokens, steps=c.steps, step_s=c.step_s,
                idle_s=c.idle_s, elapsed_s=c.elapsed_s, stall_ms=tuple(c.stall_ms),
                updates_applied=c.updates_applied, stall_ms_total=c.stall_ms_total,
                updates_rejected=c.updates_rejected,
                reward_errors=c.reward_errors, send_wait_s=self._sender.wait_s,
                in_flight_groups=len(self._pending), heap_trim_s=self._heap.trim_s,
                applied=tuple(c.applied))

    # -- the loop (one thread) -----------------------------------------------------------
    def run(self, max_groups: int | None = None) -> WorkerStats:
        """Generate until :meth:`stop` (also when called before ``run``: a stopped
        worker stays stopped), or until ``max_groups`` groups were started and all of
        them were sent. Raises the first send error."""
        start = time.perf_counter()
        with self._lock:
            self._loop_done = False
        try:
            while not self._stop.is_set():
                self._raise_background_error()
                self._apply_offered()
                self._heap.maybe_trim()
                self._start_evals()
                self._admit(max_groups)
                if self._engine.num_unfinished():
                    self._step()
                elif (max_groups is not None and self._c.groups_started >= max_groups
                      and not self._granted and self._asking is None):
                    break
                else:
                    self._idle()
            self._drain()
        finally:
            self._c.elapsed_s += time.perf_counter() - start
            self._release_unstarted()
            self._cancel_evals()
        return self.stats()

    def _release_unstarted(self) -> None:
        """Grants not turned into groups go back to the global budget (else they
        would count as in flight forever and could stall other workers), the answer
        to a request still in flight included."""
        if self._asking is not None:
            try:
                self._take_answer(self._asking.result(timeout=self.acquire_hold_s + _ANSWER_WAIT_S))
            except Exception as e:  # noqa: BLE001 -- a lost answer's grants are refunded as lost
                log.warning("worker %d: admission answer lost at stop: %s", self.worker_id, e)
            self._asking = None
        if self._granted:
            self._admission.release(self.worker_id, self._granted)
            self._granted = 0

    def _step(self) -> None:
        inject(self.cfg.fault, "engine_step", self._engine.version)
        while reached(self.cfg.fault, "engine_hang", self._engine.version) and not self._stop.is_set():
            self._stop.wait(0.1)
        t = time.perf_counter()
        finished = self._engine.step()
        dt = time.perf_counter() - t
        with self._lock:
            self._c.steps += 1
            self._c.step_s += dt
        for seq in finished:
            self._collect(seq)

    def _idle(self) -> None:
        t = time.perf_counter()
        self._wake.wait(self.poll_s)
        self._wake.clear()
        with self._lock:
            self._c.idle_s += time.perf_counter() - t

    def _apply_offered(self) -> None:
        applied = self._engine.apply_staged()
        if applied is None:
            return
        with self._lock:
            self._c.stall_ms.append(applied.stall_s * 1e3)
            self._c.stall_ms_total += applied.stall_s * 1e3
            self._c.applied.append(AppliedAt(applied.version, applied.live_at or time.time()))
            self._c.updates_applied += 1
        log.info("worker %d: weights v%d applied in %.1f ms, %d sequences in flight", self.worker_id,
                 applied.version, applied.stall_s * 1e3, applied.in_flight)

    def _admit(self, max_groups: int | None) -> None:
        """Ask for as many groups as the engine has room for, start those the held
        weights are recent enough for. Rounds up: a group is admitted as soon as one
        slot is free (its other sequences wait in vLLM's queue for the next free
        slots), so the engine never runs below ``max_num_seqs`` while work is allowed.

        One request at a time, and it never blocks the loop: the buffer holds it until
        the budget has room (the moment the trainer's version moves) or ``acquire_hold_s``
        passed, and the answer is taken at a later pass while the engine keeps stepping.
        Only with nothing to step does the loop wait for the answer (``idle_wait_s`` at a
        time, counted as idle): no polling, no latency lost to it at any staleness."""
        self._poll_answer(0.0)
        free = self.cfg.rollout.max_num_seqs - self._engine.num_unfinished()
        room = -(-free // self.n) - self._granted
        if max_groups is not None:
            room = min(room, max_groups - self._c.groups_started - self._granted)
        if room > 0 and self._asking is None:
            self._asking = self._admission.request(self.worker_id, room, self.acquire_hold_s)
        if self._asking is not None and not self._engine.num_unfinished() and not self._granted:
            t = time.perf_counter()
            self._poll_answer(self.idle_wait_s)
            with self._lock:
                self._c.idle_s += time.perf_counter() - t
        while self._granted and self._engine.version >= self._min_version:
            self._start_group()
            self._granted -= 1

    def _poll_answer(self, wait_s: float) -> None:
        """Take the answer to the request in flight if it comes within ``wait_s``.
        Raises the request's error (the buffer is gone)."""
        if self._asking is None:
            return
        try:
            adm = self._asking.result(timeout=wait_s)
        except TimeoutError:
            return
        self._asking = None
        self._take_answer(adm)

    def _take_answer(self, adm: Admission) -> None:
        # Grants still held keep their own (older, lower) bound satisfied by a
        # higher one; a lower bound may only replace it once none is held.
        self._min_version = (adm.min_version if not self._granted
                             else max(self._min_version, adm.min_version))
        self._granted += adm.granted

    def start_at(self, counter: int) -> None:
        """Continue group ids and prompts from ``counter`` (a restarted or resumed worker
        must not reuse the group ids, or repeat the prompts, of its previous life)."""
        if not 0 <= counter < GROUP_ID_STRIDE:
            raise ValueError(f"group counter {counter} outside [0, {GROUP_ID_STRIDE})")
        self._local = counter

    def _start_group(self) -> None:
        local = self._local
        self._local += 1
        group_id = self.worker_id * GROUP_ID_STRIDE + local
        prompt = self._task.prompt(local * self.cfg.rollout.num_workers + self.worker_id)
        # A chat template writes its own special tokens (BOS included) into the text.
        prompt_ids = tuple(self._engine.encode(prompt.text, add_special_tokens=not prompt.templated))
        self._pending[group_id] = _Pending(group_id, prompt, prompt_ids)
        self._engine.add_copies([f"{group_id}:{i}" for i in range(self.n)], prompt_ids, self._sampling)
        with self._lock:
            self._c.groups_started += 1

    def _start_evals(self) -> None:
        """Add the sequences of newly asked-for evaluations to the engine."""
        while True:
            with self._lock:
                if not self._eval_queue:
                    return
                pending = self._eval_queue.popleft()
            req = pending.request
            self._evals[req.eval_id] = pending
            for i, prompt in enumerate(pending.prompts):
                ids = tuple(self._engine.encode(prompt.text, add_special_tokens=not prompt.templated))
                self._engine.add(GenRequest(eval_request_id(req.eval_id, i, 0), ids, self._greedy))
                for j in range(1, req.k + 1):
                    self._engine.add(GenRequest(eval_request_id(req.eval_id, i, j), ids, self._sampling))

    def _collect_eval(self, seq: FinishedSequence) -> None:
        eval_id, i, j = parse_eval_request_id(seq.request_id)
        pending = self._evals[eval_id]
        if pending.add(i, j, seq.text, int(seq.token_ids.shape[0]), seq.versions):
            del self._evals[eval_id]
            fut = self._pool.submit(self._score_eval, pending)
            self._futures.add(fut)
            fut.add_done_callback(self._on_sent)

    def _score_eval(self, pending: PendingEval) -> None:
        try:
            result = pending.score(self._reward, self._engine.version)
        except BaseException as e:
            pending.future.set_exception(e)
            raise
        pending.future.set_result(result)

    def _cancel_evals(self) -> None:
        with self._lock:
            self._loop_done = True
            waiting = list(self._eval_queue) + list(self._evals.values())
            self._eval_queue.clear()
        self._evals.clear()
        for pending in waiting:
            if not pending.future.done():
                pending.future.set_exception(RuntimeError(f"worker {self.worker_id} stopped during an evaluation"))

    def _collect(self, seq: FinishedSequence) -> None:
        if seq.request_id.startswith(EVAL_PREFIX):
            self._collect_eval(seq)
            return
        gid, idx = (int(x) for x in seq.request_id.split(":"))
        group = self._pending[gid]
        group.done[idx] = seq
        with self._lock:
            self._c.tokens += seq.token_ids.shape[0]
        if len(group.done) == self.n:
            del self._pending[gid]
            fut = self._pool.submit(self._score_and_send, group)
            self._futures.add(fut)
            fut.add_done_callback(self._on_sent)

    # -- reward and send (pool threads) -------------------------------------------------
    def _score_and_send(self, pending: _Pending) -> None:
        completions = tuple(
            Completion(token_ids=s.token_ids, logprobs=s.logprobs, versions=s.versions,
                       reward=self._reward(pending.prompt, s.text), finish_reason=s.finish_reason)
            for s in (pending.done[i] for i in range(self.n)))
        group = Group(group_id=pending.group_id, prompt_id=pending.prompt.prompt_id,
                      worker_id=self.worker_id,
                      prompt_ids=_i32(pending.prompt_ids), completions=completions)
        self._sender.send(group)
        with self._lock:
            self._c.groups_sent += 1

    def _reward(self, prompt: Prompt, completion: str) -> float:
        try:
            value = float(self._reward_fn(prompt.text, completion, prompt))
            if not math.isfinite(value):
                raise ValueError(f"non-finite reward {value}")
            with self._lock:
                self._c.reward_ok += 1
            return value
        except Exception as e:  # a user's reward function must never kill the worker...
            with self._lock:
                self._c.reward_errors += 1
                hopeless = not self._c.reward_ok and self._c.reward_errors >= REWARD_FAILURES_FATAL
            log.warning("worker %d: reward function failed on prompt %d (scored 0): %s: %s",
                        self.worker_id, prompt.prompt_id, type(e).__name__, e)
            if hopeless:  # ...unless it has never once worked: then nothing can be learned
                self.fail(RewardFailed(f"the reward function failed on all of its first "
                                       f"{REWARD_FAILURES_FATAL} calls; last: {type(e).__name__}: "
                                       f"{str(e).splitlines()[0] if str(e) else ''}"))
            return 0.0

    def _on_sent(self, fut: Future[None]) -> None:
        with self._lock:
            self._futures.discard(fut)
            err = fut.exception()
            if err is not None and self._error is None:
                self._error = err
        if err is not None:
            self._wake.set()

    def _raise_background_error(self) -> None:
        if self._error is not None:
            raise self._error

    def _drain(self) -> None:
        """Wait for the groups handed to the pool to be scored and sent."""
        while True:
            with self._lock:
                futures = list(self._futures)
            if not futures:
                break
            for f in futures:
                f.result()
        self._raise_background_error()

    def close(self, *, close_engine: bool = True) -> None:
        """Stop, release the pool, the sender and (unless told not to: a shared
        engine) the engine."""
        self.stop()
        if self._pending:  # started, never to be sent
            self._admission.release(self.worker_id, len(self._pending))
            self._pending.clear()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._sender.close()
        if close_engine:
            self._engine.close()


def build_engine(cfg: Config, model_dir: str, *, seed: int = 0,
                 gpu_memory: float | None = None) -> GenerationEngine:
    """Start the engine ``cfg.rollout.engine`` names on this machine's device: the
    ``AsyncLLM`` engine on CUDA (present, or asked for), the in-process one on CPU
    unless the async one is asked for. ``gpu_memory``: the share of a GPU shared with
    other actors that vLLM may take."""
    device = resolve_device(cfg.model.device)
    ecfg = engine_config(cfg.rollout, model_dir, seed=seed, device=device, gpu_memory=gpu_memory,
                         fault=cfg.fault)
    if device == "cuda" and cfg.rollout.engine == "inprocess":
        raise ValueError("--rollout.engine inprocess runs on CPU only; use async (or auto) on CUDA")
    if device == "cuda" or cfg.rollout.engine == "async":
        from pipeline_rl.rollout.engine_async import AsyncEngine

        return AsyncEngine(ecfg)
    from pipeline_rl.rollout.engine_inprocess import InprocessEngine

    return InprocessEngine(ecfg)


def resolve_device(device: Literal["auto", "cpu", "cuda"]) -> Literal["cpu", "cuda"]:
    """``auto``: CUDA when this process sees a GPU, else CPU."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _connect(address: str, worker_id: int, cfg: Config) -> SenderLike:
    from pipeline_rl.buffer.sender import GroupSender

    return GroupSender(address, worker_id, cfg.buffer.send_timeout_s)


def _i32(ids: tuple[int, ...]) -> I32:
    return np.asarray(ids, dtype=np.int32)
