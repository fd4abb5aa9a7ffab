"""Rewards in the forms people already have (``pipeline_rl.tasks.reward_forms``,
``pipeline_rl.tasks.reward_mix``): TRL's ``f(prompts, completions, **kwargs)``, verl's
``compute_score(data_source, solution_str, ground_truth, extra_info=None)`` and ours, told
apart by the signature, called through the real scorer (a list as the buffer). The start-up
errors (no form, a missing column) through the driver are in tests/test_tasks.py; the
real runs of the TRL and verl examples in tests/test_rewards.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pipeline_rl.config import TaskConfig
from pipeline_rl.rollout.engines.engine import FinishedSequence
from pipeline_rl.rollout.scoring import PendingGroup
from pipeline_rl.tasks.base import Prompt, TaskError
from pipeline_rl.tasks.build import build_task
from pipeline_rl.tasks.plugin import check_reward_spec
from pipeline_rl.tasks.reward_forms import PluginReward, detect_form, wrap
from pipeline_rl.tasks.reward_mix import WeightedReward, WeightedSpec, split_specs
from test_rewards import N, _Rig, _finished, plugin_path, rig_of  # noqa: F401 -- fixtures

import reward_plugin as rp  # tests/ is on the path (plugin_path)


def _calls(fn: Callable[..., Any]) -> tuple[Callable[..., Any], list[dict[str, Any]]]:
    """``fn`` recording the keyword arguments of each call."""
    seen: list[dict[str, Any]] = []

    def recorded(prompts, completions, **kwargs):  # type: ignore[no-untyped-def]
        seen.append({"prompts": prompts, "completions": completions, **kwargs})
        return fn(prompts=prompts, completions=completions, **kwargs)

    return recorded, seen


# --- telling the forms apart --------------------------------------------------------------------

def test_forms_told_by_the_signature() -> None:
    assert detect_form(rp.contains_answer) == "ours"
    assert detect_form(rp.async_half) == "ours"
    assert detect_form(rp.Scorer.score) == "ours"
    assert detect_form(rp.exact) == "trl"
    assert detect_form(rp.trl_async) == "trl"
    assert detect_form(lambda completions, **kw: [0.0]) == "trl"
    assert detect_form(rp.compute_score) == "verl"
    assert detect_form(rp.no_form) is None
    with pytest.raises(TaskError, match=r"^task.reward: m:f matches none of the reward forms \(its signature is "
                                        r"\(a, b\)\); accepted: ours f\(prompt, completion, meta\) -> float, TRL's "
                                        r"f\(prompts, completions, \*\*kwargs\) -> list\[float\] or verl's "
                                        r"compute_score\(data_source, solution_str, ground_truth, extra_info=None\)$"):
        wrap(rp.no_form, "m:f")
    assert wrap(rp.no_form, "m:f", "trl").form == "trl"                   # --task.reward_form overrides


def test_weights_are_parsed_from_one_flag() -> None:
    assert split_specs("a:b,c.d:e@0.5 , f:g@-1") == [WeightedSpec("a:b", 1.0), WeightedSpec("c.d:e", 0.5),
                                                      WeightedSpec("f:g", -1.0)]
    assert split_specs("http://u@host:8/p")[0].spec == "http://u@host:8/p"
    for bad, needle in (("a:b@x", "the weight in 'a:b@x' is not a number"), ("a:b@nan", "not a finite number"),
                        ("a:b,,c:d", "an empty part"), ("a:b,c", "expected MODULE:FUNCTION")):
        with pytest.raises(TaskError, match=needle):
            check_reward_spec(bad)


# --- TRL's form -------------------------------------------------------------------------------

def test_trl_reward_is_one_call_per_group_with_the_columns(rig_of: Callable[..., _Rig],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    recorded, seen = _calls(rp.exact)
    monkeypatch.setattr(rp, "exact", recorded)
    rig = rig_of("reward_plugin:exact")
    answer = rig.task.prompt(3).answer
    assert rig.score(lambda pid: [answer, " " + answer + "\n", "x", ""], range(3, 4)) == {3: [1.0, 1.0, 0.0, 0.0]}
    assert len(seen) == 1 and rig.tally().calls == 1                      # the group's 4 at once
    q = rig.task.prompt(3).question
    assert seen[0] == {"prompts": [q] * N, "completions": [answer, f" {answer}\n", "x", ""], "answer": [answer] * N}


def test_trl_none_is_no_score_counted_apart_from_failures(rig_of: Callable[..., _Rig]) -> None:
    rig = rig_of("reward_plugin:trl_some_none")
    assert rig.score(lambda pid: ["yes", "no", "y", "n"], range(2)) == {pid: [1.0, 0.0, 1.0, 0.0] for pid in range(2)}
    t = rig.tally()
    assert (t.unscored, t.errors, t.first_error) == (4, 0, None) and not rig.failures


def test_trl_completion_ids_when_asked_and_async_trl(rig_of: Callable[..., _Rig]) -> None:
    rig = rig_of("reward_plugin:trl_ids")
    assert rig.score(_texts("a", "b", "c", "d"), range(1)) == {0: [1.0] * N}    # _finished: one token each
    rig = rig_of("reward_plugin:trl_async")
    assert rig.score(_texts("ab", "abcd", "", "a"), range(1)) == {0: [0.2, 0.4, 0.0, 0.1]}
    assert not rig.scorer.source.on_pool and not rig.scorer.source.per_completion


def _texts(*texts: str) -> Callable[[int], list[str]]:
    return lambda pid: list(texts)


def test_trl_reward_gets_a_datasets_columns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    recorded, seen = _calls(rp.trl_needs_solution)
    monkeypatch.setattr(rp, "trl_needs_solution", recorded)
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps({"question": f"q{i}", "solution": f"{i}", "level": i % 3}) + "\n"
                            for i in range(6)))
    cfg = TaskConfig(dataset=str(data), prompt_field="question", answer_field="solution",
                     reward="reward_plugin:trl_needs_solution")
    task = build_task(cfg)
    rig = _Rig(task, None, **cfg.model_dump())
    try:
        p = task.prompt(0)
        assert rig.score(lambda pid: [p.answer, "x", p.answer, "y"], range(1)) == {0: [1.0, 0.0, 1.0, 0.0]}
    finally:
        rig.close()
    assert seen[0]["solution"] == [p.answer] * N and seen[0]["level"] == [int(p.answer) % 3] * N
    assert seen[0]["prompts"] == [p.question] * N and "question" not in seen[0]   # the prompt comes as prompts
    with pytest.raises(TaskError, match=r"^task.reward: reward_plugin:trl_needs_level asks for the column "
                                        r"'level', which .*qa_no_level.jsonl does not have "
                                        r"\(columns: answer, prompt, solution\)$"):
        nolevel = tmp_path / "qa_no_level.jsonl"
        nolevel.write_text(json.dumps({"prompt": "q", "solution": "1"}) + "\n")
        build_task(TaskConfig(dataset=str(nolevel), answer_field="solution", reward="reward_plugin:trl_needs_level"))


# --- verl's form, ours, several -----------------------------------------------------------------

def test_verl_compute_score_float_and_dict(rig_of: Callable[..., _Rig], tmp_path: Path) -> None:
    rig = rig_of("reward_plugin:compute_score")
    answer = rig.task.prompt(0).answer
    assert rig.score(lambda pid: [answer, "x", answer + " ", "0"], range(1)) == {0: [1.0, 0.0, 1.0, 0.0]}
    assert rig.scorer.source.per_completion and rig.tally().calls == N
    task = build_task(TaskConfig(name="sort", reward="reward_plugin:verl_dict"))
    reward = task.reward_fn  # type: ignore[attr-defined]
    assert isinstance(reward, PluginReward) and reward.form == "verl"
    assert reward.score_batch(task.prompt(5), ["a"]) == [0.75]
    seen: list[dict[str, Any]] = []

    def spy(data_source, solution_str, ground_truth, extra_info=None):  # type: ignore[no-untyped-def]
        seen.append(dict(data_source=data_source, solution_str=solution_str, ground_truth=ground_truth,
                         extra_info=extra_info))
        return {"acc": 1}

    p = task.prompt(5)
    with pytest.raises(TypeError, match="returned a dict without a 'score' key"):
        wrap(spy, "spy", data_source="sort").score_batch(p, ["z"])
    assert seen == [{"data_source": "sort", "solution_str": "z", "ground_truth": p.answer,
                     "extra_info": {"index": 5, "question": p.question, "answer": p.answer}}]
    verl = build_task(TaskConfig(name="sort", reward="reward_plugin:compute_score"))
    assert verl.reward_fn.data_source == "sort"  # type: ignore[attr-defined]


def test_weighted_rewards_sum_and_none_adds_nothing(rig_of: Callable[..., _Rig]) -> None:
    rig = rig_of("reward_plugin:exact,reward_plugin:trl_some_none@0.5,reward_plugin:contains_answer@-1")
    assert isinstance(rig.task.reward_fn, WeightedReward)  # type: ignore[attr-defined]
    assert not rig.scorer.source.per_completion
    a = rig.task.prompt(2).answer
    # exact + 0.5 * (1 if it starts with y else None) - contains_answer (1.0 or 0.25)
    assert rig.score(lambda pid: [a, "y" + a, "y", "n"], range(2, 3)) == {2: [0.0, -0.5, 0.25, -0.25]}
    assert rig.tally().unscored == 0


def test_our_form_returning_none_is_still_a_failure(rig_of: Callable[..., _Rig]) -> None:
    rig = rig_of(reward_fn=lambda prompt, completion, meta: None)
    assert rig.score(_texts("a", "b", "c", "d"), range(1)) == {0: [0.0] * N}
    t = rig.tally()
    assert (t.errors, t.unscored) == (N, 0) and t.first_error is not None
    assert t.first_error.endswith("TypeError: returned None, not a number")


def test_per_completion_form_of_every_reward(rig_of: Callable[..., _Rig]) -> None:
    """``Task.reward`` (one completion) works for every form; no score is 0 there."""
    for spec, completion, expected in (("reward_plugin:exact", "{a}", 1.0), ("reward_plugin:trl_some_none", "n", 0.0),
                                       ("reward_plugin:trl_async", "abc", 0.3),
                                       ("reward_plugin:compute_score", "{a}", 1.0)):
        task = build_task(TaskConfig(name="sort", reward=spec))
        p: Prompt = task.prompt(1)
        assert task.reward(p.text, completion.format(a=p.answer), p) == pytest.approx(expected), spec


def test_plain_ours_callables_keep_the_per_completion_path() -> None:
    """A ``def f(prompt, completion, meta)`` handed to the scorer directly (tests,
    benchmarks) is wrapped as our form: one call per completion, on the pool."""
    task = build_task(TaskConfig(name="sort"))
    rig = _Rig(task, lambda prompt, completion, meta: 1.0)
    try:
        assert rig.scorer.source.per_completion and rig.scorer.source.on_pool
        seqs = {i: _finished(0, i, "x") for i in range(N)}
        rig.scorer.group_done(PendingGroup(0, task.prompt(0), (1, 2), seqs))
        rig.scorer.drain()
        assert rig.sent[0].rewards == [1.0] * N
    finally:
        rig.close()


def test_trls_own_reward_functions_on_a_chat_dataset(tmp_path: Path) -> None:
    """TRL's shipped ``accuracy_reward(completions, solution, **kwargs)`` and
    ``think_format_reward``, written for conversational data, as they are: a templated
    prompt gives TRL's conversational form."""
    from test_tasks import _char_tokenizer, TEMPLATE

    data = tmp_path / "math.jsonl"
    data.write_text(json.dumps({"prompt": "1/2 + 1/4?", "solution": "$\\frac{3}{4}$"}) + "\n")
    cfg = TaskConfig(dataset=str(data), answer_field="solution",
                     reward="trl.rewards:accuracy_reward,trl.rewards:think_format_reward@0.5")
    task = build_task(cfg, tokenizer=_char_tokenizer(TEMPLATE))
    p = task.prompt(0)
    assert p.templated
    reward = task.reward_fn  # type: ignore[attr-defined]
    assert reward.score_batch(p, ["<think>\nadd\n</think>\n\\boxed{0.75}", "so \\boxed{\\frac{1}{2}}"]) == [1.5, 0.0]


def test_trl_reward_returning_a_number_not_a_list_is_one_failure_line(rig_of: Callable[..., _Rig]) -> None:
    rig = rig_of(reward_fn=lambda prompts, completions, **kwargs: 1.0)
    assert rig.score(_texts("a", "b", "c", "d"), range(1)) == {0: [0.0] * N}
    t = rig.tally()
    assert t.errors == N and t.first_error is not None
    assert t.first_error.endswith("TypeError: returned float 1.0, not a list of scores")
