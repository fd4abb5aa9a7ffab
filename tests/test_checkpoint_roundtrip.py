"""Checkpoint round trip in every trainer mode: train 2 steps, save through the background
writer as a run does, load into a fresh trainer, and find the same weights (or adapter),
optimizer state (every tensor), moving average, learning rate of the next step, RNG states
and version (docs/failures.md, "Checkpoint round trip")."""

from __future__ import annotations

import itertools
import random
from pathlib import Path
from typing import Any, get_args

import numpy as np
import pytest
import torch

from benchmarks.synthetic import synthetic_groups
from pipeline_rl.config import Config, LRScheduleName

MODES = ("full", "lora")
OPTIMIZERS = ("adamw", "muon")
SCHEDULES: tuple[str, ...] = get_args(LRScheduleName)


def _cases() -> list[Any]:
    """The whole cross product of the axes (60 cases), less EMA with ZeRO-3 (the config refuses it)."""
    out = []
    for mode, opt, ema, sched, zero in itertools.product(MODES, OPTIMIZERS, (False, True), SCHEDULES, (0, 2, 3)):
        if ema and zero == 3:
            continue
        out.append(pytest.param(mode, opt, ema, sched, zero,
                                id=f"{mode}-{opt}-{'ema' if ema else 'noema'}-{sched}-z{zero}"))
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A Llama smaller than ``tiny_model_dir``'s: 1 layer, hidden 32 (head dim 16)."""
    from pipeline_rl.models.tiny_llama import build_tiny_model

    out = tmp_path_factory.mktemp("roundtrip_model")
    build_tiny_model(out, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    return str(out)


def make_cfg(mode: str, optimizer: str, ema: bool, schedule: str, zero: int) -> Config:
    """One group of 4 a step, one micro-batch; 4 steps in all, so every schedule moves the rate
    by step 2; prompt sharing off (its start-up check is not what is tested here)."""
    return Config.model_validate({
        "max_steps": 4, "rollout": {"n": 4}, "correction": {"type": "none"},
        "trainer": {"batch_size": 4, "micro_batch_size": 4, "lr": 1e-2, "optimizer": optimizer,
                    "lr_schedule": schedule, "warmup_steps": 1, "zero_stage": zero,
                    "ema_decay": 0.5 if ema else 0.0, "share_prompts": False},
        "lora": {"rank": 2 if mode == "lora" else 0},
    })


def weights_of(trainer: Any) -> dict[str, np.ndarray]:
    u = trainer.weights()
    return {n: a.copy() for n, a in zip(u.names, u.arrays, strict=True)}


def tensors_of(item: Any, path: str = "") -> dict[str, torch.Tensor]:
    """Every tensor nested in ``item`` (dicts, lists, tuples), by its path, copied."""
    if torch.is_tensor(item):
        return {path: item.detach().clone()}
    if isinstance(item, dict):
        return {k: v for key, value in item.items() for k, v in tensors_of(value, f"{path}/{key}").items()}
    if isinstance(item, (list, tuple)):
        return {k: v for i, value in enumerate(item) for k, v in tensors_of(value, f"{path}/{i}").items()}
    return {}


def rng_states() -> tuple[Any, Any, torch.Tensor]:
    return random.getstate(), np.random.get_state(), torch.get_rng_state()


def snapshot(trainer: Any) -> dict[str, Any]:
    """What a resume must bring back, read before anything sets the next step's rate."""
    return {
        "weights": weights_of(trainer),
        "optimizer": tensors_of(trainer.engine.optimizer.state_dict()),
        "ema": None if trainer.ema is None else {n: a.clone() for n, a in trainer.ema.avg.items()},
        "version": trainer.version,
    }


def next_lr(trainer: Any) -> tuple[float, list[float]]:
    """The rate the next step would use, and each parameter group's."""
    lr = trainer.lr_schedule.set(trainer.version)
    return lr, [float(g["lr"]) for g in trainer.engine.optimizer.param_groups]


@pytest.mark.parametrize("mode,optimizer,ema,schedule,zero", _cases())
def test_checkpoint_round_trip(model_dir: str, tmp_path: Path, mode: str, optimizer: str, ema: bool,
                               schedule: str, zero: int) -> None:
    from pipeline_rl.training.trainer import Trainer

    cfg = make_cfg(mode, optimizer, ema, schedule, zero)
    trainer = Trainer(cfg, model_dir)
    for s in range(2):
        trainer.step(synthetic_groups(1, 4, seed=s, version=s, vocab_size=40, max_completion_len=6))
    rng = rng_states()
    path = trainer.save_checkpoint(tmp_path / "step_2", background=True)
    trainer.wait_for_checkpoints()
    want = snapshot(trainer)
    want_lr = next_lr(trainer)
    trainer.close()

    random.seed(7), np.random.seed(7), torch.manual_seed(7)   # the load must bring the saved states back
    fresh = Trainer(cfg, model_dir)
    state = fresh.load_checkpoint(path)
    got_rng = rng_states()
    got = snapshot(fresh)
    got_lr = next_lr(fresh)
    fresh.close()

    assert state.version == got["version"] == want["version"] == 2
    assert got["weights"].keys() == want["weights"].keys()
    for n, a in want["weights"].items():
        assert np.array_equal(got["weights"][n], a), n
    assert got["optimizer"].keys() == want["optimizer"].keys() and want["optimizer"]
    for k, t in want["optimizer"].items():
        assert torch.equal(got["optimizer"][k], t), k
    assert (got["ema"] is None) == (not ema)
    if ema:
        assert got["ema"].keys() == want["ema"].keys()
        for n, a in want["ema"].items():
            assert torch.equal(got["ema"][n], a), n
    assert got_lr == want_lr
    assert got_rng[0] == rng[0]
    assert all(np.array_equal(a, b) for a, b in zip(got_rng[1], rng[1], strict=True))
    assert torch.equal(got_rng[2], rng[2])


@pytest.mark.parametrize("mode", MODES)
def test_ema_folder_loads_as_it_is(model_dir: str, tmp_path: Path, mode: str) -> None:
    """``ema/`` of a bf16 model: full fine-tuning a transformers folder that says float32, LoRA a
    PEFT adapter folder; both hold the averages exactly, and the live model's config keeps its
    dtype (the save runs beside training)."""
    from transformers import AutoModelForCausalLM

    from pipeline_rl.config.lora_config import LoraConfig
    from pipeline_rl.training.ema import EMA_DIR, EmaWeights
    from pipeline_rl.training.lora import wrap

    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    if mode == "lora":
        model = wrap(model, LoraConfig(rank=2), model_dir, seed=0)
    ema = EmaWeights(model, 0.5)
    with torch.no_grad():
        for p in ema.params.values():
            p.add_(torch.randn_like(p))
    ema.update()
    ema.save(tmp_path / EMA_DIR, Path(model_dir))
    assert str(model.config.dtype).endswith("bfloat16")
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if mode == "lora":
        import peft

        loaded = dict(peft.PeftModel.from_pretrained(base, str(tmp_path / EMA_DIR)).named_parameters())
    else:
        loaded = dict(AutoModelForCausalLM.from_pretrained(str(tmp_path / EMA_DIR), dtype="auto").named_parameters())
    for n, a in ema.avg.items():
        assert loaded[n].dtype == torch.float32 and torch.equal(loaded[n], a), n
    again = EmaWeights(model, 0.5)
    again.load(tmp_path)
    assert all(torch.equal(again.avg[n], a) for n, a in ema.avg.items())
