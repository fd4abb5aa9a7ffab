"""Tasks: deterministic prompt pools, rewards on right/wrong/garbled answers, dataset loading errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline_rl.config import TaskConfig
from pipeline_rl.tasks import AdditionTask, DatasetTask, Prompt, SortTask, Task, TaskError, build_task
from pipeline_rl.tasks.math_reward import answers_match, extract_answer, math_reward


class CharEncoder:
    """One token per character (what the built-in tokenizer does)."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]


# --- built-in tasks -------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["addition", "sort"])
def test_builtin_prompts_are_deterministic_per_id_and_seed(name: str) -> None:
    cfg = TaskConfig(name=name, digits=3, num_prompts=1000)
    a, b, other = build_task(cfg, seed=0), build_task(cfg, seed=0), build_task(cfg, seed=1)
    assert isinstance(a, Task) and a.name == name and a.num_prompts == 1000
    assert [a.prompt(i) for i in range(50)] == [b.prompt(i) for i in range(50)]
    assert [a.prompt(i).text for i in range(50)] != [other.prompt(i).text for i in range(50)]
    assert len({a.prompt(i).text for i in range(200)}) > 100           # a real spread of prompts
    assert a.prompt(1003).text == a.prompt(3).text and a.prompt(1003).prompt_id == 1003  # ids wrap
    with pytest.raises(TaskError, match="prompt_id"):
        a.prompt(-1)


def test_addition_answers_are_sums() -> None:
    task = AdditionTask(digits=2, num_prompts=500)
    for i in range(500):
        p = task.prompt(i)
        lhs, rhs = p.text.rstrip("=").split("+")
        assert p.text.endswith("=") and int(p.answer) == int(lhs) + int(rhs)
        assert 0 <= int(lhs) < 100 and 0 <= int(rhs) < 100


def test_sort_answers_are_sorted_digits() -> None:
    task = SortTask(digits=5, num_prompts=500)
    for i in range(500):
        p = task.prompt(i)
        assert p.text.startswith("sort ") and p.text.endswith("=")
        digits = p.text[len("sort "):-1]
        assert len(digits) == 5 and p.answer == "".join(sorted(digits))


@pytest.mark.parametrize("completion, expected", [
    ("1359", 1.0), ("1359<eos>", 1.0), (" 1359\n", 1.0), ("1359<eos>junk", 1.0),
    ("1358", 0.0), ("13590", 0.0), ("135", 0.0), ("", 0.0), ("<eos>", 0.0), ("1359 1359", 0.0),
    ("abc", 0.0), ("\x00\x01", 0.0), ("9" * 10_000, 0.0), ("١٣٥٩", 0.0),
])
def test_builtin_reward_is_exact_match(completion: str, expected: float) -> None:
    task = SortTask(digits=4, num_prompts=10)
    meta = Prompt(0, "sort 5193=", "1359")
    assert task.reward(meta.text, completion, meta) == expected


def test_bad_builtin_parameters_are_clear_errors() -> None:
    with pytest.raises(TaskError, match="task.digits"):
        AdditionTask(digits=0, num_prompts=10)
    with pytest.raises(TaskError, match="task.num_prompts"):
        SortTask(digits=3, num_prompts=0)
    with pytest.raises(TaskError, match="task.digits"):
        build_task(TaskConfig(name="addition", digits=12), tokenizer=CharEncoder(), max_prompt_tokens=10)


# --- math answer matching -------------------------------------------------------------------

@pytest.mark.parametrize("completion, answer", [
    ("so the result is \\boxed{42}.", "42"),
    ("\\boxed{\\frac{1}{2}}", "0.5"),
    ("\\boxed{\\dfrac{3}{4}}", "\\frac{3}{4}"),
    ("we get 3/4", "0.75"),
    ("#### 1,234", "1234"),
    ("The answer is 17.", "17"),
    ("Answer: $-5$", "-5"),
    ("first 3 then 4 and finally 12", "12"),
    ("\\boxed{x^2 + 1}", "x^2+1"),
    ("\\boxed{\\text{Paris}}", "paris"),
    ("it is 50\\%", "50"),
    ("\\boxed{90^\\circ}", "90"),
    ("2.50", "2.5"),
])
def test_math_reward_matches_equivalent_answers(completion: str, answer: str) -> None:
    assert math_reward(completion, answer) == 1.0


@pytest.mark.parametrize("completion, answer", [
    ("\\boxed{41}", "42"), ("no number here", "7"), ("", "7"), ("\\boxed{", "7"),
    ("12 then 13", "12"), ("\\boxed{1/0}", "1"), ("answer is", "3"), ("1e999", "1"),
])
def test_math_reward_rejects_wrong_or_garbled(completion: str, answer: str) -> None:
    assert math_reward(completion, answer) == 0.0


def test_extract_answer_prefers_boxed_then_markers_then_last_number() -> None:
    assert extract_answer("7 and \\boxed{\\frac{1}{2}} then 9") == "\\frac{1}{2}"
    assert extract_answer("3 #### 8") == "8"
    assert extract_answer("answer is 5. Then 9") == "5"
    assert extract_answer("1, 2, 3.5") == "3.5"
    assert extract_answer("nothing") is None
    assert answers_match("1,000", "1000") and not answers_match("", "")


# --- dataset task ---------------------------------------------------------------------------

def _write(tmp_path: Path, lines: list[str]) -> Path:
    p = tmp_path / "data.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


def test_dataset_loads_and_scores_with_math_reward(tmp_path: Path) -> None:
    rows = [json.dumps({"prompt": f"What is {i}+{i}?", "answer": str(2 * i), "extra": 1}) for i in range(20)]
    rows.insert(3, "")                                           # blank lines are skipped
    rows.append(json.dumps({"prompt": "Half of one?", "answer": 0.5}))
    path = _write(tmp_path, rows)
    task = build_task(TaskConfig(dataset=str(path)), seed=0, tokenizer=CharEncoder(), max_prompt_tokens=64)
    assert isinstance(task, DatasetTask) and task.name == "dataset" and task.num_prompts == 21
    prompts = [task.prompt(i) for i in range(21)]
    assert sorted(p.text for p in prompts) == sorted([f"What is {i}+{i}?" for i in range(20)] + ["Half of one?"])
    assert [p.text for p in prompts] == [build_task(TaskConfig(dataset=str(path)), seed=0).prompt(i).text
                                         for i in range(21)]
    assert task.prompt(21).text == prompts[0].text                # ids wrap around
    half = next(p for p in prompts if p.text == "Half of one?")
    assert task.reward(half.text, "It is \\boxed{1/2}", half) == 1.0
    assert task.reward(half.text, "It is 2", half) == 0.0


@pytest.mark.parametrize("line, message", [
    ('{"prompt": "x"}', r":2: row has no 'answer' field"),
    ('{"answer": "1"}', r":2: row has no 'prompt' field"),
    ('{"prompt": "x", "answer": "1"', r":2: not valid JSON"),
    ('["x", "1"]', r":2: expected a JSON object"),
    ('{"prompt": "", "answer": "1"}', r":2: 'prompt' must be a non-empty string"),
    ('{"prompt": "x", "answer": null}', r":2: 'answer' must be a non-empty string or a number"),
    ('{"prompt": "x", "answer": true}', r":2: 'answer' must be"),
])
def test_dataset_bad_rows_name_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    path = _write(tmp_path, [json.dumps({"prompt": "ok", "answer": "1"}), line])
    with pytest.raises(TaskError, match=message) as err:
        build_task(TaskConfig(dataset=str(path)))
    assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_dataset_prompt_longer_than_context_is_an_error_at_load(tmp_path: Path) -> None:
    path = _write(tmp_path, [json.dumps({"prompt": "short", "answer": "1"}), "",
                             json.dumps({"prompt": "x" * 100, "answer": "2"})])
    with pytest.raises(TaskError, match=rf"{path}:3: prompt is 100 tokens, longer than the 50"):
        build_task(TaskConfig(dataset=str(path)), tokenizer=CharEncoder(), max_prompt_tokens=50)
    assert build_task(TaskConfig(dataset=str(path)), tokenizer=CharEncoder(), max_prompt_tokens=100).num_prompts == 2


def test_dataset_missing_or_empty_file(tmp_path: Path) -> None:
    with pytest.raises(TaskError, match="no such file"):
        build_task(TaskConfig(dataset=str(tmp_path / "nope.jsonl")))
    with pytest.raises(TaskError, match="holds no rows"):
        build_task(TaskConfig(dataset=str(_write(tmp_path, ["", "  "]))))
