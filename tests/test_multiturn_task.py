"""The multi-turn ``calc`` task: deterministic prompts, the held-out split, the calculator's
replies and score, the environment factory a task supplies, the warm start's examples, and a
whole episode's text through the character tokenizer."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pipeline_rl.config import ModelConfig, TaskConfig
from pipeline_rl.models.tiny_llama import EOS, build_tiny_model
from pipeline_rl.models.char_ids import EOS_ID, encode
from pipeline_rl.models.demonstrations import demonstration, soft_targets
from pipeline_rl.models.warmstart_recipe import WarmStartRecipe
from pipeline_rl.tasks.calc import CalcTask
from pipeline_rl.tasks.builtin import SortTask
from pipeline_rl.tasks.base import Task, TaskError
from pipeline_rl.tasks.build import build_task
from pipeline_rl.tasks.base import Prompt, is_held_out
from pipeline_rl.tasks.calc import CalcEnv, episode_text
from pipeline_rl.tasks.chat import ConfiguredTask
from pipeline_rl.tasks.env import EnvReply, Environment, task_env_factory

PROMPT = re.compile(r"^calc (\d{4})\*(\d{4})=$")


def calc(digits: int = 4, seed: int = 0, split: str = "train", num_prompts: int = 1000) -> Task:
    return build_task(TaskConfig(name="calc", digits=digits, num_prompts=num_prompts), seed=seed,
                      split="eval" if split == "eval" else "train")


def correct_episode(task: CalcTask, p: Prompt) -> str:
    return p.text + episode_text(task.demonstration(p, decoy=False))


# --- prompts ---------------------------------------------------------------------------------

def test_prompts_are_deterministic_per_seed_and_id() -> None:
    a, b, other = calc(), calc(), calc(seed=1)
    assert isinstance(a, CalcTask) and a.name == "calc" and a.num_prompts == 1000
    assert [a.prompt(i) for i in range(50)] == [b.prompt(i) for i in range(50)]
    assert [a.prompt(i).text for i in range(50)] != [other.prompt(i).text for i in range(50)]
    assert len({a.prompt(i).text for i in range(200)}) == 200
    assert a.prompt(1007).text == a.prompt(7).text and a.prompt(1007).prompt_id == 1007
    for i in range(200):
        p = a.prompt(i)
        found = PROMPT.match(p.text)
        assert found is not None, p.text                  # two 4-digit operands, no leading zero
        assert p.answer == str(int(found.group(1)) * int(found.group(2)))
        assert CalcTask.expression(p) == f"{found.group(1)}*{found.group(2)}"


def test_digits_bounds_and_the_longest_prompt() -> None:
    from pipeline_rl.tasks.build import longest_prompt

    assert re.fullmatch(r"calc [1-9]\*[1-9]=", calc(digits=1).prompt(0).text)
    assert re.fullmatch(r"calc \d{6}\*\d{6}=", calc(digits=6).prompt(0).text)
    with pytest.raises(TaskError, match="task.digits"):
        CalcTask(7, 100)
    assert longest_prompt(TaskConfig(name="calc", digits=4)) == "calc 9999*9999="


def test_held_out_split_is_disjoint_and_deterministic() -> None:
    train, held = calc(num_prompts=4000), calc(split="eval", num_prompts=4000)
    train_texts = {train.prompt(i).text for i in range(4000)}
    held_texts = {held.prompt(i).text for i in range(200)}
    assert not train_texts & held_texts
    assert all(is_held_out(t) for t in held_texts) and not any(is_held_out(t) for t in train_texts)
    assert [held.prompt(i) for i in range(20)] == [calc(split="eval", num_prompts=4000).prompt(i) for i in range(20)]


# --- the environment -------------------------------------------------------------------------

def test_the_calculator_answers_calls_and_scores_the_last_turn() -> None:
    task = calc()
    p = task.prompt(3)
    env = CalcEnv()
    assert isinstance(env, Environment)
    env.reset(p)
    a, b = CalcTask.expression(p).split("*")
    assert env.step(f"[{a}*{b}]<eos>") == EnvReply(text=f"={int(a) * int(b)};", tool_calls=1)   # counted
    assert env.step("[12+30]<eos>").text == "=42;" and env.step("[12-30]").text == "=-18;"
    assert env.step(f"let me see [{a}*{b}] please<eos>").text == f"={p.answer};"   # a call anywhere
    assert env.step(f"{p.answer}<eos>") == EnvReply(reward=1.0, done=True)
    assert env.step(f" {p.answer} <eos>junk").reward == 1.0      # cut at EOS, whitespace ignored
    for wrong in (f"{p.answer}0<eos>", f"{a}{b}<eos>", "<eos>", "", "[12/3]<eos>", "[*3]", "[1*]"):
        assert env.step(wrong) == EnvReply(reward=0.0, done=True), wrong   # no call: scored, ended
    assert task.reward(p.text, f"{p.answer}<eos>", p) == 1.0 and task.reward(p.text, f"{a}{b}", p) == 0.0


def test_step_needs_reset() -> None:
    with pytest.raises(AssertionError, match="reset"):
        CalcEnv().step("[1*2]")


def test_a_task_supplies_its_environment_factory() -> None:
    task = calc()
    make = task_env_factory(task)
    assert make is CalcEnv
    assert make() is not make()                                  # one environment per episode
    assert task_env_factory(SortTask(4, 100)) is None            # single-turn tasks: none
    wrapped = ConfiguredTask(task, None, lambda prompt, completion, meta: 0.5)
    assert task_env_factory(wrapped) is CalcEnv                  # a plug-in reward's wrapper is looked through


# --- the warm start --------------------------------------------------------------------------

def test_warm_start_examples_are_tool_episodes_or_the_decoy() -> None:
    task = calc()
    assert isinstance(task, CalcTask)
    for i in range(100):
        p = task.prompt(i)
        expr = CalcTask.expression(p)
        call, reply, answer = task.demonstration(p, decoy=False)
        assert call == (f"[{expr}]", True) and reply == (f"={p.answer};", False) and answer == (p.answer, True)
        env = CalcEnv()
        env.reset(p)
        assert env.step(call[0] + EOS).text == reply[0]          # the reply is the environment's own
        assert env.step(answer[0] + EOS).reward == 1.0
        (decoy,) = task.demonstration(p, decoy=True)
        assert decoy == (expr.replace("*", ""), True) and len(decoy[0]) == 8
        assert env.step(decoy[0] + EOS).reward == 0.0            # never the product
        assert demonstration(task, p, True) == (decoy,)
    assert demonstration(SortTask(4, 100), SortTask(4, 100).prompt(0), False) == ((SortTask(4, 100).prompt(0).answer, True),)


def test_warm_start_trains_on_model_tokens_only() -> None:
    task = calc()
    assert isinstance(task, CalcTask)
    p = task.prompt(0)
    parts = task.demonstration(p, decoy=False)
    ids, targets, mask = soft_targets([(p.text, parts)], smoothing=0.0, vocab_size=128)
    full = encode(p.text) + encode(parts[0][0]) + [EOS_ID] + encode(parts[1][0]) + encode(parts[2][0]) + [EOS_ID]
    assert ids[0].tolist() == full
    trained = [int(m) for m in mask[0].tolist()]
    start_call, start_reply = len(p.text), len(p.text) + len(parts[0][0]) + 1
    start_answer = start_reply + len(parts[1][0])
    expect = [0] * len(full)
    for pos in [*range(start_call, start_reply), *range(start_answer, len(full))]:
        expect[pos - 1] = 1                                      # logits at pos - 1 predict token pos
    assert trained == expect
    assert all(int(targets[0, pos].argmax()) == full[pos + 1] for pos, m in enumerate(trained) if m)


def test_the_built_in_model_warm_starts_on_calc_and_is_probed_by_episodes(tmp_path: Path) -> None:
    from pipeline_rl.models import default_model_dir
    from pipeline_rl.models.default import INFO_FILE

    quick = WarmStartRecipe(steps=30, batch_size=16, lr=3e-3, smoothing=0.0, decoy_frac=0.75)
    folder = default_model_dir(ModelConfig(), TaskConfig(name="calc", digits=2), recipe=quick, cache_dir=tmp_path)
    info = json.loads((folder / INFO_FILE).read_text())
    assert folder.name.startswith("builtin-calc2-") and info["task"] == "calc"
    probe = info["probe"]
    assert 0.0 <= probe["greedy_reward"] <= 1.0 and 0.0 <= probe["sampled_reward"] <= 1.0
    assert all(text.startswith("calc ") for text in probe["examples"])


def test_episodes_run_turns_until_the_environment_ends_them(tmp_path: Path) -> None:
    import torch
    from transformers import LlamaForCausalLM

    from pipeline_rl.models.hf_episodes import run_episodes

    model = LlamaForCausalLM.from_pretrained(build_tiny_model(tmp_path / "m"))   # random: any text
    task = calc(digits=2)
    prompts = [task.prompt(i) for i in range(6)]
    episodes = run_episodes(model, prompts, CalcEnv, max_turns=2, max_new_tokens=5, temperature=1.0,
                            generator=torch.Generator().manual_seed(0))
    for e, p in zip(episodes, prompts):
        assert e.prompt is p and 1 <= e.turns <= 2 and e.reward in (0.0, 1.0)
        assert e.done or (e.turns == 2 and e.reward == 0.0)
        assert len(e.tokens) == len(e.by_model) and e.tokens.count(EOS_ID) <= e.turns
        assert all(e.by_model[i] for i, t in enumerate(e.tokens) if t == EOS_ID)   # a turn's end is the model's


# --- the tokenizer ---------------------------------------------------------------------------

def test_a_correct_episode_round_trips_in_the_character_tokenizer(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(build_tiny_model(tmp_path / "m"))
    task = calc(digits=6)
    assert isinstance(task, CalcTask)
    for i in range(20):
        p = task.prompt(i)
        text = correct_episode(task, p)
        assert text.count(EOS) == 2 and text.endswith(EOS)
        ids = tok.encode(text, add_special_tokens=False)
        call, reply, answer = (t for t, _ in task.demonstration(p, decoy=False))
        expected = encode(p.text + call) + [EOS_ID] + encode(reply + answer) + [EOS_ID]
        assert ids == expected and tok.unk_token_id not in ids  # every character is a token
        assert tok.decode(ids, skip_special_tokens=False) == text
        assert tok.decode(ids, skip_special_tokens=True) == text.replace(EOS, "")
        # a reply is encoded alone, once, without special tokens (what the worker appends)
        assert tok.encode(reply, add_special_tokens=False) == encode(reply)
