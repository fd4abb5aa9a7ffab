"""Trainer checkpoints: HF-loadable, resume == uninterrupted, clear errors when broken."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from benchmarks.synthetic import synthetic_groups
from pipeline_rl.training.checkpoint import CheckpointError, RunState, latest_checkpoint, read_run_state
from pipeline_rl.config import Config


def make_cfg(**trainer: Any) -> Config:
    return Config.model_validate({
        "rollout": {"n": 4}, "correction": {"type": "tis"},
        "trainer": {"batch_size": 16, "micro_batch_size": 8, "lr": 1e-2, **trainer},
    })


def batches() -> list[list[Any]]:
    return [synthetic_groups(4, 4, seed=10 + i, version=i) for i in range(3)]


@pytest.fixture(scope="module")
def saved(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Train 2 steps, checkpoint, then take step 3 (the uninterrupted reference)."""
    from pipeline_rl.training.trainer import Trainer

    root = tmp_path_factory.mktemp("ckpt")
    trainer = Trainer(make_cfg(), tiny_model_dir)
    b = batches()
    trainer.step(b[0])
    trainer.step(b[1])
    rng_at_save = torch.get_rng_state().clone()
    path = trainer.save_checkpoint(root / "step_000002")
    torch.manual_seed(1234)  # the resumed run must restore the saved RNG, not inherit this one
    r3 = trainer.step(b[2])
    u = trainer.weights()
    trainer.close()
    return {"path": path, "root": root, "step3": r3, "weights": dict(zip(u.names, u.arrays, strict=True)),
            "rng_at_save": rng_at_save}


def test_checkpoint_layout_and_run_state(saved: dict[str, Any]) -> None:
    path: Path = saved["path"]
    state = read_run_state(path)
    assert state == RunState(version=2, data_position=8, world_size=1, zero_stage=0,
                             saved_unix=state.saved_unix)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "run_state.json", "rng_rank0.pt"):
        assert (path / name).is_file(), name
    assert not (path.parent / (path.name + ".partial")).exists()
    assert latest_checkpoint(saved["root"]) == path


def test_checkpoint_loads_in_transformers(saved: dict[str, Any], tiny_model_dir: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(saved["path"]), dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(saved["path"]))
    assert tok.decode(tok.encode("12+34=")) == "12+34="
    before = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    moved = [n for n, p in model.named_parameters()
             if not torch.equal(p, dict(before.named_parameters())[n])]
    assert moved  # two steps were taken


def test_resume_equals_uninterrupted(saved: dict[str, Any]) -> None:
    from pipeline_rl.training.trainer import Trainer

    torch.manual_seed(999)
    trainer = Trainer(make_cfg(), str(saved["path"]))
    state = trainer.load_checkpoint(saved["path"])
    assert state.data_position == 8 and trainer.version == 2
    assert torch.equal(torch.get_rng_state(), saved["rng_at_save"])
    r3 = trainer.step(batches()[2])
    assert r3.version == 3
    assert r3.loss == pytest.approx(saved["step3"].loss, abs=1e-6)
    assert r3.grad_norm == pytest.approx(saved["step3"].grad_norm, rel=1e-6)
    u = trainer.weights()
    for name, arr in zip(u.names, u.arrays, strict=True):
        np.testing.assert_allclose(arr, saved["weights"][name], atol=1e-7, err_msg=name)
    trainer.close()


# ------------------------------------------------------------------------------ broken checkpoints

def _copy(saved: dict[str, Any], tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(saved["path"], dst)
    return dst


def _one_line(e: pytest.ExceptionInfo[CheckpointError]) -> str:
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_missing_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError) as e:
        read_run_state(tmp_path / "nope")
    assert "no such folder" in _one_line(e)


def test_incomplete_checkpoint_is_a_clear_error(saved: dict[str, Any], tmp_path: Path) -> None:
    d = _copy(saved, tmp_path)
    (d / "run_state.json").unlink()
    with pytest.raises(CheckpointError) as e:
        read_run_state(d)
    assert "incomplete" in _one_line(e)


@pytest.mark.parametrize("damage", ["json", "fields", "safetensors", "deepspeed_dir"])
def test_corrupt_checkpoint_is_a_clear_error(saved: dict[str, Any], tmp_path: Path, damage: str) -> None:
    d = _copy(saved, tmp_path)
    if damage == "json":
        (d / "run_state.json").write_text("{not json")
    elif damage == "fields":
        (d / "run_state.json").write_text(json.dumps({"version": -1}))
    elif damage == "safetensors":
        f = d / "model.safetensors"
        f.write_bytes(f.read_bytes()[:100])
    else:
        shutil.rmtree(d / "deepspeed")
    with pytest.raises(CheckpointError) as e:
        read_run_state(d)
    assert str(d) in _one_line(e)


def test_corrupt_optimizer_state_and_wrong_layout(saved: dict[str, Any], tmp_path: Path,
                                                  tiny_model_dir: str) -> None:
    from pipeline_rl.training.trainer import Trainer

    d = _copy(saved, tmp_path)
    trainer = Trainer(make_cfg(), tiny_model_dir)
    # wrong layout: saved by ZeRO-0 on 1 rank, pretend it was ZeRO-2
    rs = json.loads((d / "run_state.json").read_text())
    (d / "run_state.json").write_text(json.dumps(rs | {"zero_stage": 2}))
    with pytest.raises(CheckpointError) as e:
        trainer.load_checkpoint(d)
    assert "ZeRO-2" in _one_line(e)
    (d / "run_state.json").write_text(json.dumps(rs))
    for f in (d / "deepspeed").rglob("*.pt"):
        f.write_bytes(b"garbage")
    with pytest.raises(CheckpointError) as e:
        trainer.load_checkpoint(d)
    assert "DeepSpeed state is corrupt" in _one_line(e)
    assert trainer.version == 0
    trainer.close()
