"""Group advantages against hand-computed values."""

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
