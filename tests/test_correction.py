"""Correction weights (docs/design.md section 4) against hand-computed values."""

from __future__ import annotations

import math
import typing

import pytest
import torch

from pipeline_rl.config import CorrectionConfig, CorrectionName
from pipeline_rl.correction import CORRECTIONS, PRESETS, LogRatio, correction_weights, fused
from pipeline_rl.correction.weights import RATIO_LOG_CLAMP

LN = math.log
# One row of ratios exp(r) = π/μ, behaviour log-probs -1 everywhere.
RATIOS = [0.25, 0.8, 1.0, 3.0, 10.0]


def _row(ratios: list[float]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    behav = torch.full((1, len(ratios)), -1.0)
    train = behav + torch.tensor([[LN(x) for x in ratios]])
    return train, behav, torch.ones_like(behav, dtype=torch.bool)


def _weights(name: str, *args: torch.Tensor, **cfg: float) -> list[float]:
    cw = correction_weights(name, *args, CorrectionConfig(type=name, **cfg))  # type: ignore[arg-type]
    return [round(float(x), 5) for x in cw.weights[0]]


def test_registry_matches_config_names() -> None:
    """The fused presets, the other presets and ``custom`` are exactly the flag's choices."""
    assert set(CORRECTIONS) == set(fused.MODES)
    assert set(PRESETS) | {"custom"} == set(typing.get_args(CorrectionName))
    with pytest.raises(ValueError, match="unknown correction 'bogus'"):
        correction_weights("bogus", *_row([1.0]), CorrectionConfig())


def test_none() -> None:
    assert _weights("none", *_row(RATIOS)) == [1.0] * 5


def test_tis_caps_at_c() -> None:
    train, behav, mask = _row(RATIOS)
    assert _weights("tis", train, behav, mask) == [0.25, 0.8, 1.0, 2.0, 2.0]
    assert _weights("tis", train, behav, mask, tis_cap=5.0) == [0.25, 0.8, 1.0, 3.0, 5.0]
    cw = correction_weights("tis", train, behav, mask, CorrectionConfig(type="tis"))
    assert cw.clipped[0].tolist() == [False, False, False, True, True]
    assert bool(cw.kept.all())


def test_icepop_masks_outside_band() -> None:
    train, behav, mask = _row(RATIOS)
    assert _weights("icepop", train, behav, mask) == [0.0, 0.8, 1.0, 3.0, 0.0]
    assert _weights("icepop", train, behav, mask, icepop_alpha=0.2, icepop_beta=2.0) == \
        [0.25, 0.8, 1.0, 0.0, 0.0]
    cw = correction_weights("icepop", train, behav, mask, CorrectionConfig(type="icepop"))
    assert cw.kept[0].tolist() == [False, True, True, True, False]
    assert not bool(cw.clipped.any())


def test_seq_mask_tis_geometric_mean() -> None:
    # row 0: geo-mean (0.8*1.25*3)^(1/3) = 1.442 in [0.5, 2] -> kept, token cap 2
    # row 1: geo-mean (3*3*1)^(1/3) = 2.080 > 2 -> whole row 0
    # row 2: the masked-out 100 is ignored; geo-mean (0.5*0.6)^(1/2) = 0.548 -> kept
    # row 3: geo-mean (0.3*0.5)^(1/2) = 0.387 < 0.5 -> whole row 0
    ratios = [[0.8, 1.25, 3.0], [3.0, 3.0, 1.0], [0.5, 0.6, 100.0], [0.3, 0.5, 1.0]]
    behav = torch.full((4, 3), -2.0)
    train = behav + torch.tensor([[LN(x) for x in row] for row in ratios])
    mask = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 0], [1, 1, 0]], dtype=torch.bool)
    cfg = CorrectionConfig(type="seq-mask-tis")
    cw = correction_weights("seq-mask-tis", train, behav, mask, cfg)
    got = [[round(float(x), 5) for x in row] for row in cw.weights]
    assert got == [[0.8, 1.25, 2.0], [0.0, 0.0, 0.0], [0.5, 0.6, 0.0], [0.0, 0.0, 0.0]]
    assert cw.kept.tolist() == [[True] * 3, [False] * 3, [True, True, False], [False] * 3]
    assert cw.clipped.tolist()[0] == [False, False, True]
    # wider band keeps row 1 (and clamps its tokens), row 3 still out
    cw = correction_weights("seq-mask-tis", train, behav, mask,
                            CorrectionConfig(type="seq-mask-tis", seq_hi=2.5, seq_cap=2.5))
    assert [round(float(x), 5) for x in cw.weights[1]] == [2.5, 2.5, 1.0]


@pytest.mark.parametrize("name", list(CORRECTIONS))
def test_on_policy_weights_are_one(name: str) -> None:
    """behaviour == trainer: weight 1 everywhere in the mask, nothing masked or clipped."""
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(5, 11, generator=g) * 3
    mask = torch.rand(5, 11, generator=g) > 0.2
    cfg = CorrectionConfig(type=name)  # type: ignore[arg-type]
    cw = correction_weights(name, logp, logp.clone(), mask, cfg)
    assert torch.equal(cw.weights, mask.float())
    assert torch.equal(cw.kept, mask)
    assert not bool(cw.clipped.any())


@pytest.mark.parametrize("name", list(CORRECTIONS))
def test_bad_logprobs_and_extreme_ratios(name: str) -> None:
    """-inf / nan log-probs are dropped; ratios 1e±30 give finite weights within bounds."""
    behav = torch.tensor([[-1.0, -1.0, float("-inf"), -1.0, -1.0, -1.0]])
    train = torch.tensor([[-1.0 + LN(1e30), -1.0 - LN(1e30), -1.0, float("nan"), float("-inf"), -1e4]])
    mask = torch.ones_like(behav, dtype=torch.bool)
    cfg = CorrectionConfig(type=name)  # type: ignore[arg-type]
    cw = correction_weights(name, train, behav, mask, cfg)
    assert bool(torch.isfinite(cw.weights).all())
    assert cw.kept[0, 2:5].tolist() == [False, False, False]          # -inf / nan: dropped
    assert cw.weights[0, 2:5].tolist() == [0.0, 0.0, 0.0]
    bound = {"none": 1.0, "tis": cfg.tis_cap, "icepop": cfg.icepop_beta, "seq-mask-tis": cfg.seq_cap}
    assert float(cw.weights.max()) <= bound[name]
    assert float(cw.weights[0, 1]) <= (1.0 if name == "none" else math.exp(-RATIO_LOG_CLAMP) * 1.01)


def test_logratio_shapes_checked() -> None:
    with pytest.raises(ValueError, match="must be equal"):
        LogRatio.build(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3))
