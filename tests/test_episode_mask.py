"""Multi-turn episodes on the data path: the environment's tokens carry a zero loss mask
through the wire format, the buffer's staleness, the trainer's batches, every correction
and every diagnostic, and contribute exactly nothing to any of them."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch

from pipeline_rl.config import AlgorithmConfig, CorrectionConfig
from pipeline_rl.correction import CORRECTIONS, PolicyBatch, policy_loss
from pipeline_rl.correction import fused
from pipeline_rl.samples import NEWEST_VERSION, Completion, Group
from pipeline_rl.training.batching import build_micro_batches, lag_stats
from pipeline_rl.wire import SCHEMA_MASKED, WireError, decode_group, encode_group

PATHS = [False, True] if fused.available() else [False]


def episode(turns: list[tuple[list[int], list[int]]], *, first_version: int = 3,
            env_logp: float = 0.0, env_version: int = 0, reward: float = 1.0) -> Completion:
    """A completion of model turns (mask 1, version first_version + turn) and environment
    replies (mask 0, placeholder log-prob and version, deliberately off)."""
    ids: list[int] = []
    logp: list[float] = []
    ver: list[int] = []
    mask: list[int] = []
    for k, (model, env) in enumerate(turns):
        ids += model + env
        logp += [-0.5 - 0.1 * j for j in range(len(model))] + [env_logp] * len(env)
        ver += [first_version + k] * len(model) + [env_version] * len(env)
        mask += [1] * len(model) + [0] * len(env)
    return Completion(np.array(ids), np.array(logp), np.array(ver), reward, "stop", np.array(mask))


THREE_TURNS = [([5, 6, 7], [20, 21]), ([8, 9], [22, 23, 24]), ([10, 2], [])]


def test_masked_groups_round_trip_and_unmasked_ones_keep_schema_1() -> None:
    plain = Group(1, 2, 3, np.array([1, 2]), (Completion(np.array([4]), np.array([-1.0]), np.array([0]), 0.0, "stop"),))
    assert encode_group(plain)[1] == 1 and decode_group(encode_group(plain)).columns.mask is None  # type: ignore[union-attr]
    g = Group(7, 8, 9, np.array([1, 2, 3]), (episode(THREE_TURNS), episode(THREE_TURNS[:1], first_version=5)))
    raw = encode_group(g)
    assert raw[1] == SCHEMA_MASKED
    back = decode_group(raw)
    for a, b in zip(g.completions, back.completions, strict=True):
        np.testing.assert_array_equal(a.token_ids, b.token_ids)
        np.testing.assert_array_equal(a.mask, b.mask)
    # oldest over the model's tokens: the env placeholders (version 0) never count
    assert back.oldest_version == g.oldest_version == 3
    assert encode_group(back) == raw


def test_the_validator_checks_model_tokens_only() -> None:
    ok = episode(THREE_TURNS, env_logp=7.0, env_version=0)      # > 0 and a version drop, off the mask
    decode_group(encode_group(Group(1, 1, 1, np.array([1]), (ok,))))
    bad = episode(THREE_TURNS)
    bad.logprobs[0] = 0.5                                         # a model token with log-prob > 0
    with pytest.raises(WireError, match="log-probs"):
        decode_group(encode_group(Group(1, 1, 1, np.array([1]), (bad,))))
    raw = bytearray(encode_group(Group(1, 1, 1, np.array([1]), (episode(THREE_TURNS),))))
    raw[-1] = 2                                                   # the last mask byte
    with pytest.raises(WireError, match="mask values"):
        decode_group(bytes(raw))


def test_a_mask_of_another_length_than_its_tokens_is_refused_at_encode() -> None:
    """Each completion's mask, not only the group's total, must match its tokens: else the
    receiver would read every later completion's mask shifted."""
    full = episode(THREE_TURNS)
    assert full.mask is not None
    a = dataclasses.replace(full, mask=full.mask[:-1])                                  # the totals
    b = dataclasses.replace(full, mask=np.concatenate([full.mask, [1]]).astype(np.uint8))  # still agree
    with pytest.raises(WireError, match="differ in length"):
        encode_group(Group(1, 1, 1, np.array([1]), (a, b)))


def test_a_group_without_model_tokens_is_never_stale_built_or_decoded() -> None:
    """An episode of environment tokens only (the model's first turn aborted): its group's
    oldest version is the newest possible, in memory as over the wire."""
    only_env = episode([([], [20, 21])])
    g = Group(1, 1, 1, np.array([1]), (only_env, episode(THREE_TURNS)))
    assert Group(1, 1, 1, np.array([1]), (only_env,)).oldest_version == NEWEST_VERSION
    assert g.oldest_version == 3 == decode_group(encode_group(g)).oldest_version
    assert decode_group(encode_group(Group(1, 1, 1, np.array([1]), (only_env,)))).oldest_version == NEWEST_VERSION


def test_batches_mask_environment_tokens_and_lag_reads_model_versions() -> None:
    g = Group(1, 1, 1, np.array([1, 2]), (episode(THREE_TURNS, env_version=0),))
    mb = build_micro_batches([g], [np.array([1.0])], micro_batch_size=4)[0]
    model = np.array(g.completions[0].mask, dtype=np.float32)
    np.testing.assert_array_equal(mb.mask[0, 1:1 + len(model)].numpy(), model)
    assert float(mb.behav_logp[0, 1:][torch.from_numpy(model) == 0].abs().sum()) == 0.0
    lag = lag_stats([g], trainer_version=6)
    assert lag.max == 3 and lag.mixed_version_frac == 1.0         # versions 3, 4, 5 on model tokens


def _batch(env_logp: float, env_behav: float, seed: int = 0) -> tuple[PolicyBatch, torch.Tensor]:
    """Two episodes in one padded batch; environment positions hold ``env_*`` values."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.tensor([[1, 1, 1, 0, 0, 1, 1, 0, 0, 0, 1, 1],
                         [1, 1, 0, 0, 1, 1, 1, 1, 0, 1, 1, 0]], dtype=torch.bool)
    logp = -torch.rand(2, 12, generator=g) * 2
    behav = logp + torch.randn(2, 12, generator=g) * 0.6
    logp = torch.where(mask, logp, torch.full_like(logp, env_logp))
    behav = torch.where(mask, behav, torch.full_like(behav, env_behav))
    return PolicyBatch(logp=logp.requires_grad_(), behav_logp=behav, mask=mask,
                       advantages=torch.tensor([1.3, -0.7])), mask


@pytest.mark.parametrize("fz", PATHS)
@pytest.mark.parametrize("loss", ["reinforce", "ppo"])
@pytest.mark.parametrize("name", list(CORRECTIONS))
def test_environment_tokens_contribute_exactly_nothing(name: str, loss: str, fz: bool) -> None:
    """Whatever the environment positions hold, loss, gradient and every diagnostic
    are bit-identical, the gradient there is zero, and they are the same as for the
    model's tokens alone (environment columns removed)."""
    algo = AlgorithmConfig(loss=loss)   # type: ignore[arg-type]
    corr = CorrectionConfig(type=name)   # type: ignore[arg-type]
    outs: list[tuple[float, torch.Tensor, Any]] = []
    for env_logp, env_behav in ((0.0, 0.0), (-30.0, 4.0), (float("nan"), float("-inf"))):
        batch, mask = _batch(env_logp, env_behav)
        value, metrics = policy_loss(batch, algo, corr, use_fused=fz and loss == "reinforce")
        value.backward()
        assert batch.logp.grad is not None
        assert float(batch.logp.grad[~mask].abs().sum()) == 0.0
        outs.append((float(value.detach()), batch.logp.grad[mask].clone(), metrics))
    for value, grad, metrics in outs[1:]:
        assert value == outs[0][0] and torch.equal(grad, outs[0][1]) and metrics == outs[0][2]
    batch, mask = _batch(0.0, 0.0)
    model_only = [(batch.logp[b][mask[b]].detach(), batch.behav_logp[b][mask[b]]) for b in range(2)]
    width = max(len(lp) for lp, _ in model_only)
    packed = PolicyBatch(
        logp=torch.stack([torch.nn.functional.pad(lp, (0, width - len(lp))) for lp, _ in model_only]).requires_grad_(),
        behav_logp=torch.stack([torch.nn.functional.pad(bl, (0, width - len(bl))) for _, bl in model_only]),
        mask=torch.arange(width)[None, :] < torch.tensor([[len(lp)] for lp, _ in model_only]),
        advantages=batch.advantages)
    value, metrics = policy_loss(packed, algo, corr, use_fused=fz and loss == "reinforce")
    assert float(value) == pytest.approx(outs[0][0], rel=1e-6, abs=1e-7)
    for field in ("mismatch_kl_k1", "mismatch_kl_k3", "ess", "masked_token_frac", "masked_seq_frac", "clipped_frac"):
        assert getattr(metrics, field) == pytest.approx(getattr(outs[0][2], field), rel=1e-5, abs=1e-7), field


@pytest.mark.parametrize("share", [True, False])
def test_trainer_logprobs_of_a_three_turn_episode_match_transformers(share: bool, tiny_model_dir: str) -> None:
    """The trainer sees the whole episode (environment tokens as inputs) and its log-probs
    on the model's tokens are transformers' at the sampling temperature; a step's loss and
    gradient do not change with what the environment positions hold."""
    from transformers import AutoModelForCausalLM

    from pipeline_rl.config import Config
    from pipeline_rl.training.trainer import Trainer

    cfg = Config.model_validate({"rollout": {"n": 2, "temperature": 0.7}, "correction": {"type": "tis"},
                                 "trainer": {"batch_size": 2, "micro_batch_size": 2, "share_prompts": share}})
    groups = [Group(1, 1, 0, np.array([3, 4, 5]), (episode(THREE_TURNS), episode(THREE_TURNS[1:], reward=0.0)))]
    trainer, twin = Trainer(cfg, tiny_model_dir), Trainer(cfg, tiny_model_dir)
    try:
        got = trainer.logprobs(groups)
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        for c, lp in zip(groups[0].completions, got[0], strict=True):
            ids = torch.from_numpy(np.concatenate([groups[0].prompt_ids, c.token_ids])).long()[None]
            with torch.no_grad():
                ref = torch.log_softmax(model(input_ids=ids).logits[0, :-1] / 0.7, -1).gather(-1, ids[0, 1:, None])[:, 0]
            on_model = np.asarray(c.mask, dtype=bool)
            np.testing.assert_allclose(lp, ref[2:].numpy()[on_model], atol=1e-5)
        off = [Group(1, 1, 0, g.prompt_ids, tuple(episode(t, env_logp=-9.0, env_version=1, reward=c.reward)
                                                   for t, c in zip((THREE_TURNS, THREE_TURNS[1:]), g.completions)))
               for g in groups]
        a, b = trainer.step(groups), twin.step(off)
        assert (a.loss, a.grad_norm, a.num_tokens) == (b.loss, b.grad_norm, b.num_tokens)
    finally:
        trainer.close()
        twin.close()
