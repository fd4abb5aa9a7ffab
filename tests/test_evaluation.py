"""Held-out evaluation's arithmetic and scheduling (the worker side runs for real in
test_rollout_worker.py, the whole path through the launcher in test_e2e.py)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from pipeline_rl.rollout.eval_feed import EvalFeed, EvalRequest, EvalResult, PendingEval
from pipeline_rl.config import EvalConfig
from pipeline_rl.run.evaluations import Evaluations, split_prompts
from pipeline_rl.tasks.base import Prompt


def test_split_prompts_covers_each_id_once() -> None:
    for n, w in [(64, 1), (64, 3), (5, 8), (1, 2)]:
        shares = split_prompts(n, w)
        assert sorted(i for s in shares for i in s) == list(range(n))
        assert len(shares) == min(n, w) and max(map(len, shares)) - min(map(len, shares)) <= 1


def test_pending_eval_scores_greedy_mean_and_pass_at_k() -> None:
    """Two prompts, k=2: greedy right on one; samples right on 1 of 2 and 0 of 2."""
    prompts = (Prompt(0, "a", "x"), Prompt(1, "b", "y"))
    p = PendingEval(EvalRequest(0, (0, 1), k=2), prompts)
    answers = {(0, 0): "x", (0, 1): "x", (0, 2): "z", (1, 0): "z", (1, 1): "z", (1, 2): "z"}
    done = [p.add(i, j, text, 3, np.array([4, 5], dtype=np.int32)) for (i, j), text in answers.items()]
    assert done == [False] * 5 + [True]
    res = p.score(lambda prompt, text: float(text == prompt.answer), version_now=9)
    assert (res.greedy_accuracy, res.mean_at_k, res.pass_at_k) == (0.5, 0.25, 0.5)
    assert (res.version_min, res.version_max, res.greedy_tokens) == (4, 5, 6)
    merged = EvalResult.merge([res, res])
    assert (merged.num_prompts, merged.greedy_accuracy, merged.pass_at_k) == (4, 0.5, 0.5)
    with pytest.raises(ValueError):
        EvalResult.merge([])
    with pytest.raises(ValueError):
        EvalRequest(0, (0,), k=0)


def test_feed_streams_an_evaluation_beside_training_and_the_start_at_once() -> None:
    """A side-stream keeps at most ``slots`` sequences unanswered; a request that is not a
    stream (the starting evaluation) goes in whole; stopping hands back what is unanswered."""
    prompts = tuple(Prompt(i, str(i), "x") for i in range(3))
    feed = EvalFeed(slots=2)
    start, stream = PendingEval(EvalRequest(0, (0, 1, 2), k=1, stream=False), prompts), \
        PendingEval(EvalRequest(1, (0, 1, 2), k=1), prompts)
    feed.ask(start)
    feed.ask(stream)
    first = [(p.request.eval_id, i, j) for p, i, j in feed.due()]
    assert first == [(0, i, j) for i in range(3) for j in range(2)] + [(1, 0, 0), (1, 0, 1)]
    assert list(feed.due()) == []                            # the stream's two slots are taken
    v = np.array([0], dtype=np.int32)
    assert all(feed.answered(0, i, j, "x", 1, v) is None for i, j in [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0)])
    assert feed.answered(0, 2, 1, "x", 1, v) is start        # the start complete; no stream slot freed
    assert list(feed.due()) == []
    assert feed.answered(1, 0, 0, "x", 1, v) is None
    assert [(i, j) for _, i, j in feed.due()] == [(1, 0)]    # one answer in, one sequence out
    assert feed.close() == [stream] and list(feed.due()) == []


def test_feed_pins_the_weights_while_an_evaluation_that_is_not_a_stream_is_out() -> None:
    prompts = (Prompt(0, "0", "x"),)
    v = np.array([0], dtype=np.int32)
    feed = EvalFeed(slots=2)
    feed.ask(PendingEval(EvalRequest(0, (0,), k=1), prompts))            # a stream: no pin
    assert not feed.pinned
    feed.ask(PendingEval(EvalRequest(1, (0,), k=1, stream=False), prompts))
    assert feed.pinned                                                     # pinned from the ask on
    list(feed.due())
    assert feed.answered(1, 0, 0, "x", 1, v) is None and feed.pinned
    assert feed.answered(1, 0, 1, "x", 1, v) is not None and not feed.pinned
    feed.ask(PendingEval(EvalRequest(2, (0,), k=1, stream=False), prompts))
    feed.close()
    assert not feed.pinned                                                 # a stopped worker holds nothing


def test_schedule_skips_while_one_is_in_flight() -> None:
    class _Ref:
        pass

    class _Worker:
        def __init__(self) -> None:
            self.asked: list[EvalRequest] = []
            self.evaluate = self

        def remote(self, req: EvalRequest) -> _Ref:
            self.asked.append(req)
            return _Ref()

    ev = Evaluations(EvalConfig(every=5, num_prompts=10, k=2), clock=lambda: 0.0)
    assert ev.due(0) and ev.due(10) and not ev.due(7)
    ws = [_Worker(), _Worker()]
    assert ev.launch(0, 0, ws, stream=False) and ev.in_flight_step == 0
    assert [r.prompt_ids for w in ws for r in w.asked] == [tuple(range(5)), tuple(range(5, 10))]
    assert not any(r.stream for w in ws for r in w.asked)
    assert not ev.launch(5, 5, ws) and ev.skipped == 1
    assert not Evaluations(EvalConfig(every=0), clock=lambda: 0.0).due(0)


class _Remote:
    def __init__(self, fn: Any) -> None:
        self.remote = fn


class _Calls:
    """Ray's calls for a stand-in worker whose methods answer at once (nothing is pending)."""

    def pending(self, refs: Any, timeout_s: float) -> list[Any]:
        return list(refs)

    def get(self, ref: Any, timeout_s: float | None = None) -> Any:
        return ref


class _SlowWorker:
    """A worker that holds weights ``before`` for its first two ``stats`` polls, then ``after``;
    ``asked``: the polls made before each evaluation request, and the request."""

    def __init__(self, before: int, after: int) -> None:
        self.polls = 0
        self.asked: list[tuple[int, EvalRequest]] = []
        self.stats = _Remote(self._stats)
        self.evaluate = _Remote(self._evaluate)
        self._versions = (before, after)

    def _evaluate(self, req: EvalRequest) -> object:
        self.asked.append((self.polls, req))
        return object()

    def _stats(self) -> SimpleNamespace:
        self.polls += 1
        return SimpleNamespace(version=self._versions[self.polls >= 3])


def test_the_starting_evaluation_waits_for_the_workers_to_hold_the_resumed_weights() -> None:
    # A resumed run's worker starts on the base weights (v0) and applies the checkpoint's
    # (v40) in its first pass: asked before that, the evaluation would measure the base model.
    worker = _SlowWorker(0, 40)
    ev = Evaluations(EvalConfig(every=5, num_prompts=4, k=1), clock=lambda: 0.0, calls=_Calls())
    ev.begin_start(40, [worker])
    assert (worker.polls, [n for n, _ in worker.asked]) == (3, [3]) and ev.in_flight_step == 40


def test_the_final_evaluation_is_of_the_final_weights_alone() -> None:
    """After the last step the final evaluation goes out, due or not, once the worker holds
    the final weights, pinned (not a side-stream); a step that is neither due nor the last
    asks nothing."""
    worker = _SlowWorker(7, 8)
    ev = Evaluations(EvalConfig(every=5, num_prompts=4, k=1), clock=lambda: 0.0, calls=_Calls())
    ev.start_due(8, [worker], record=lambda m: None)
    assert worker.asked == [] and worker.polls == 0
    ev.start_due(8, [worker], record=lambda m: None, last=True)
    assert [(n, r.stream) for n, r in worker.asked] == [(3, False)] and ev.in_flight_step == 8
