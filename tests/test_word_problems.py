"""The word_problems task: graded levels, prompts fixed by seed, a held-out split training
never sees, natural answers scored by math answer matching, and its config checks."""

from __future__ import annotations

import pytest

from pipeline_rl.cli import UsageError, parse_config
from pipeline_rl.tasks.base import TaskError
from pipeline_rl.tasks.build import build_task, longest_prompt
from pipeline_rl.tasks.word_problems import INSTRUCTION, MAX_LEVEL, WordProblemsTask


def test_levels_cycle_and_prompts_are_fixed_by_seed() -> None:
    task = WordProblemsTask(max_level=MAX_LEVEL, num_prompts=1000, seed=3)
    assert [task.level_of(i) for i in range(7)] == [1, 2, 3, 4, 5, 1, 2]
    again = WordProblemsTask(max_level=MAX_LEVEL, num_prompts=1000, seed=3)
    other = WordProblemsTask(max_level=MAX_LEVEL, num_prompts=1000, seed=4)
    texts = [task.prompt(i).text for i in range(50)]
    assert texts == [again.prompt(i).text for i in range(50)]
    assert texts != [other.prompt(i).text for i in range(50)]
    assert all(t.endswith(INSTRUCTION) for t in texts)
    assert task.prompt(1000).text == texts[0]                 # ids wrap around the pool


def test_answers_are_right_and_the_held_out_split_is_disjoint() -> None:
    train = WordProblemsTask(max_level=MAX_LEVEL, num_prompts=100_000, seed=0)
    held = WordProblemsTask(max_level=MAX_LEVEL, num_prompts=100_000, seed=0, split="eval")
    p = next(train.prompt(i) for i in range(0, 500, MAX_LEVEL) if "gets" in train.prompt(i).text)
    a, b = [int(w) for w in p.text.replace("?", " ").replace(".", " ").split() if w.isdigit()][:2]
    assert int(p.answer) == a + b                              # level 1: "has A ... gets B more"
    share = next(train.prompt(i) for i in range(4, 500, MAX_LEVEL))
    nums = [int(w) for w in share.text.replace("?", " ").replace(".", " ").split() if w.isdigit()]
    assert (nums[0] + nums[1]) == int(share.answer) * nums[2]  # level 5: the sum shares evenly
    train_texts = {train.prompt(i).text for i in range(2000)}
    held_texts = {held.prompt(i).text for i in range(200)}
    assert not train_texts & held_texts
    assert len(longest_prompt(build_cfg().task) or "") >= max(len(t) for t in train_texts | held_texts)


@pytest.mark.parametrize("completion, reward", [
    ("Tom has 12 apples now.", 1.0),
    ("7 + 5 = 12. The answer is 12.", 1.0),
    ("So the final answer is \\boxed{12}.", 1.0),
    ("Tom has 12 apples. 12 + 1 = 13", 0.0),                   # the last number counts
    ("He has eleven.", 0.0),
])
def test_natural_answers_are_scored(completion: str, reward: float) -> None:
    task = WordProblemsTask(max_level=1, num_prompts=10)
    p = task.prompt(0)
    meta = type(p)(p.prompt_id, p.text, "12")
    assert task.reward(p.text, completion, meta) == reward


def build_cfg(*flags: str):  # type: ignore[no-untyped-def]
    return parse_config(["--task.name", "word_problems", "--model.path", "/nowhere", *flags])[0]


def test_config_checks() -> None:
    assert build_cfg().task.max_level == 2
    assert isinstance(build_task(build_cfg("--task.max_level", "5").task), WordProblemsTask)
    with pytest.raises(UsageError, match="task.max_level"):
        build_cfg("--task.max_level", "6")
    with pytest.raises(UsageError, match="word_problems is English for a pretrained chat model"):
        parse_config(["--task.name", "word_problems"])
    with pytest.raises(TaskError, match="task.max_level must be in"):
        WordProblemsTask(max_level=0, num_prompts=10)
