"""The trainer's knobs (docs/design.md section 7): the learning-rate schedule, Muon, the EMA of
the weights, gradient checkpointing and the entropy bonus, on the real DeepSpeed trainer (CPU,
tiny Llama); each flag's bad value is one line, exit 2."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from benchmarks.synthetic import synthetic_groups
from pipeline_rl.cli import UsageError, parse_config
from pipeline_rl.config import AlgorithmConfig, Config, CorrectionConfig, MuonConfig
from pipeline_rl.samples import Completion, Group
from pipeline_rl.training.schedule import lr_factor

LAUNCH = Path(__file__).resolve().parent.parent / "launch" / "async_grpo.py"


def make_cfg(max_steps: int = 400, **trainer: Any) -> Config:
    """Small batches: 4 groups x 4 completions."""
    return Config.model_validate({
        "max_steps": max_steps, "rollout": {"n": 4, "temperature": 1.0}, "correction": {"type": "none"},
        "trainer": {"batch_size": 16, "micro_batch_size": 16, "lr": 1e-2, **trainer},
    })


def params_of(trainer: Any) -> dict[str, np.ndarray]:
    u = trainer.weights()
    return dict(zip(u.names, u.arrays, strict=True))


# ------------------------------------------------------------------------------ flags

@pytest.mark.parametrize("argv, flag", [
    (["--trainer.lr_schedule", "step"], "--trainer.lr_schedule"),
    (["--trainer.warmup_steps", "10", "--max-steps", "10"], "--trainer.warmup_steps"),
    (["--trainer.warmup_steps", "-1"], "--trainer.warmup_steps"),
    (["--trainer.optimizer", "sgd"], "--trainer.optimizer"),
    (["--trainer.optimizer", "muon", "--trainer.optimizer.momentum", "1"], "--trainer.optimizer.momentum"),
    (["--trainer.optimizer", "muon", "--trainer.optimizer.lr", "0"], "--trainer.optimizer.lr"),
    (["--trainer.optimizer.lr", "0.02"], "--trainer.optimizer.lr: not a parameter of --trainer.optimizer adamw"),
    (["--trainer.ema_decay", "1"], "--trainer.ema_decay"),
    (["--trainer.ema_decay", "0.99", "--trainer.zero_stage", "3"], "--trainer.ema_decay"),
    (["--trainer.gradient_checkpointing", "maybe"], "--trainer.gradient_checkpointing"),
    (["--algorithm.advantage", "reinforce"], "--algorithm.advantage"),
    (["--algorithm.entropy_coef", "-0.01"], "--algorithm.entropy_coef"),
])
def test_bad_knob_values_are_one_line(argv: list[str], flag: str) -> None:
    with pytest.raises(UsageError) as e:
        parse_config(argv, check_cpu=False)
    assert str(e.value).startswith(flag) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("argv", [["--trainer.optimizer", "adam"], ["--trainer.ema_decay", "0.9", "--trainer.zero_stage", "3"]])
def test_bad_knob_on_the_command_line_exits_2(argv: list[str]) -> None:
    res = subprocess.run([sys.executable, str(LAUNCH), *argv], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"async_grpo.py: error: {argv[0]}"), res.stderr


def test_a_deepspeed_without_muon_is_refused_before_anything_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    from importlib import metadata

    real = metadata.version
    monkeypatch.setattr(metadata, "version", lambda name: "0.17.1" if name == "deepspeed" else real(name))
    with pytest.raises(UsageError) as e:
        parse_config(["--trainer.optimizer", "muon"], check_cpu=False)
    assert str(e.value) == ("--trainer.optimizer: muon needs DeepSpeed >= 0.18.2 (installed: 0.17.1); "
                            "scripts/setup.sh installs one")
    monkeypatch.setattr(metadata, "version", real)
    assert parse_config(["--trainer.optimizer", "muon"], check_cpu=False)[0].trainer.optimizer.type == "muon"


def test_knobs_in_toml_and_off_by_default(tmp_path: Path) -> None:
    cfg, _ = parse_config([], check_cpu=False)
    t = cfg.trainer
    assert (t.lr_schedule, t.warmup_steps, t.optimizer.type, t.ema_decay, t.gradient_checkpointing) == \
        ("constant", 0, "adamw", 0.0, False)
    assert cfg.algorithm.entropy_coef == 0.0 and cfg.algorithm.advantage == "grpo"
    toml = tmp_path / "run.toml"
    toml.write_text("[trainer]\nlr_schedule = 'cosine'\nwarmup_steps = 5\nema_decay = 0.99\n"
                    "gradient_checkpointing = true\n[trainer.optimizer]\ntype = 'muon'\nlr = 0.02\n"
                    "[algorithm]\nadvantage = 'reinforce++-baseline'\nentropy_coef = 0.001\n")
    cfg, _ = parse_config(["--config", str(toml)], check_cpu=False)
    t = cfg.trainer
    assert (t.lr_schedule, t.warmup_steps, t.optimizer, t.ema_decay, t.gradient_checkpointing) == \
        ("cosine", 5, MuonConfig(lr=0.02), 0.99, True)
    assert cfg.algorithm.advantage == "reinforce++-baseline" and cfg.algorithm.entropy_coef == 0.001


# ------------------------------------------------------------------------------ schedule

def test_lr_factor_by_step() -> None:
    f = [lr_factor(s, schedule="cosine", warmup_steps=2, total_steps=6) for s in range(6)]
    want = [0.5, 1.0] + [0.5 * (1 + math.cos(math.pi * k / 4)) for k in range(4)]
    assert f == pytest.approx(want)
    assert [lr_factor(s, schedule="linear", warmup_steps=0, total_steps=4) for s in range(5)] == \
        pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0])
    assert [lr_factor(s, schedule="constant", warmup_steps=4, total_steps=10) for s in (0, 3, 4, 9)] == \
        pytest.approx([0.25, 1.0, 1.0, 1.0])


@pytest.fixture(scope="module")
def muon_run(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: str) -> dict[str, Any]:
    """Muon + warm-up + cosine over 6 steps of fixed batches, with a checkpoint after 3."""
    from pipeline_rl.training.optimizers import optimizer_kind
    from pipeline_rl.training.trainer import Trainer

    cfg = make_cfg(max_steps=6, optimizer={"type": "muon", "lr": 0.02}, lr_schedule="cosine", warmup_steps=2)
    batches = [synthetic_groups(4, 4, seed=s) for s in range(6)]
    trainer = Trainer(cfg, tiny_model_dir)
    kind = optimizer_kind(trainer.engine.optimizer)
    adam_params = sum(len(g["params"]) for g in trainer.engine.optimizer.param_groups if not g["use_muon"])
    group_lrs, results = [], []
    for i, groups in enumerate(batches):
        results.append(trainer.step(groups))
        group_lrs.append(sorted(g["lr"] for g in trainer.engine.optimizer.param_groups))
        if i == 2:
            path = trainer.save_checkpoint(tmp_path_factory.mktemp("muon") / "step_3")
            state = {k: v.clone() for k, v in _momenta(trainer).items()}
    out = {"cfg": cfg, "batches": batches, "kind": kind, "results": results, "group_lrs": group_lrs,
           "path": path, "momenta": state, "weights": params_of(trainer), "adam_params": adam_params}
    trainer.close()
    return out


def _momenta(trainer: Any) -> dict[int, torch.Tensor]:
    """Muon's momentum buffers under ZeRO-0, by parameter position."""
    opt = trainer.engine.optimizer
    params = [p for g in opt.param_groups if g["use_muon"] for p in g["params"]]
    return {i: opt.state[p]["momentum_buffer"] for i, p in enumerate(params) if "momentum_buffer" in opt.state[p]}


def test_lr_at_each_step_follows_the_schedule(muon_run: dict[str, Any]) -> None:
    want = [0.01 * lr_factor(s, schedule="cosine", warmup_steps=2, total_steps=6) for s in range(6)]
    assert [r.lr for r in muon_run["results"]] == pytest.approx(want)
    # the groups the optimizer stepped with: AdamW's at --trainer.lr, Muon's at --trainer.optimizer.lr
    for s, lrs in enumerate(muon_run["group_lrs"]):
        f = want[s] / 0.01
        assert lrs == pytest.approx([0.01 * f, 0.02 * f])


def test_muon_state_is_checkpointed_and_resumed(muon_run: dict[str, Any]) -> None:
    from pipeline_rl.training.optimizers import optimizer_kind
    from pipeline_rl.training.trainer import Trainer

    assert muon_run["kind"] == "MuonWithAuxAdam"
    # Muon: 2 layers x 7 hidden matrices (q, k, v, o, gate, up, down); AdamW: the 7 others
    # (embeddings, head, 2 x 2 layer norms, the final norm), as DeepSpeed splits them
    assert len(muon_run["momenta"]) == 14 and muon_run["adam_params"] == 7
    trainer = Trainer(muon_run["cfg"], str(muon_run["path"]))
    trainer.load_checkpoint(muon_run["path"])
    assert optimizer_kind(trainer.engine.optimizer) == "MuonWithAuxAdam" and trainer.version == 3
    got = _momenta(trainer)
    assert got.keys() == muon_run["momenta"].keys()
    for k, v in muon_run["momenta"].items():
        assert torch.equal(got[k], v)
    rest = [trainer.step(g) for g in muon_run["batches"][3:]]
    assert [r.lr for r in rest] == pytest.approx([r.lr for r in muon_run["results"][3:]])
    assert [r.loss for r in rest] == pytest.approx([r.loss for r in muon_run["results"][3:]], abs=1e-6)
    for name, arr in params_of(trainer).items():
        np.testing.assert_allclose(arr, muon_run["weights"][name], atol=1e-6, err_msg=name)
    trainer.close()


# ------------------------------------------------------------------------------ EMA

def test_ema_after_two_steps_saved_as_a_model_and_resumed(tmp_path: Path, tiny_model_dir: str) -> None:
    from transformers import AutoModelForCausalLM

    from pipeline_rl.training.trainer import Trainer

    d = 0.75
    cfg = make_cfg(ema_decay=d)
    trainer = Trainer(cfg, tiny_model_dir)
    assert trainer.ema is not None
    theta = [params_of(trainer)]
    for s in range(2):
        trainer.step(synthetic_groups(4, 4, seed=s))
        theta.append(params_of(trainer))
    want = {n: d * d * theta[0][n] + d * (1 - d) * theta[1][n] + (1 - d) * theta[2][n] for n in theta[0]}
    live = trainer.weights()   # what the workers get: the live weights, not the average
    assert all(np.array_equal(a, theta[2][n]) for n, a in zip(live.names, live.arrays, strict=True))
    for n, w in want.items():
        np.testing.assert_allclose(trainer.ema.avg[n].numpy(), w, atol=1e-6, err_msg=n)
    path = trainer.save_checkpoint(tmp_path / "step_2")
    trainer.close()
    model = AutoModelForCausalLM.from_pretrained(str(path / "ema"))
    sd = model.state_dict()
    for n, w in want.items():
        np.testing.assert_allclose(sd[n].numpy(), w, atol=1e-6, err_msg=n)
    resumed = Trainer(cfg, str(path))
    resumed.load_checkpoint(path)
    assert resumed.ema is not None
    for n, w in want.items():
        np.testing.assert_allclose(resumed.ema.avg[n].numpy(), w, atol=1e-6, err_msg=n)
    resumed.close()


# ------------------------------------------------------------------------------ gradient checkpointing

@pytest.mark.parametrize("stage", [0, 3])
def test_gradient_checkpointing_takes_the_same_step(tiny_model_dir: str, stage: int) -> None:
    from pipeline_rl.training.trainer import Trainer

    groups = synthetic_groups(4, 4, seed=5)
    out = []
    for gc in (False, True):
        trainer = Trainer(make_cfg(zero_stage=stage, gradient_checkpointing=gc, share_prompts=False), tiny_model_dir)
        assert trainer.engine.module.is_gradient_checkpointing is gc
        r = trainer.step(groups)
        out.append((r.loss, params_of(trainer)))
        trainer.close()
    assert out[0][0] == pytest.approx(out[1][0], abs=1e-5)
    for n, a in out[0][1].items():   # Adam's first step is about lr * sign(g): 1% of lr
        np.testing.assert_allclose(out[1][1][n], a, atol=1e-4, err_msg=n)


def test_gradient_checkpointing_turns_prompt_sharing_off(tiny_model_dir: str) -> None:
    """Hugging Face drops a checkpointed layer's KV cache, which shared prompts need."""
    from pipeline_rl.training.trainer import Trainer

    trainer = Trainer(make_cfg(gradient_checkpointing=True), tiny_model_dir)
    assert trainer.engine.module.training and not trainer.share_prompts
    trainer.close()


# ------------------------------------------------------------------------------ entropy bonus

def _entropy_batch(seed: int) -> tuple[Any, torch.Tensor, torch.Tensor]:
    from pipeline_rl.correction.loss import PolicyBatch

    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 5, 7, generator=g, requires_grad=True)                  # [B, T, V]
    targets = torch.randint(0, 7, (3, 5), generator=g)
    logp = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]        # [B, T]
    p = torch.softmax(logits, -1)
    ent = -(p * torch.log_softmax(logits, -1)).sum(-1)                                  # [B, T]
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 1, 1, 0, 0]], dtype=torch.bool)
    behav = logp.detach() + 0.1 * torch.randn(3, 5, generator=g)
    behav[1, 2] = -math.inf                                  # not a trained token: left out of the bonus
    batch = PolicyBatch(logp=logp, behav_logp=behav, mask=mask, advantages=torch.tensor([1.0, -0.5, 0.25]),
                        entropy=ent)
    return batch, logits, ent


@pytest.mark.parametrize("norm", ["token", "sequence"])
def test_entropy_bonus_value_and_gradient_on_both_loss_paths(norm: str) -> None:
    from pipeline_rl.correction import fused
    from pipeline_rl.correction.loss import policy_loss

    algo = AlgorithmConfig(entropy_coef=0.3, normalization=norm)
    corr = CorrectionConfig(type="tis")
    base, _ = policy_loss(_entropy_batch(0)[0], AlgorithmConfig(normalization=norm), corr, use_fused=False)
    batch, logits, ent = _entropy_batch(0)
    loss, m = policy_loss(batch, algo, corr, use_fused=False)
    valid = batch.mask.clone()
    valid[1, 2] = False
    scale = torch.ones(3) if norm == "token" else 1.0 / batch.mask.sum(1).float()
    n = float(batch.mask.sum()) if norm == "token" else 3.0
    bonus = float((ent.detach() * valid * scale[:, None]).sum()) / n
    assert m.entropy_bonus == pytest.approx(bonus, rel=1e-6)
    assert float(loss) == pytest.approx(float(base) - 0.3 * bonus, rel=1e-6)
    loss.backward()
    grad_ref = logits.grad.clone()
    if fused.available():
        batch, logits, _ = _entropy_batch(0)
        loss_f, m_f = policy_loss(batch, algo, corr, use_fused=True)
        loss_f.backward()
        assert float(loss_f) == pytest.approx(float(loss), rel=1e-5)
        assert m_f.entropy_bonus == pytest.approx(bonus, rel=1e-6)
        torch.testing.assert_close(logits.grad, grad_ref, atol=1e-6, rtol=1e-5)


def test_entropy_bonus_raises_the_entropy(tiny_model_dir: str) -> None:
    """Zero advantages (equal rewards): the bonus is the whole gradient, and it raises the
    policy's entropy on the trained tokens; without it nothing moves."""
    from pipeline_rl.training.logprobs import micro_batch_logp_entropy
    from pipeline_rl.training.trainer import Trainer

    groups = synthetic_groups(4, 4, seed=7)
    zeros = [np.zeros(4, dtype=np.float32)] * 4
    trainer = Trainer(make_cfg(lr=3e-3).model_copy(update={"algorithm": AlgorithmConfig(entropy_coef=1.0)}),
                      tiny_model_dir)
    mb = trainer._micro_batches(groups, zeros)[0]

    def mean_entropy() -> float:
        with torch.no_grad():
            _, ent = micro_batch_logp_entropy(trainer.engine, mb, 1.0)
        return float(ent[mb.mask > 0].mean())

    before = mean_entropy()
    flat = [Group(g.group_id, g.prompt_id, g.worker_id, g.prompt_ids,
                  tuple(Completion(c.token_ids, c.logprobs, c.versions, 1.0, c.finish_reason) for c in g.completions))
            for g in groups]
    for _ in range(3):
        r = trainer.step(flat)
    assert r.metrics.entropy_bonus > 0
    assert mean_entropy() > before + 1e-3
    trainer.close()


def test_grad_checkpointing_benchmark_quick(tmp_path: Path) -> None:
    """``python -m benchmarks.grad_checkpointing --quick`` (built-in model) so it cannot rot."""
    import json

    from benchmarks import grad_checkpointing

    out = tmp_path / "gc.json"
    assert grad_checkpointing.main(["--quick", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert set(res["configs"]) == {"off", "off_padded", "on"}
    assert all(c["step_s"] > 0 and c["rss_peak_mb"] > 0 for c in res["configs"].values())
