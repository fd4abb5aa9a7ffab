"""Advantages against hand-computed values: the group estimators and REINFORCE++'s batch whitening."""

from __future__ import annotations

import math

import pytest
import torch

from pipeline_rl.correction import compute_advantages


def _adv(name: str, rows: list[list[float]]) -> list[list[float]]:
    out = compute_advantages(name, torch.tensor(rows))  # type: ignore[arg-type]
    assert out.dtype == torch.float32
    return [[round(float(x), 5) for x in row] for row in out]


def test_grpo_mean_and_unbiased_std() -> None:
    # mean 0.5, unbiased std sqrt(1/3): ±0.5 / (0.57735 + 1e-6) = ±0.866024
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    out = compute_advantages("grpo", torch.tensor([[1.0, 0.0, 0.0, 1.0]]))
    assert out[0].tolist() == pytest.approx([a, -a, -a, a], abs=1e-6)
    # n = 2: [0, 2] -> mean 1, std sqrt(2) -> ±0.70711
    assert _adv("grpo", [[0.0, 2.0]]) == [[-0.70711, 0.70711]]


def test_dr_grpo_mean_only() -> None:
    assert _adv("dr_grpo", [[1.0, 0.0, 0.0, 1.0], [0.2, 0.5, 0.8, 0.5]]) == \
        [[0.5, -0.5, -0.5, 0.5], [-0.3, 0.0, 0.3, 0.0]]


def test_rloo_leave_one_out() -> None:
    # r_i - mean of the others: 1 - 1/3, 0 - 2/3
    assert _adv("rloo", [[1.0, 0.0, 0.0, 1.0]]) == [[0.66667, -0.66667, -0.66667, 0.66667]]
    rewards = torch.rand(3, 7, generator=torch.Generator().manual_seed(1))
    loo = torch.stack([torch.stack([rewards[g, i] - torch.cat([rewards[g, :i], rewards[g, i + 1:]]).mean()
                                    for i in range(7)]) for g in range(3)])
    assert torch.allclose(compute_advantages("rloo", rewards), loo, atol=1e-6)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
@pytest.mark.parametrize("n", [2, 3, 8])
def test_equal_rewards_give_zero(name: str, n: int) -> None:
    rewards = torch.tensor([[0.1] * n, [1.0] * n, [0.0, 1.0] + [0.5] * (n - 2)])
    out = compute_advantages(name, rewards)  # type: ignore[arg-type]
    assert bool(torch.isfinite(out).all())
    assert out[:2].abs().max().item() == 0.0
    assert out[2].abs().sum().item() > 0
    assert math.isclose(float(out[2].sum()), 0.0, abs_tol=1e-5)


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="n >= 2"):
        compute_advantages("grpo", torch.ones(4, 1))
    with pytest.raises(ValueError, match="n >= 2"):
        compute_advantages("grpo", torch.ones(4))
    with pytest.raises(ValueError, match="finite"):
        compute_advantages("grpo", torch.tensor([[1.0, float("nan")]]))
    with pytest.raises(ValueError, match="unknown estimator"):
        compute_advantages("ppo", torch.ones(2, 2))  # type: ignore[arg-type]


# ---------------------------------------------------------------- REINFORCE++ (OpenRLHF's definitions)
# Rewards [[1, 0], [0, 0]], trained tokens [[1, 3], [2, 2]] (8 in all).
# reinforce++: a = r = [1, 0, 0, 0]; mu = 1/8; var = (1 (7/8)^2 + 7 (1/8)^2) / 8 = 7/64;
#   A = (a - 1/8) * 8 / sqrt(7) = [sqrt(7), -1/sqrt(7), -1/sqrt(7), -1/sqrt(7)].
# reinforce++-baseline: a = r - mean_g = [0.5, -0.5, 0, 0]; mu = (0.5 - 1.5) / 8 = -1/8;
#   a - mu = [5/8, -3/8, 1/8, 1/8]; var = (25 + 3 * 9 + 2 + 2) / 64 / 8 = 7/64;
#   A = [5, -3, 1, 1] / sqrt(7).
S7 = math.sqrt(7.0)
HAND = {"reinforce++": [[S7, -1 / S7], [-1 / S7, -1 / S7]],
        "reinforce++-baseline": [[5 / S7, -3 / S7], [1 / S7, 1 / S7]]}


@pytest.mark.parametrize("name", sorted(HAND))
def test_reinforce_pp_whitens_over_the_batch_tokens(name: str) -> None:
    rewards, lengths = torch.tensor([[1.0, 0.0], [0.0, 0.0]]), torch.tensor([[1.0, 3.0], [2.0, 2.0]])
    out = compute_advantages(name, rewards, lengths)  # type: ignore[arg-type]
    assert out.tolist() == [pytest.approx(row, abs=1e-6) for row in HAND[name]]


@pytest.mark.parametrize("name", sorted(HAND))
def test_reinforce_pp_on_groups_counts_the_model_tokens(name: str) -> None:
    """What the trainer calls: lengths are each completion's model tokens (an episode's
    environment tokens, mask 0, do not count)."""
    import numpy as np

    from pipeline_rl.correction.advantages import group_advantages
    from pipeline_rl.samples import Completion, Group

    def comp(tokens: int, reward: float, env_tokens: int = 0) -> Completion:
        n = tokens + env_tokens
        mask = np.array([1] * tokens + [0] * env_tokens, dtype=np.uint8)
        return Completion(np.arange(n, dtype=np.int32), np.zeros(n, np.float32), np.zeros(n, np.int32),
                          reward, "stop", mask)

    groups = [Group(0, 0, 0, np.arange(3, dtype=np.int32), (comp(1, 1.0, env_tokens=5), comp(3, 0.0))),
              Group(1, 1, 0, np.arange(3, dtype=np.int32), (comp(2, 0.0), comp(2, 0.0)))]
    out = group_advantages(name, groups)  # type: ignore[arg-type]
    assert [a.dtype for a in out] == [np.float32, np.float32]
    assert [a.tolist() for a in out] == [pytest.approx(row, abs=1e-6) for row in HAND[name]]


def test_reinforce_pp_without_lengths_weighs_each_completion_once() -> None:
    # a = [1, 0, 0, 0]: mu = 1/4, var = 3/16 -> A = (a - 1/4) * 4 / sqrt(3)
    out = compute_advantages("reinforce++", torch.tensor([[1.0, 0.0], [0.0, 0.0]]))
    s3 = math.sqrt(3.0)
    assert out.tolist() == [pytest.approx([s3, -1 / s3], abs=1e-6), pytest.approx([-1 / s3, -1 / s3], abs=1e-6)]
    # every reward equal: no signal, and no division by a zero spread
    assert compute_advantages("reinforce++", torch.ones(2, 3)).abs().max().item() == 0.0
