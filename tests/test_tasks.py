"""Tasks: deterministic prompt pools, rewards on right/wrong/garbled answers, dataset loading
(JSONL, JSON, Parquet, Arrow, CSV, save_to_disk folders) and its errors, chat templates,
plug-in rewards."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pipeline_rl.cli import UsageError, parse_config
from pipeline_rl.config import TaskConfig
from pipeline_rl.tasks.builtin import AdditionTask, CountdownTask, SortTask
from pipeline_rl.tasks.chat import ConfiguredTask
from pipeline_rl.tasks.dataset import DatasetTask
from pipeline_rl.tasks.base import Prompt, Task, TaskError
from pipeline_rl.tasks.build import build_task, build_task_for_model
from pipeline_rl.tasks.plugin import resolve_reward
from pipeline_rl.tasks.math_reward import answers_match, extract_answer, math_reward

TESTS = Path(__file__).resolve().parent


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


def test_countdown_answers_and_their_lengths_are_heavy_tailed() -> None:
    """Every number from the start down to zero, width kept; answer lengths (tokens, EOS
    included) span two orders of magnitude with a median at most 1/8 of the longest; the
    decoy (stopping before the zero) is never right; prompt + decoy fit 512 positions."""
    import statistics

    from pipeline_rl.models.demonstrations import decoy_answer
    from pipeline_rl.tasks.builtin import COUNTDOWN_MAX_START, countdown_answer_tokens

    task, other = CountdownTask(digits=3, num_prompts=100_000), CountdownTask(3, 100_000, seed=1)
    assert [task.prompt(i) for i in range(20)] == [CountdownTask(3, 100_000).prompt(i) for i in range(20)]
    assert [task.prompt(i).text for i in range(20)] != [other.prompt(i).text for i in range(20)]
    lengths = []
    for i in range(3000):
        p = task.prompt(i)
        start = int(p.text.removeprefix("countdown ").removesuffix("="))
        assert 0 <= start <= COUNTDOWN_MAX_START
        assert p.answer.split(" ") == [f"{n:03d}" for n in range(start, -1, -1)]
        decoy = decoy_answer("countdown", p)
        assert task.reward(p.text, decoy, p) == 0.0 and task.reward(p.text, p.answer, p) == 1.0
        assert len(p.text) + len(p.answer) + 1 <= 512
        lengths.append(len(p.answer) + 1)
    assert min(lengths) == 4 and max(lengths) == countdown_answer_tokens(3) == 492
    assert statistics.median(lengths) <= 492 / 8
    with pytest.raises(TaskError, match="task.digits"):
        CountdownTask(digits=2, num_prompts=10)


def test_countdown_config_checks_digits_and_warns_about_cut_answers() -> None:
    with pytest.raises(UsageError, match="^--task.digits: countdown needs"):
        parse_config(["--task.name", "countdown", "--task.digits", "2"], check_cpu=False)
    cfg, _ = parse_config(["--task.name", "countdown", "--task.digits", "3"], check_cpu=False)
    assert any("cuts countdown answers of up to 492 tokens" in w for w in cfg.warnings())
    cfg, _ = parse_config(["--task.name", "countdown", "--task.digits", "3", "--rollout.max_new_tokens",
                           "492", "--rollout.max_model_len", "512"], check_cpu=False)
    assert cfg.warnings() == []


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
    ("so she sold \\boxed{72} clips", "Natalia sold 48/2 = 24 clips in May.\n#### 72"),
    ("#### 1,000", "The total is 1000.\n#### 1000"),
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


# --- datasets in other formats ----------------------------------------------------------------

QA = [{"question": f"What is {i}+{i}?", "solution": f"{i}+{i}={2 * i}\n#### {2 * i}", "id": i}
      for i in range(6)]


def _write_format(tmp_path: Path, fmt: str, records: list[dict[str, Any]]) -> Path:
    """``records`` written as ``fmt`` (the way users get such files: pandas, pyarrow, datasets)."""
    import pyarrow as pa

    table = pa.Table.from_pylist(records)
    if fmt == "parquet":
        import pyarrow.parquet as pq

        pq.write_table(table, tmp_path / "data.parquet")
        return tmp_path / "data.parquet"
    if fmt == "json":
        (tmp_path / "data.json").write_text(json.dumps(records))
        return tmp_path / "data.json"
    if fmt == "json-lines":
        (tmp_path / "data.json").write_text("\n".join(json.dumps(r) for r in records))
        return tmp_path / "data.json"
    if fmt == "csv":
        table.to_pandas().to_csv(tmp_path / "data.csv", index=False)
        return tmp_path / "data.csv"
    if fmt == "arrow":
        with pa.ipc.new_stream(str(tmp_path / "data.arrow"), table.schema) as w:
            w.write_table(table)
        return tmp_path / "data.arrow"
    import datasets

    datasets.Dataset.from_list(records).save_to_disk(str(tmp_path / "saved"))
    return tmp_path / "saved"


@pytest.mark.parametrize("fmt", ["parquet", "json", "json-lines", "csv", "arrow", "save_to_disk"])
def test_dataset_formats_with_custom_fields(tmp_path: Path, fmt: str) -> None:
    path = _write_format(tmp_path, fmt, QA)
    cfg = TaskConfig(dataset=str(path), prompt_field="question", answer_field="solution")
    assert cfg.name == "dataset"
    task = build_task(cfg, seed=3, tokenizer=CharEncoder(), max_prompt_tokens=64)
    assert isinstance(task, DatasetTask) and task.num_prompts == len(QA)
    prompts = [task.prompt(i) for i in range(len(QA))]
    assert sorted(p.text for p in prompts) == sorted(r["question"] for r in QA)
    assert sorted(p.answer for p in prompts) == sorted(r["solution"] for r in QA)
    p = next(p for p in prompts if p.text == "What is 4+4?")
    assert task.reward(p.text, "4+4 is \\boxed{8}", p) == 1.0            # GSM8K-style reference
    assert task.reward(p.text, "\\boxed{9}", p) == 0.0


def test_dataset_missing_column_names_file_and_columns(tmp_path: Path) -> None:
    path = _write_format(tmp_path, "parquet", QA)
    with pytest.raises(TaskError) as err:
        build_task(TaskConfig(dataset=str(path)))                      # default field 'prompt'
    assert str(err.value) == f"task.prompt_field: {path} has no column 'prompt' (columns: question, solution, id)"
    with pytest.raises(TaskError, match=r"task.answer_field: .* has no column 'answer' \(columns: question"):
        build_task(TaskConfig(dataset=str(path), prompt_field="question"))
    json_path = _write_format(tmp_path, "json", QA)
    with pytest.raises(TaskError, match=r"task.answer_field: .*data.json has no column 'answer'"):
        build_task(TaskConfig(dataset=str(json_path), prompt_field="question"))
    jsonl = _write(tmp_path, [json.dumps(r) for r in QA])
    with pytest.raises(TaskError, match=rf"{jsonl}:1: row has no 'prompt' field \(task.prompt_field; "
                                        r"fields: id, question, solution\)"):
        build_task(TaskConfig(dataset=str(jsonl)))


@pytest.mark.parametrize("records, message", [
    ([{"prompt": "ok", "answer": "1"}, {"prompt": "", "answer": "2"}], r"\[1\]: 'prompt' must be a non-empty string"),
    ([{"prompt": "ok", "answer": "1"}, {"prompt": "x", "answer": None}], r"\[1\]: 'answer' must be a non-empty"),
    ([{"prompt": "ok", "answer": 1.0}, {"prompt": "x", "answer": float("nan")}], r"\[1\]: 'answer' must be"),
    ([{"prompt": "ok", "answer": "1"}, {"prompt": None, "answer": "2"}], r"\[1\]: 'prompt' must be"),
])
def test_dataset_bad_rows_in_parquet_name_the_row(tmp_path: Path, records: list[dict[str, Any]],
                                                 message: str) -> None:
    path = _write_format(tmp_path, "parquet", records)
    with pytest.raises(TaskError, match=message) as err:
        build_task(TaskConfig(dataset=str(path)))
    assert str(err.value).startswith(f"{path}[1]: ") and "\n" not in str(err.value)


def test_dataset_unreadable_inputs_are_one_line_errors(tmp_path: Path) -> None:
    bad_json = tmp_path / "bad.json"
    bad_json.write_text('[{"prompt": "a", "answer": 1},')
    bad_parquet = tmp_path / "bad.parquet"
    bad_parquet.write_bytes(b"not parquet at all")
    other = tmp_path / "data.txt"
    other.write_text("x")
    plain_dir = tmp_path / "plain"
    plain_dir.mkdir()
    import datasets

    splits = tmp_path / "splits"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(QA), "test": datasets.Dataset.from_list(QA)}
                         ).save_to_disk(str(splits))
    for path, message in [(bad_json, "task.dataset: cannot read"), (bad_parquet, "task.dataset: cannot read"),
                          (other, "unknown format '.txt'"), (plain_dir, "not one written by save_to_disk"),
                          (splits, "holds splits train, test; give one of them"),
                          (tmp_path / "openai/gsm8k", "no such file")]:
        with pytest.raises(TaskError, match=message) as err:
            build_task(TaskConfig(dataset=str(path), prompt_field="question", answer_field="solution"))
        assert "\n" not in str(err.value), str(err.value)
    task = build_task(TaskConfig(dataset=str(splits / "test"), prompt_field="question", answer_field="solution"))
    assert task.num_prompts == len(QA)


# --- chat templates ---------------------------------------------------------------------------

TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def _char_tokenizer(chat_template: str | None) -> Any:
    """A tiny character-level ``PreTrainedTokenizerFast`` built here (nothing downloaded)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(["<unk>", "\n"] + [chr(c) for c in range(32, 127)])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")
    fast.chat_template = chat_template
    return fast


@pytest.fixture(scope="module")
def chat_tok() -> Any:
    return _char_tokenizer(TEMPLATE)


def test_chat_template_renders_dataset_prompts(tmp_path: Path, chat_tok: Any) -> None:
    path = _write_format(tmp_path, "parquet", QA)
    cfg = TaskConfig(dataset=str(path), prompt_field="question", answer_field="solution",
                     system_prompt="Think, then answer.")
    task = build_task(cfg, seed=0, tokenizer=chat_tok, max_prompt_tokens=200)
    plain = build_task(cfg, seed=0)                                    # no tokenizer: verbatim
    assert isinstance(task, ConfiguredTask) and isinstance(plain, DatasetTask)
    assert task.name == "dataset" and task.num_prompts == len(QA)
    for i in range(len(QA)):
        p, raw = task.prompt(i), plain.prompt(i)
        assert p.text == f"<|system|>Think, then answer.\n<|user|>{raw.text}\n<|assistant|>"
        assert p.raw_prompt == p.question == raw.text and p.templated and not raw.templated
        assert p.answer == raw.answer and p.prompt_id == i
    p = task.prompt(0)
    assert task.reward(p.text, f"\\boxed{{{p.answer.rsplit('#### ', 1)[1]}}}", p) == 1.0
    no_system = build_task(TaskConfig(dataset=str(path), prompt_field="question", answer_field="solution"),
                           tokenizer=chat_tok)
    assert no_system.prompt(0).text == f"<|user|>{plain.prompt(0).text}\n<|assistant|>"


def test_chat_template_counts_rendered_tokens_against_the_context(tmp_path: Path, chat_tok: Any) -> None:
    path = _write(tmp_path, [json.dumps({"prompt": "x" * 10, "answer": "1"})])
    overhead = len("<|user|>\n<|assistant|>")
    with pytest.raises(TaskError, match=rf"{path}:1: prompt is {10 + overhead} tokens"):
        build_task(TaskConfig(dataset=str(path)), tokenizer=chat_tok, max_prompt_tokens=10 + overhead - 1)
    build_task(TaskConfig(dataset=str(path)), tokenizer=chat_tok, max_prompt_tokens=10 + overhead)
    with pytest.raises(TaskError, match="task.digits: sort prompts take up to"):
        build_task(TaskConfig(name="sort", digits=4), tokenizer=chat_tok, max_prompt_tokens=12)


def test_chat_template_none_or_absent_leaves_prompts_raw(tmp_path: Path, chat_tok: Any) -> None:
    path = _write(tmp_path, [json.dumps({"prompt": "2+2?", "answer": "4"})])
    task = build_task(TaskConfig(dataset=str(path), chat_template="none"), tokenizer=chat_tok)
    assert isinstance(task, DatasetTask) and task.prompt(0).text == "2+2?" and not task.prompt(0).templated
    builtin = build_task(TaskConfig(name="sort", digits=3), tokenizer=_char_tokenizer(None), max_prompt_tokens=16)
    assert isinstance(builtin, SortTask)                               # no template: unchanged
    assert build_task(TaskConfig(name="sort", digits=3), tokenizer=CharEncoder()) == SortTask(3, 100_000)
    sorted_chat = build_task(TaskConfig(name="sort", digits=3), tokenizer=chat_tok)
    assert sorted_chat.prompt(5).text == f"<|user|>{builtin.prompt(5).text}\n<|assistant|>"
    with pytest.raises(TaskError, match="task.system_prompt: the model's tokenizer has no chat template"):
        build_task(TaskConfig(name="sort", system_prompt="hi"), tokenizer=_char_tokenizer(None))


def test_builtin_tokenizer_has_no_chat_template(tmp_path: Path) -> None:
    from pipeline_rl.models.tiny_llama import write_tokenizer

    write_tokenizer(tmp_path)
    task = build_task_for_model(TaskConfig(name="addition", digits=2), str(tmp_path), max_prompt_tokens=8)
    assert isinstance(task, AdditionTask) and task.prompt(0) == AdditionTask(2, 100_000).prompt(0)


def test_build_task_for_model_uses_the_saved_chat_template(tmp_path: Path, chat_tok: Any) -> None:
    chat_tok.save_pretrained(tmp_path)
    task = build_task_for_model(TaskConfig(name="sort", digits=3, system_prompt="S"), str(tmp_path), seed=1)
    raw = SortTask(3, 100_000, seed=1).prompt(7)
    assert task.prompt(7) == Prompt(7, f"<|system|>S\n<|user|>{raw.text}\n<|assistant|>", raw.answer, raw.text)
    assert build_task_for_model(TaskConfig(name="sort", digits=3, chat_template="none"), "/nonexistent") \
        == SortTask(3, 100_000)                                        # none: no tokenizer is loaded


def test_failing_chat_template_is_a_one_line_error(tmp_path: Path) -> None:
    tok = _char_tokenizer("{% if messages[0].role == 'system' %}{{ raise_exception('System role not "
                          "supported') }}{% endif %}{{ messages[0].content }}")
    build_task(TaskConfig(name="sort"), tokenizer=tok)                 # no system prompt: fine
    with pytest.raises(TaskError, match=r"^task.chat_template: .*System role not supported.*"
                                        r"--task.system_prompt$"):
        build_task(TaskConfig(name="sort", system_prompt="be nice"), tokenizer=tok)


# --- plug-in rewards --------------------------------------------------------------------------

@pytest.fixture
def plugin_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(TESTS))


def test_plugin_reward_replaces_builtin_and_dataset_rewards(tmp_path: Path, plugin_path: None,
                                                            chat_tok: Any) -> None:
    sort = build_task(TaskConfig(name="sort", digits=4, reward="reward_plugin:contains_answer"))
    assert isinstance(sort, ConfiguredTask) and isinstance(sort.base, SortTask)
    p = sort.prompt(0)
    assert p == SortTask(4, 100_000).prompt(0)                          # prompts unchanged
    assert sort.reward(p.text, f"junk {p.answer} junk", p) == 1.0      # exact match would say 0
    assert sort.reward(p.text, "nope", p) == 0.25
    path = _write(tmp_path, [json.dumps({"prompt": "Say hi", "answer": "hi"})])
    data = build_task(TaskConfig(dataset=str(path), reward="reward_plugin:echo_question"), tokenizer=chat_tok)
    q = data.prompt(0)
    assert q.templated and data.reward(q.text, "Say hi", q) == 1.0     # meta.question is the raw prompt
    scorer = build_task(TaskConfig(name="addition", reward="reward_plugin:Scorer.score"))
    assert scorer.reward("", "", scorer.prompt(0)) == 0.5


@pytest.mark.parametrize("spec, message", [
    ("reward_plugin", r"expected MODULE:FUNCTION \(e.g. my_rewards:score\) or http\(s\)://HOST:PORT/PATH, "
                      r"got 'reward_plugin'"),
    ("reward_plugin:", "expected MODULE:FUNCTION"),
    ("no_such_module_xyz:f", r"cannot import module 'no_such_module_xyz' \(ModuleNotFoundError: .*PYTHONPATH"),
    ("reward_plugin:missing", "module 'reward_plugin' has no attribute 'missing'"),
    ("reward_plugin:Scorer.nope", "module 'reward_plugin' has no attribute 'Scorer.nope'"),
    ("reward_plugin:NOT_CALLABLE", r"'reward_plugin:NOT_CALLABLE' is not callable \(it is a int\)"),
    ("reward_plugin:two_args", r"matches none of the reward forms \(its signature is \(prompt: 'str', "
                               r"completion: 'str'\) -> 'float'\); accepted: ours f\(prompt, completion, meta\)"),
    ("broken_reward_module:f", r"importing module 'broken_reward_module' failed: ZeroDivisionError"),
])
def test_bad_reward_specs_are_one_line_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              plugin_path: None, spec: str, message: str) -> None:
    (tmp_path / "broken_reward_module.py").write_text("x = 1 / 0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(TaskError, match=message) as err:
        resolve_reward(spec)
    assert str(err.value).startswith("task.reward: ") and "\n" not in str(err.value)
    if ":" in spec and not spec.endswith(":"):                         # well-formed: fails in build_task
        with pytest.raises(TaskError, match=message):
            build_task(TaskConfig(name="sort", reward=spec))


@pytest.mark.parametrize("argv, message", [
    (["--task.reward", "my_rewards.score"], "--task.reward: expected MODULE:FUNCTION"),
    (["--task.reward", "a:b c"], "--task.reward: expected MODULE:FUNCTION"),
    (["--task.system_prompt", "hi", "--task.chat_template", "none"],
     "--task.system_prompt: needs --task.chat_template auto"),
    (["--task.chat_template", "jinja"], "--task.chat_template: invalid choice"),
    (["--task.prompt_field", ""], "--task.prompt_field"),
    (["--task.env", "user_envs.Game"], "--task.env: expected MODULE:CLASS"),
])
def test_cli_rejects_bad_task_flags_in_one_line(argv: list[str], message: str) -> None:
    with pytest.raises(UsageError) as err:
        parse_config(argv, check_cpu=False)
    assert str(err.value).startswith(message) and "\n" not in str(err.value), str(err.value)


def test_cli_accepts_the_new_task_flags(tmp_path: Path) -> None:
    cfg, _ = parse_config(["--dataset", "gsm8k.parquet", "--task.prompt_field", "question",
                           "--task.answer_field", "solution", "--task.system_prompt", "Be brief.",
                           "--task.reward", "my_rewards:score"], check_cpu=False)
    t = cfg.task
    assert (t.name, t.dataset, t.prompt_field, t.answer_field) == ("dataset", "gsm8k.parquet", "question", "solution")
    assert (t.chat_template, t.system_prompt, t.reward) == ("auto", "Be brief.", "my_rewards:score")
    assert TaskConfig().chat_template == "auto" and TaskConfig().reward is None


def test_importing_tasks_stays_light() -> None:
    code = ("import sys, pipeline_rl.tasks.build, pipeline_rl.tasks.tokenizer, pipeline_rl.config; "
            "heavy = {'torch', 'datasets', 'transformers', 'pyarrow'} & set(sys.modules); "
            "assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=TESTS.parent)


@pytest.mark.parametrize("flags, needle", [
    (["--task.reward", "no_such_module_xyz:score"], "task.reward: cannot import"),
    (["--task.reward", "reward_plugin:two_args"], "task.reward: reward_plugin:two_args matches none of the "
                                                  "reward forms"),
    (["--task.reward", "reward_plugin:trl_needs_level"], "task.reward: reward_plugin:trl_needs_level asks for "
                                                         "the column 'level', which "),
    (["--task.prompt_field", "question", "--task.answer_field", "nope"], "task.answer_field: "),
    # an environment that is not there: one line naming the flag, before Ray or any actor starts
    (["--task.env", "reward_plugin:Nope"], "task.env: module 'reward_plugin' has no attribute 'Nope'"),
    (["--task.env", "no_such_module_xyz:Env"], "task.env: cannot import module 'no_such_module_xyz'"),
    (["--task.env", "reward_plugin:contains_answer"], "task.env: reward_plugin:contains_answer is a function"),
])
def test_driver_stops_on_bad_task_before_anything_starts(flags: list[str], needle: str, tmp_path: Path,
                                                         tiny_model_dir: str, plugin_path: None,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    from pipeline_rl.driver import run

    data = _write_format(tmp_path, "parquet", QA)
    cfg, _ = parse_config(["--model", tiny_model_dir, "--dataset", str(data), "--task.prompt_field", "question",
                           "--task.answer_field", "solution", "--out-dir", str(tmp_path / "out"), *flags],
                          check_cpu=True)
    assert run(cfg) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if "error" in ln]
    assert len(err) == 1 and needle in err[0], err
    assert not (tmp_path / "out").exists()  # nothing started


# ------------------------------------------------------------------------------ held-out split


@pytest.mark.parametrize("cls", [AdditionTask, SortTask])
def test_builtin_eval_split_is_disjoint_from_training(cls: type) -> None:
    """Training never sees a held-out prompt text; every eval prompt is one; the split
    is a pure function of the text (the same in every process)."""
    from pipeline_rl.tasks.base import is_held_out

    train, held = cls(4, 100_000, 0), cls(4, 100_000, 0, "eval")
    train_texts = {train.prompt(i).text for i in range(20_000)}
    eval_texts = {held.prompt(i).text for i in range(300)}
    assert not train_texts & eval_texts
    assert all(is_held_out(t) for t in eval_texts) and not any(is_held_out(t) for t in train_texts)
    assert len(eval_texts) > 200                                 # distinct prompts, not one repeated
    assert held.prompt(7) == cls(4, 100_000, 0, "eval").prompt(7)
    assert held.reward(held.prompt(7).text, held.prompt(7).answer, held.prompt(7)) == 1.0


def test_builtin_task_too_small_to_split_is_a_one_line_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """A task none of whose prompt texts falls in the held-out split (as may happen with
    1-digit tasks) cannot evaluate: a one-line error, not an endless draw."""
    import pipeline_rl.tasks.base as base

    monkeypatch.setattr(base, "is_held_out", lambda text: False)
    with pytest.raises(TaskError, match="too few distinct prompts") as e:
        SortTask(1, 100, 0, "eval").prompt(0)
    assert "\n" not in str(e.value)
    assert SortTask(1, 100, 0).prompt(3).text.startswith("sort ")   # training is unaffected


def test_dataset_split_and_eval_file(tmp_path: Path) -> None:
    """With evaluation on and no eval file, the dataset's rows are split by a hash of
    the prompt (each row on one side only); with --eval.dataset that file is the eval
    set and training keeps every row; a split with no rows is a one-line error."""
    from pipeline_rl.config import EvalConfig
    from pipeline_rl.tasks.base import is_held_out

    rows = [{"prompt": f"What is {i}+{i}?", "answer": str(2 * i)} for i in range(400)]
    path = _write(tmp_path, [json.dumps(r) for r in rows])
    cfg = TaskConfig(dataset=str(path))
    on = EvalConfig(every=10)
    train = build_task(cfg, evaluation=on)
    held = build_task(cfg, split="eval", evaluation=on)
    train_texts = {train.prompt(i).text for i in range(train.num_prompts)}
    eval_texts = {held.prompt(i).text for i in range(held.num_prompts)}
    assert train.num_prompts + held.num_prompts == 400 and 0 < held.num_prompts < 60
    assert not train_texts & eval_texts and all(is_held_out(t) for t in eval_texts)
    assert build_task(cfg, evaluation=EvalConfig(every=0)).num_prompts == 400   # eval off: every row
    (tmp_path / "e").mkdir()
    (tmp_path / "t").mkdir()
    extra = _write(tmp_path / "e", [json.dumps({"prompt": "Two?", "answer": "2"})])
    own = EvalConfig(every=10, dataset=str(extra))
    assert build_task(cfg, evaluation=own).num_prompts == 400
    assert [build_task(cfg, split="eval", evaluation=own).prompt(0).text] == ["Two?"]
    tiny = _write(tmp_path / "t", [json.dumps({"prompt": "What is 0+0?", "answer": "0"})])
    with pytest.raises(TaskError, match="no rows for the eval split") as e:
        build_task(TaskConfig(dataset=str(tiny)), split="eval", evaluation=on)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("add_bos", [False, True])
def test_start_up_check_counts_tokens_like_the_models_tokenizer(tiny_model_dir: str, tmp_path: Path,
                                                                add_bos: bool) -> None:
    """The driver's start-up check reads a template-free tokenizer.json without transformers;
    its token ids equal AutoTokenizer's (BOS added as tokenizer_config.json asks)."""
    import shutil

    from transformers import AutoTokenizer

    from pipeline_rl.config import TaskConfig
    from pipeline_rl.tasks.tokenizer import _LightEncoder, check_tokenizer

    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    conf_path = folder / "tokenizer_config.json"
    conf = json.loads(conf_path.read_text())
    conf.update({"add_bos_token": add_bos, "bos_token": conf.get("bos_token") or "<bos>"})
    conf_path.write_text(json.dumps(conf))
    light = check_tokenizer(TaskConfig(), str(folder))
    assert isinstance(light, _LightEncoder)
    full = AutoTokenizer.from_pretrained(folder)
    for text in ("sort 5193=", "12+34=", "", "x" * 40):
        assert light.encode(text) == full.encode(text), text
    # A chat template, or a dataset task, takes the model's own tokenizer.
    assert not isinstance(check_tokenizer(TaskConfig(name="dataset", dataset="d.jsonl"), str(folder)), _LightEncoder)
    conf["chat_template"] = "{{ messages[0]['content'] }}"
    conf_path.write_text(json.dumps(conf))
    assert not isinstance(check_tokenizer(TaskConfig(), str(folder)), _LightEncoder)
