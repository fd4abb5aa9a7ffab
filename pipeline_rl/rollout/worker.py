"""The rollout worker: one vLLM engine generating continuously, streaming whole
groups to the replay buffer, taking new weights between engine steps.

The loop (one thread, the only one touching the engine)::

    apply the newest offered weights (if newer)   <- between steps, never mid-step
    ask admission for as many groups as fit       <- global budget (docs/design.md section 2);
                                                     the answer is taken at a later pass
    start n copies per admitted group             <- the rollout driver (rollout_driver.py)
    one engine step -> finished sequences -> the episodes awaiting them go on
    a group whose n episodes finished -> rewards (their own thread, scoring.py) -> GroupSender

Every rollout has one shape (``rollout/rollout_shape.py``): an async function from a prompt
to a finished episode, run by one driver. A single-turn completion is one request
(``rollout/single_turn.py``); with an environment (``--task.env``, or a multi-turn task's
own) an episode's finished turns go to its environment off the loop, and its next turn is
added when the reply is in (``rollout/episodes.py``); with an agent (``--task.agent``), an
agent call whose requests the loop adds (``rollout/agents/runner.py``).

Invariants:

- The engine is kept full: while the budget grants groups, the worker keeps
  ``rollout.max_num_seqs`` sequences in flight; it idles (counted in
  ``idle_s``) only when the budget grants nothing or the admitted groups need
  newer weights than it holds (``Admission.min_version``).
- Weight updates never stop or drain a sequence: sequences in flight continue
  under the new weights (KV policy from ``rollout.kv_policy``) and their tokens'
  versions change at the step where the update took effect.
- New weights arrive through vLLM's weight-transfer calls the trainer makes, on every path
  (:meth:`RolloutWorker.receive_update`; in memory, :meth:`RolloutWorker.offer_weights`, the
  same calls). They are received, validated and staged in the caller's thread while the
  engine keeps stepping; a bad payload raises ``WeightUpdateError``, never applied. Only the
  newest staged update is kept; the loop makes it live between two steps.
- Rewards run off the engine's critical path (``pipeline_rl.rollout.scoring``). A send
  that fails stops the worker with that error, and so does :meth:`RolloutWorker.fail`
  (the actor calls it when new weights cannot be taken).
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
from concurrent.futures import Future
from typing import Any

from pipeline_rl.rollout.agents.runner import AgentRollout
from pipeline_rl.rollout.engines.engine import FinishedSequence, GenerationEngine, SamplingConfig
from pipeline_rl.rollout.engines.engine_factory import build_engine
from pipeline_rl.rollout.episodes import EnvRollout
from pipeline_rl.rollout.rollout_driver import RolloutDriver
from pipeline_rl.rollout.rollout_shape import Rollout
from pipeline_rl.rollout.single_turn import SingleTurn
from pipeline_rl.rollout.admission_client import Grants
from pipeline_rl.rollout.ports import AdmissionSource, SenderLike, connect_sender
from pipeline_rl.run_key import RunKey, endpoint_token, rendezvous_secret
from pipeline_rl.rollout.scoring import Scorer, reward_source
from pipeline_rl.rollout.worker_stats import AppliedAt, Counters, WorkerStats
from pipeline_rl.rollout.eval_feed import STREAM_SHARE, EvalFeed, EvalRequest, EvalResult, PendingEval
from pipeline_rl.rollout.request_key import RequestKey
from pipeline_rl.heap import HeapTrimmer
from pipeline_rl.weight_sync.protocol import receive_in_one_call
from pipeline_rl.weight_sync.layout import UpdateLayout
from pipeline_rl.weight_sync.message import WeightUpdate, WeightUpdateError
from pipeline_rl.weight_sync.channels.shm import OfferSegment
from pipeline_rl.config import Config
from pipeline_rl.faults import inject, reached
from pipeline_rl.tasks.base import Prompt, RewardFn, Task
from pipeline_rl.tasks.env import resolve_env, task_env_factory

log = logging.getLogger(__name__)

GROUP_ID_STRIDE = 1 << 40  # group ids: worker_id * stride + local counter (unique per run)

_ANSWER_WAIT_S = 5.0  # how long beyond its hold a stopping worker waits for its last answer


class RolloutWorker:
    """See the module docstring. ``engine`` and ``sender`` may be passed in (tests,
    benchmarks); otherwise they are built from ``cfg`` and ``buffer_address``.
    ``key``: the run key, proved to the buffer and the trainer's weight channels, and the
    agents' endpoint token's source (None: outside a run, ``run_key.endpoint_token``)."""

    def __init__(self, cfg: Config, worker_id: int, model_dir: str, buffer_address: str,
                 admission: AdmissionSource, task: Task, *, reward_fn: RewardFn | None = None, eval_task: Task | None = None,
                 engine: GenerationEngine | None = None, sender: SenderLike | None = None,
                 poll_s: float = 0.005, acquire_hold_s: float = 0.5,
                 idle_wait_s: float = 0.05, gpu_memory: float | None = None, key: RunKey | None = None) -> None:
        self.cfg, self.worker_id, self.n = cfg, worker_id, cfg.rollout.n
        self._admission, self._task = admission, task
        self._engine = engine if engine is not None else build_engine(
            cfg, model_dir, seed=cfg.seed + worker_id, gpu_memory=gpu_memory,
            rendezvous_secret=rendezvous_secret(key))
        self._sender = sender if sender is not None else connect_sender(buffer_address, worker_id, cfg, key)
        self._sampling = SamplingConfig(max_new_tokens=cfg.rollout.max_new_tokens,
                                        temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                                        top_k=cfg.rollout.top_k)
        self._grants = Grants(admission, worker_id, acquire_hold_s)
        self._local = 0
        self.poll_s, self.acquire_hold_s, self.idle_wait_s = poll_s, acquire_hold_s, idle_wait_s
        self._lock, self._wake, self._stop = threading.Lock(), threading.Event(), threading.Event()
        self._error: BaseException | None = None
        self._c = Counters()
        self._scorer = Scorer(worker_id, self.n, cfg.task, reward_source(cfg.task, task, reward_fn),
                              self._sender, self._c, self._lock, self.fail,
                              give_back=lambda k: self._admission.release(worker_id, k))
        self._heap = HeapTrimmer()   # free C-heap pages back to the OS every few seconds
        self._offers = OfferSegment()   # in-memory offers enter the weight calls through it
        self._eval_task, self._evals = eval_task, EvalFeed(int(cfg.rollout.max_num_seqs * STREAM_SHARE))
        self._loop_done = False                            # run() returned (until it runs again)
        self._not_running = threading.Event()              # no generation loop runs now
        self._not_running.set()
        self.ended_on_request = False                      # end_loop() ended the loop (run() raised for it)
        self._greedy = SamplingConfig(max_new_tokens=cfg.rollout.max_new_tokens, temperature=0.0)
        rollout = self._rollout_of(task, key)
        self._driver = RolloutDriver(rollout, self._engine, self.n, self._scorer, self._c, self._lock, self._wake.set,
                                     self._answered, rollout if isinstance(rollout, AgentRollout) else None)

    def _rollout_of(self, task: Task, key: RunKey | None) -> Rollout:
        """The task's rollout: an agent's (``--task.agent``), an environment's (``--task.env``, or
        a multi-turn task's own), else a single turn."""
        cfg = self.cfg

        def failed(line: str, timeout: bool) -> None:   # an environment's or an agent's failure
            self._scorer.failure(line, env=True, timeout=timeout)

        if cfg.task.agent:
            return AgentRollout(cfg, cfg.task.agent, self._engine, str(self.worker_id), endpoint_token(key),
                                self._wake.set, failed, self._c, self._lock, self.fail)
        factory = resolve_env(cfg.task.env) if cfg.task.env else task_env_factory(task)
        if factory is not None:
            return EnvRollout(factory, cfg.task, self._engine, cfg.rollout.max_model_len, str(self.worker_id), failed)
        return SingleTurn()

    # -- control (any thread) -------------------------------------------------------------
    def offer_weights(self, update: WeightUpdate) -> None:
        """Offer new weights held in memory (tests, one-process tools): laid out in this
        worker's own segment, taken through the same calls as the trainer's (checked here,
        applied by the loop between steps); a bad payload raises ``WeightUpdateError`` (the
        served weights stay)."""
        try:
            UpdateLayout.of(update)   # what cannot even be laid out; update_weights refuses the rest
        except WeightUpdateError as e:
            self._rejected(e)
            raise
        self._offers.offer(self, update)

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
            self._rejected(e)
            raise

    def _rejected(self, error: WeightUpdateError) -> None:
        with self._lock:
            self._c.updates_rejected += 1
        log.error("worker %d: rejected weights: %s", self.worker_id, error)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """The received update becomes the next weights, labelled ``weight_version``
        (applied by the loop between two steps)."""
        if weight_version is None:
            raise WeightUpdateError("finish_weight_update needs the version of the weights")
        version = int(weight_version)
        inject(self.cfg.fault, "weight_update", version)
        if self._engine.load_received(version):
            self._wake.set()
        else:
            log.info("worker %d: ignoring weights v%d (not newer than v%d)", self.worker_id,
                     version, self._engine.version)

    def receive_update(self, update_info: dict[str, Any], weight_version: str) -> float:
        """Start, update and finish in one call (what the trainer's channel calls per
        update); the seconds the finish (staging) took."""
        return receive_in_one_call(self, update_info, weight_version)

    def evaluate(self, request: EvalRequest) -> Future[EvalResult]:
        """Evaluate held-out prompts (``pipeline_rl.rollout.eval_feed``) beside training; the future is
        set when every answer is scored, or fails when the worker stops first. Any thread."""
        if self._eval_task is None:
            raise ValueError(f"worker {self.worker_id}: no evaluation task was given")
        prompts = tuple(self._eval_task.prompt(i) for i in request.prompt_ids)
        pending = PendingEval(request, prompts)
        with self._lock:
            if self._stop.is_set() or self._loop_done:   # no loop will start it: fail now, never hang
                pending.future.set_exception(RuntimeError(f"worker {self.worker_id} is stopped"))
                return pending.future
            self._evals.ask(pending)
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
        with self._lock:
            return self._c.snapshot(self.worker_id, self._engine.version, self._sender.wait_s,
                                    len(self._driver.pending), self._heap.trim_s)

    # -- the loop (one thread) -----------------------------------------------------------
    def run(self, max_groups: int | None = None) -> WorkerStats:
        """Generate until :meth:`stop` (also when called before ``run``: a stopped worker stays
        stopped), or until ``max_groups`` groups were started and sent. Raises the first send error."""
        start = time.perf_counter()
        with self._lock:
            self._loop_done = False
            self._not_running.clear()
        try:
            while not self._stop.is_set():
                self._raise_background_error()
                self._apply_offered()
                self._heap.maybe_trim()
                self._start_evals()
                self._driver.pump()
                self._admit(max_groups)
                if self._engine.num_unfinished():
                    self._step()
                elif (max_groups is not None and self._c.groups_started >= max_groups
                      and not self._grants.granted and not self._grants.asking and not self._waiting_envs()):
                    break
                else:
                    self._idle()
            self._drain()
        finally:
            self._c.elapsed_s += time.perf_counter() - start
            self._grants.release_unstarted(self.acquire_hold_s + _ANSWER_WAIT_S)
            self._cancel_evals()   # and no loop runs from here on
        return self.stats()

    def end_loop(self, timeout_s: float) -> bool:
        """Stop the generation loop, if one runs, by failing it (what it started is dropped,
        not drained: its buffer may be gone); whether no loop runs within ``timeout_s``."""
        if not self._not_running.is_set():
            self.ended_on_request = True
            self.fail(RuntimeError(f"worker {self.worker_id}: stopped for the run's next life"))
        return self._not_running.wait(timeout_s)

    @property
    def engine(self) -> GenerationEngine:
        return self._engine

    @property
    def rollout(self) -> Rollout:
        """The task's rollout (single-turn, an environment's or an agent's)."""
        return self._driver.rollout

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
        if self._evals.pinned:   # an evaluation of the weights now loaded is under way
            return
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
        grants = self._grants
        grants.poll(0.0)
        # Up to env_concurrency episodes waiting for their environment hold no engine slot (a
        # hung one never empties the engine); more queue for it and count, never piling up.
        queued = max(0, self._waiting_envs() - self.cfg.task.env_concurrency)
        free = self.cfg.rollout.max_num_seqs - self._engine.num_unfinished() - queued
        room = -(-free // self.n) - grants.granted
        if max_groups is not None:
            room = min(room, max_groups - self._c.groups_started - grants.granted)
        grants.ask(room)
        if grants.asking and not self._engine.num_unfinished() and not grants.granted:
            t = time.perf_counter()
            grants.poll(self.idle_wait_s)
            with self._lock:
                self._c.idle_s += time.perf_counter() - t
        while grants.startable(self._engine.version):
            self._start_group()
            grants.start_one()

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
        self._driver.start_group(group_id, prompt, self._prompt_ids(prompt), self._sampling)
        with self._lock:
            self._c.groups_started += 1

    def _prompt_ids(self, prompt: Prompt) -> tuple[int, ...]:
        """A chat episode's rendered start, else the prompt's text (a chat template writes
        its own special tokens, BOS included, into it)."""
        chat = self._driver.rollout.prompt_ids(prompt)
        return chat or tuple(self._engine.encode(prompt.text, add_special_tokens=not prompt.templated))

    def _start_evals(self) -> None:
        """Add the evaluation sequences due now (``EvalFeed``: a side-stream a few at a time)."""
        for pending, i, j in self._evals.due():
            prompt = pending.prompts[i]
            ids = pending.encoded.get(i)
            if ids is None:
                ids = pending.encoded[i] = self._prompt_ids(prompt)
            key, sampling = RequestKey.of_eval(pending.request.eval_id, i, j), self._greedy if j == 0 else self._sampling
            self._driver.start_one(key, prompt, ids, sampling)

    def _answered(self, key: RequestKey, text: str, versions: np.ndarray, reward: float | None = None) -> None:
        """Evaluation answer ``key`` is in (``versions``: its model tokens'); the last one hands
        the evaluation to the scorer."""
        assert key.prompt is not None, f"{key} is no evaluation's"
        done = self._evals.answered(key.group, key.prompt, key.index, text, int(versions.shape[0]), versions, reward)
        if done is not None:
            self._scorer.eval_done(done, self._engine.version)

    def _cancel_evals(self) -> None:
        with self._lock:
            self._loop_done = True
            waiting = self._evals.close()
        self._not_running.set()
        for pending in waiting:
            if not pending.future.done():
                pending.future.set_exception(RuntimeError(f"worker {self.worker_id} stopped during an evaluation"))

    def _waiting_envs(self) -> int:
        return self._driver.waiting

    def _collect(self, seq: FinishedSequence) -> None:
        """A finished sequence, read at the engine's boundary (its id into a ``RequestKey``),
        counted, to the driver: the episode awaiting it goes on (or an agent's request takes it)."""
        key = RequestKey.parse(seq.request_id)
        with self._lock:
            if key.evaluation:
                self._c.eval_tokens += seq.token_ids.shape[0]
            else:
                self._c.tokens += seq.token_ids.shape[0]
        self._driver.collect(seq, key)

    def _raise_background_error(self) -> None:
        if self._error is not None:
            raise self._error

    def _drain(self) -> None:
        """Wait for the groups handed to the scorer to be scored and sent."""
        self._scorer.drain()
        self._raise_background_error()

    def close(self, *, close_engine: bool = True, linger_s: float = 5.0) -> None:
        """Stop, release the scorer, the sender (its unsent groups kept up to ``linger_s``)
        and (unless told not to: a shared engine, or one a new worker takes over) the engine."""
        self.stop()
        pending = self._driver.pending
        if pending:  # started, never to be sent
            self._grants.give_back(len(pending))
            pending.clear()
        self._scorer.close()
        self._driver.close()
        self._sender.close(linger_s)
        self._offers.close()
        if close_engine:
            self._engine.close()


