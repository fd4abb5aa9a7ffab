"""The built-in model: tokenizer round trips (transformers and vLLM), the cached warm start,
and the pure-torch GRPO probe."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from pipeline_rl.config import ModelConfig, TaskConfig
from pipeline_rl.models import WarmStartRecipe, default_model_dir, recipe_for
from pipeline_rl.models.tiny_llama import build_tiny_model
from pipeline_rl.models.default import INFO_FILE
from pipeline_rl.models.char_ids import EOS_ID, decode, encode
from pipeline_rl.tasks.build import build_task

TEXTS = ["sort 5193=", "1359", "74+64=", "138", "What is 1 + 1? \\boxed{2} ~!@#$%^&*()_{}|:\"<>?`"]
QUICK = WarmStartRecipe(steps=60, batch_size=32, lr=3e-3, smoothing=0.0)


@pytest.fixture(scope="module")
def warm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A quickly warm-started built-in model (60 steps: format only, no real skill)."""
    return default_model_dir(ModelConfig(), TaskConfig(name="sort", digits=3), recipe=QUICK,
                             cache_dir=tmp_path_factory.mktemp("cache"))


def test_tokenizer_round_trips_in_transformers(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(build_tiny_model(tmp_path / "m"))
    assert type(tok).__name__ in ("PreTrainedTokenizerFast", "TokenizersBackend")
    assert tok.eos_token_id == EOS_ID and tok.pad_token_id == 0
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == encode(text)                    # one id per char, no BOS/EOS added
        assert tok.decode(ids) == text == decode(ids)
    assert tok.decode(encode("42") + [EOS_ID], skip_special_tokens=True) == "42"


def test_tokenizer_round_trips_in_vllm(tmp_path: Path) -> None:
    from vllm.tokenizers import get_tokenizer

    tok = get_tokenizer(str(build_tiny_model(tmp_path / "m")))
    for text in TEXTS:
        assert tok.encode(text) == encode(text)
        assert tok.decode(encode(text)) == text
    assert tok.eos_token_id == EOS_ID


def test_warm_start_is_cached_loads_in_transformers_and_stops_with_eos(warm_dir: Path, tmp_path: Path) -> None:
    import torch
    from transformers import LlamaForCausalLM

    from pipeline_rl.models.hf_sampling import sample

    info = json.loads((warm_dir / INFO_FILE).read_text())
    assert info["recipe"]["steps"] == QUICK.steps and info["task"] == "sort"
    t0 = time.perf_counter()
    again = default_model_dir(ModelConfig(), TaskConfig(name="sort", digits=3), recipe=QUICK,
                              cache_dir=warm_dir.parent)
    assert again == warm_dir and time.perf_counter() - t0 < 1.0     # cached: no rebuild
    assert not [p for p in warm_dir.parent.iterdir() if p.name.startswith(".tmp-")]
    model = LlamaForCausalLM.from_pretrained(warm_dir)
    task = build_task(TaskConfig(name="sort", digits=3))
    ro = sample(model, task, [task.prompt(i) for i in range(16)], n=2, max_new_tokens=16,
                temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert float(ro.stopped.float().mean()) >= 0.9                   # learnt to emit <eos>
    assert sum(t.isdigit() and len(t) == 3 for t in ro.texts) >= 24  # and the answer format


def test_cache_key_separates_recipes_tasks_and_shapes(tmp_path: Path) -> None:
    tiny = WarmStartRecipe(steps=1, batch_size=2)
    a = default_model_dir(ModelConfig(), TaskConfig(name="sort", digits=3), recipe=tiny, cache_dir=tmp_path)
    b = default_model_dir(ModelConfig(), TaskConfig(name="sort", digits=4), recipe=tiny, cache_dir=tmp_path)
    c = default_model_dir(ModelConfig(), TaskConfig(name="sort", digits=3),
                          recipe=WarmStartRecipe(steps=2, batch_size=2), cache_dir=tmp_path)
    d = default_model_dir(ModelConfig(hidden_size=64, num_heads=2), TaskConfig(name="sort", digits=3),
                          recipe=tiny, cache_dir=tmp_path)
    assert len({a, b, c, d}) == 4
    assert json.loads((d / "config.json").read_text())["hidden_size"] == 64
    with pytest.raises(ValueError, match="model.path"):
        default_model_dir(ModelConfig(path=str(a)))


def test_default_recipe_aims_at_the_target_reward() -> None:
    """The default recipe teaches the right answer in ``target_reward`` of the examples and
    the decoy in the rest, with hard targets."""
    from pipeline_rl.models.demonstrations import decoy_answer
    from pipeline_rl.tasks.base import Prompt

    for name, digits in (("sort", 4), ("sort", 6), ("addition", 2)):
        r = recipe_for(name, digits, target_reward=0.25)
        assert (r.decoy_frac, r.smoothing) == (0.75, 0.0)
        assert recipe_for(name, digits).decoy_frac == 0.75
    assert decoy_answer("sort", Prompt(0, "sort 5193=", "1359")) == "5193"
    assert decoy_answer("addition", Prompt(0, "47+85=", "132")) == "231"
    with pytest.raises(ValueError):
        recipe_for("sort", 4, target_reward=1.0)


def test_grpo_probe_runs(warm_dir: Path) -> None:
    from benchmarks.rl_probe import RLProbeConfig, grpo_probe

    task = build_task(TaskConfig(name="sort", digits=3))
    res = grpo_probe(warm_dir, task, RLProbeConfig(steps=3, groups=2, n=4, lag=1, probe_every=3))
    assert len(res.rewards) == 3 and all(0.0 <= r <= 1.0 for r in res.rewards)
    assert len(res.probes) == 1 and res.steps_to(2.0) is None


def test_closed_loop_stops_at_the_first_chunk_that_reaches_the_target(tmp_path: Path) -> None:
    """After ``steps`` steps, chunks of ``chunk`` steps each end with a check; the first
    check at or above ``stop_reward`` ends training (else ``max_chunks`` does)."""
    from transformers import LlamaForCausalLM

    from pipeline_rl.models.warmstart import warm_start

    task = build_task(TaskConfig(name="sort", digits=3))
    recipe = WarmStartRecipe(steps=2, batch_size=4, smoothing=0.0, stop_reward=0.5, chunk=3, max_chunks=5)
    assert recipe.closed_loop and not WarmStartRecipe().closed_loop
    folder = build_tiny_model(tmp_path / "m")
    for scores, want in (([0.1, 0.3, 0.6, 0.9], [(5, 0.1), (8, 0.3), (11, 0.6)]),
                         ([0.0] * 9, [(2 + 3 * k, 0.0) for k in range(1, 6)])):
        model = LlamaForCausalLM.from_pretrained(folder)
        seen = iter(scores)
        checks: list[tuple[int, float]] = []
        losses = warm_start(model, task, recipe, check=lambda m: next(seen), checks=checks)
        assert checks == want and len(losses) == want[-1][0]
        assert not model.training


def test_closed_loop_build_records_its_checks(tmp_path: Path) -> None:
    """The cached build runs the real check (sampled reward on training prompts) and records
    it; open-loop recipes keep the cache keys they had before the closed loop existed."""
    from pipeline_rl.models.default import _key

    quick = WarmStartRecipe(steps=20, batch_size=16, lr=3e-3, smoothing=0.0, decoy_frac=0.75,
                            stop_reward=1.0, chunk=5, max_chunks=2, probe_prompts=8, probe_tokens=6)
    folder = default_model_dir(ModelConfig(), TaskConfig(name="sort", digits=3), recipe=quick, cache_dir=tmp_path)
    info = json.loads((folder / INFO_FILE).read_text())
    assert info["steps"] == 30 and [s for s, _ in info["checks"]] == [25, 30]
    assert all(0.0 <= r <= 1.0 for _, r in info["checks"])
    assert _key(ModelConfig(), "sort", 4, recipe_for("sort", 4)) == "fb9541a0de76"   # unchanged caches
    assert _key(ModelConfig(), "calc", 4, recipe_for("calc", 4)) == "58727ff3fc54"
    countdown = recipe_for("countdown", 3)
    assert countdown.closed_loop and countdown.version >= 4 and countdown.probe_tokens == 492
