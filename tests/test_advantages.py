"""Advantages against hand-computed values: the group estimators and REINFORCE++'s batch whitening."""

from __future__ import annotations

import math

import numpy as np
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


# ---------------------------------------------------------------- REINFORCE++ over the global batch

def _batch() -> list:  # type: ignore[type-arg]
    """6 groups (4 of 4 completions, 2 of 3), random 0/1 rewards and lengths 1-16."""
    from benchmarks.synthetic import synthetic_groups

    return synthetic_groups(4, 4, seed=7) + synthetic_groups(2, 3, seed=8, first_group_id=4)


class _ThreadAllReduce:
    """An all-reduce (sum) among ``world`` threads, one per simulated trainer rank."""

    def __init__(self, world: int) -> None:
        import threading

        self._parts: list = [None] * world  # type: ignore[type-arg]
        self._barrier = threading.Barrier(world, timeout=10)

    def __call__(self, rank: int, local: np.ndarray) -> np.ndarray:
        self._parts[rank] = np.array(local, dtype=np.float64)
        self._barrier.wait()                                   # every rank's sums are in
        total = np.sum(self._parts, axis=0)
        self._barrier.wait()                                   # every rank read them
        return total


def _on_ranks(name: str, shares: list) -> list:  # type: ignore[type-arg]
    """Each share's advantages computed in its own thread, whitened over all shares together."""
    from concurrent.futures import ThreadPoolExecutor
    from functools import partial

    from pipeline_rl.correction.advantages import group_advantages

    reduce = _ThreadAllReduce(len(shares))
    with ThreadPoolExecutor(len(shares)) as pool:
        outs = list(pool.map(lambda r: group_advantages(name, shares[r], partial(reduce, r)),  # type: ignore[arg-type]
                             range(len(shares))))
    return [a for out in outs for a in out]


@pytest.mark.parametrize("name", sorted(HAND))
def test_reinforce_pp_on_two_ranks_equals_one_rank(name: str) -> None:
    """Two ranks, each with its share of the groups (unequal shares: 2 and 4), get the
    advantages one rank gets on the whole batch: the whitening uses the global mean and std."""
    from pipeline_rl.correction.advantages import group_advantages

    groups = _batch()
    one = group_advantages(name, groups)  # type: ignore[arg-type]
    two = _on_ranks(name, [groups[:2], groups[2:]])
    for a, b in zip(one, two, strict=True):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-6)
    alone = group_advantages(name, groups[:2])  # type: ignore[arg-type]   # a share whitened by itself
    assert not all(np.allclose(a, b, atol=1e-3) for a, b in zip(one[:2], alone, strict=True))


def test_group_estimators_never_reduce() -> None:
    """A group estimator's advantages are each group's own: no collective is called."""
    from pipeline_rl.correction.advantages import group_advantages

    def reduce(v: np.ndarray) -> np.ndarray:
        raise AssertionError("group estimator called the rank sum")

    for name in ("grpo", "dr_grpo", "rloo"):
        assert len(group_advantages(name, _batch(), reduce)) == 6  # type: ignore[arg-type]
