"""Corrections as a composition (``pipeline_rl/correction/compose.py``, docs/objectives.md): each
piece against a hand computation on 2 sequences x 3 tokens (a sequence of length 1, every token
masked, ratios exactly on a bound); M2PO against the paper's Algorithm 1 written as a loop; the
presets ``none``/``tis``/``icepop``/``seq-mask-tis`` pinned against the functions they replaced
(copied here) and against values recorded before the change; the flags and their one-line errors."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import Tensor

from pipeline_rl.cli import UsageError, build_parser, parse_config
from pipeline_rl.config import AlgorithmConfig, CorrectionConfig
from pipeline_rl.correction import (CORRECTIONS, Composition, LogRatio, PolicyBatch, composition,
                                    correction_weights, fused, policy_loss)
from pipeline_rl.correction.compose import (compose, m2po_mask, reject_sequences, reject_tokens,
                                            sequence_weight, token_weight, veto_sequences)
from pipeline_rl.correction.loss import fusable
from pipeline_rl.correction.weights import RATIO_LOG_CLAMP, CorrectionWeights

LN = math.log
F64 = torch.float64
# Row 0: ratios 0.5, 1, 4 (product exactly 2, geometric mean 2^(1/3)); row 1: one token, ratio 2.
RATIOS = [[0.5, 1.0, 4.0], [2.0]]


def lr_of(ratios: list[list[float]] = RATIOS, lengths: list[int] | None = None) -> LogRatio:
    """Behaviour log-probs 0, trainer log-probs log(ratio): r is exactly log(ratio)."""
    rows = [[LN(x) for x in r] + [0.0] * (3 - len(r)) for r in ratios]
    lengths = [len(r) for r in ratios] if lengths is None else lengths
    mask = torch.arange(3)[None, :] < torch.tensor(lengths)[:, None]
    return LogRatio.build(torch.tensor(rows, dtype=F64), torch.zeros(len(rows), 3, dtype=F64), mask)


def rows(t: Tensor, lengths: list[int] = [3, 1]) -> list[list[Any]]:
    return [t[i, :n].tolist() for i, n in enumerate(lengths)]


# -- the pieces, by hand --------------------------------------------------------------------------

def test_token_weight_caps_each_token() -> None:
    """w_t = min(π/μ, C): C = 2 cuts the 4; the 2 of row 1 is exactly the cap: kept, not clipped."""
    cw = token_weight(lr_of(), lr_of().valid, 2.0)
    assert rows(cw.weights) == [[0.5, 1.0, 2.0], [pytest.approx(2.0, rel=1e-15)]]
    assert rows(cw.clipped) == [[False, False, True], [False]]
    assert rows(token_weight(lr_of(), lr_of().valid, math.inf).weights) == \
        [[0.5, 1.0, pytest.approx(4.0, rel=1e-15)], [pytest.approx(2.0, rel=1e-15)]]


def test_sequence_weight_is_the_capped_product() -> None:
    """w_b = min(Π_t π/μ, C) on each token: both products are 2 (row 1's is its one token's)."""
    lr = lr_of()
    assert rows(sequence_weight(lr, lr.valid, 3.0).weights) == [[pytest.approx(2.0, rel=1e-15)] * 3,
                                                                [pytest.approx(2.0, rel=1e-15)]]
    cw = sequence_weight(lr, lr.valid, 1.5)
    assert rows(cw.weights) == [[1.5] * 3, [1.5]] and bool(cw.clipped[lr.valid].all())
    assert not bool(sequence_weight(lr, lr.valid, 2.0).clipped.any())   # exactly the cap


def test_rejections_at_the_bounds() -> None:
    """[0.5, 2]: the token 0.5 and the token 2 sit exactly on a bound and stay; the 4 goes. The
    product of row 0 is exactly 2 (kept); its geometric mean 1.26 leaves [0.8, 1.2]."""
    lr = lr_of()
    assert rows(reject_tokens(lr, 0.5, 2.0)) == [[True, True, False], [True]]
    assert reject_sequences(lr, 0.5, 2.0, geometric=False).tolist() == [True, True]
    assert reject_sequences(lr, 0.5, 1.99, geometric=False).tolist() == [False, False]
    assert reject_sequences(lr, 0.5, 2.0, geometric=True).tolist() == [True, True]
    assert reject_sequences(lr, 0.8, 1.2, geometric=True).tolist() == [False, False]
    assert reject_sequences(lr, 0.0, 1.3, geometric=True).tolist() == [True, False]   # lower bound 0: open


def test_veto_rejects_a_sequence_with_one_tiny_ratio() -> None:
    """A ratio exactly at the threshold (0.5) passes; 0.6 vetoes row 0 whole."""
    lr = lr_of()
    assert veto_sequences(lr, 0.5).tolist() == [True, True]
    assert veto_sequences(lr, 0.6).tolist() == [False, True]
    cw = compose(lr, Composition("token", 2.0, veto=0.6))
    assert rows(cw.weights) == [[0.0] * 3, [pytest.approx(2.0, rel=1e-15)]]


def m2po_loop(r: list[list[float]], keep: list[list[bool]], adv: list[float] | None, tau: float
              ) -> list[list[bool]]:
    """M2PO's Algorithm 1 (arXiv 2510.01161), literally: T = the trust-region tokens; while
    mean_{T} M2 > τ: drop argmax_{T} M2 from T and from the mask."""
    out = [list(k) for k in keep]
    region = [(b, t) for b, row in enumerate(r) for t, x in enumerate(row) if keep[b][t]
              and (adv is None or (adv[b] > 0 and x > 0) or (adv[b] < 0 and x < 0))]
    while region and sum(r[b][t] ** 2 for b, t in region) / len(region) > tau:
        j = max(region, key=lambda bt: r[bt[0]][bt[1]] ** 2)
        region.remove(j)
        out[j[0]][j[1]] = False
    return out


def test_m2po_by_hand() -> None:
    """Trust region (A > 0, r > 0 or A < 0, r < 0): M2 = 0.01, 0.09 (row 0), 0.16 (row 1): mean
    0.0867 > 0.04, drop 0.16; mean 0.05 > 0.04, drop 0.09; mean 0.01: stop. The -0.5 of row 0
    (M2 0.25, outside the trust region) stays. Without advantages every kept token is a candidate:
    mean 0.092, drop 0.25; 0.0605, drop 0.16; 0.0356: stop."""
    r = torch.tensor([[0.1, -0.5, 0.3], [-0.4, 0.2, 0.05]], dtype=F64)
    keep = torch.ones(2, 3, dtype=torch.bool)
    adv = torch.tensor([1.0, -1.0], dtype=F64)
    assert m2po_mask(r, keep, 0.04, adv).tolist() == [[True, True, False], [False, True, True]]
    assert m2po_mask(r, keep, 0.04).tolist() == m2po_loop(r.tolist(), keep.tolist(), None, 0.04)
    assert m2po_mask(r, keep, 0.04).tolist() == [[True, False, True], [False, True, True]]   # 0.25, 0.16 go


def test_m2po_a_second_moment_exactly_tau_masks_nothing_and_matches_the_loop() -> None:
    r = torch.tensor([[0.5, -0.5, 0.5]], dtype=F64)              # M2 exactly 0.25
    keep = torch.ones(1, 3, dtype=torch.bool)
    assert bool(m2po_mask(r, keep, 0.25).all()) and m2po_mask(r, keep, 0.2499).sum() < 3
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        r = torch.randn(3, 5, generator=g, dtype=F64) * 0.4
        keep = torch.rand(3, 5, generator=g) > 0.2
        adv = torch.randn(3, generator=g, dtype=F64)
        for a in (adv, None):
            want = m2po_loop(r.tolist(), keep.tolist(), None if a is None else a.tolist(), 0.04)
            assert m2po_mask(r, keep, 0.04, a).tolist() == want


@pytest.mark.parametrize("c", [Composition(), Composition("token", 2.0), Composition("sequence", 3.0),
                               Composition("token", math.inf, "token", 0.5, 2.0),
                               Composition("token", 2.0, "geometric", 0.5, 2.0, veto=1e-4, m2po_tau=0.04)])
def test_every_token_masked_keeps_nothing(c: Composition) -> None:
    cw = compose(lr_of(lengths=[0, 0]), c, torch.tensor([1.0, -1.0], dtype=F64))
    assert not bool(cw.kept.any()) and not bool(cw.weights.any()) and not bool(cw.clipped.any())


def test_a_sequence_of_length_one_is_its_token() -> None:
    """Row 1 (one token): sequence weight = token weight, geometric rejection = token rejection."""
    lr = lr_of([[2.0], [0.25]])
    lens = [1, 1]
    assert rows(sequence_weight(lr, lr.valid, 1.5).weights, lens) == rows(token_weight(lr, lr.valid, 1.5).weights, lens)
    assert reject_sequences(lr, 0.5, 3.0, geometric=True).tolist() == [c[0] for c in rows(reject_tokens(lr, 0.5, 3.0), lens)]


def test_a_custom_composition_in_the_loss_by_hand() -> None:
    """custom: sequence weight capped at 3, geometric rejection [0.5, 1.5], reinforce, token
    normalisation: row 0 (geo-mean 1.26) kept with w = 2, row 1 (2 > 1.5) rejected:
    L = -(w A_0 Σ_t logπ_0t) / 4, dL/dlogπ_0t = -w A_0 / 4, row 1's gradient 0 (A_0 = 0.75: the
    advantages pass through float32)."""
    cfg = CorrectionConfig(type="custom", weight="sequence", weight_cap=3.0, reject="geometric",
                           reject_lo=0.5, reject_hi=1.5)
    behav = torch.tensor([[-1.0, -2.0, -1.5], [-0.5, -0.5, -0.5]], dtype=F64)
    logp = behav + torch.tensor([[LN(0.5), 0.0, LN(4.0)], [LN(2.0), 0.0, 0.0]], dtype=F64)
    b = PolicyBatch(logp=logp.requires_grad_(), behav_logp=behav, mask=torch.tensor([[1, 1, 1], [1, 0, 0]]).bool(),
                    advantages=torch.tensor([0.75, -1.0], dtype=F64))
    loss, m = policy_loss(b, AlgorithmConfig(), cfg)
    loss.backward()
    assert b.logp.grad is not None
    assert float(loss.detach()) == pytest.approx(-2.0 * 0.75 * float(logp[0].detach().sum()) / 4, rel=1e-12)
    assert b.logp.grad[0].tolist() == pytest.approx([-2.0 * 0.75 / 4] * 3, rel=1e-12)
    assert b.logp.grad[1].tolist() == [0.0, 0.0, 0.0]
    assert m.masked_token_frac == 0.25 and m.masked_seq_frac == 0.5      # logged as before


# -- the presets: the same numbers as before --------------------------------------------------------
# Today's (pre-composition) functions, copied verbatim from weights.py as the reference.

def _old_capped(lr: LogRatio, cap: float, keep: Tensor) -> CorrectionWeights:
    log_cap = math.log(cap)
    w = torch.exp(lr.r.clamp(-RATIO_LOG_CLAMP, log_cap))
    return CorrectionWeights(weights=torch.where(keep, w, 0.0), kept=keep, clipped=keep & (lr.r > log_cap))


def _old_none(lr: LogRatio, cfg: CorrectionConfig) -> CorrectionWeights:
    return CorrectionWeights(weights=lr.valid.to(lr.r.dtype), kept=lr.valid, clipped=torch.zeros_like(lr.valid))


def _old_tis(lr: LogRatio, cfg: CorrectionConfig) -> CorrectionWeights:
    return _old_capped(lr, cfg.tis_cap, lr.valid)


def _old_icepop(lr: LogRatio, cfg: CorrectionConfig) -> CorrectionWeights:
    keep = lr.valid & (lr.r >= math.log(cfg.icepop_alpha)) & (lr.r <= math.log(cfg.icepop_beta))
    return CorrectionWeights(weights=torch.where(keep, lr.ratio(), 0.0), kept=keep, clipped=torch.zeros_like(keep))


def _old_seq_mask_tis(lr: LogRatio, cfg: CorrectionConfig) -> CorrectionWeights:
    n = lr.valid.sum(dim=1)
    mean_r, nonempty = lr.r.sum(dim=1) / n.clamp(min=1), n > 0
    ok = nonempty & lr.complete & (mean_r >= math.log(cfg.seq_lo)) & (mean_r <= math.log(cfg.seq_hi))
    return _old_capped(lr, cfg.seq_cap, lr.valid & ok[:, None])


OLD = {"none": _old_none, "tis": _old_tis, "icepop": _old_icepop, "seq-mask-tis": _old_seq_mask_tis}


def _fixed_batch(dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """Mismatched log-probs with -inf/nan holes, ratios 1e±30, an empty row, exact bounds."""
    g = torch.Generator().manual_seed(7)
    logp = -torch.rand(8, 16, generator=g, dtype=F64) * 3
    behav = logp + torch.randn(8, 16, generator=g, dtype=F64) * 0.8
    behav[0] += 1.2
    logp[1, :3] = behav[1, :3] + torch.tensor([LN(2.0), LN(0.5), LN(5.0)], dtype=F64)
    logp[2, 0], behav[3, 1], logp[4, 5] = float("-inf"), float("-inf"), float("nan")
    logp[5, 0], logp[5, 1] = behav[5, 0] + LN(1e30), behav[5, 1] - LN(1e30)
    mask = torch.arange(16)[None, :] < torch.tensor([16, 9, 12, 5, 16, 7, 0, 3])[:, None]
    return logp.to(dtype), behav.to(dtype), mask


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("name", list(OLD))
@pytest.mark.parametrize("knobs", [{}, {"tis_cap": 5.0, "icepop_alpha": 0.2, "icepop_beta": 2.0, "seq_lo": 0.8,
                                        "seq_hi": 1.25, "seq_cap": 3.0}])
def test_presets_give_the_old_weights_bit_for_bit(name: str, dtype: torch.dtype, knobs: dict[str, float]) -> None:
    cfg = CorrectionConfig(type=name, **knobs)   # type: ignore[arg-type]
    logp, behav, mask = _fixed_batch(dtype)
    want = OLD[name](LogRatio.build(logp, behav, mask), cfg)
    for got in (correction_weights(name, logp, behav, mask, cfg), CORRECTIONS[name](LogRatio.build(logp, behav, mask), cfg)):
        assert torch.equal(got.weights, want.weights) and torch.equal(got.kept, want.kept)
        assert torch.equal(got.clipped, want.clipped)


# policy_loss on a fixed batch (default knobs, ppo with proximal log-probs), computed before the
# composition existed: (loss, Σ|grad|, masked token share, masked sequence share).
LOGP = [[-0.5, -1.2, -2.0, -0.1, -3.0], [-1.0, -0.7, -0.2, -4.0, -0.9], [-2.2, -0.3, float("-inf"), -1.1, -0.6],
        [-0.8, -0.4, -1.6, -2.4, -0.05]]
DELTA = [[0.4, -0.9, 1.5, 0.05, -0.2], [-0.3, 0.8, 0.1, 0.0, 2.5], [0.2, -0.1, 0.3, -1.7, 0.6],
         [0.02, -0.03, 0.01, 0.04, -0.02]]
RECORDED = {
    ("none", "reinforce"): (0.4864286780357361, 0.800000011920929, 1 / 14, 0.0),
    ("none", "ppo"): (-0.21671855449676514, 0.800448477268219, 1 / 14, 0.0),
    ("tis", "reinforce"): (0.5185850858688354, 0.8496770858764648, 1 / 14, 0.0),
    ("tis", "ppo"): (-0.19775037467479706, 0.8365538716316223, 1 / 14, 0.0),
    ("icepop", "reinforce"): (0.8225771188735962, 0.9968207478523254, 3 / 14, 0.0),
    ("icepop", "ppo"): (-0.33630552887916565, 0.9968206882476807, 3 / 14, 0.0),
    ("seq-mask-tis", "reinforce"): (0.36061060428619385, 0.7342308759689331, 4 / 14, 0.25),
    ("seq-mask-tis", "ppo"): (-0.08230415731668472, 0.7211077809333801, 4 / 14, 0.25),
}


def _recorded_batch() -> PolicyBatch:
    logp = torch.tensor(LOGP)
    behav = logp - torch.tensor(DELTA)
    behav[2, 2] = -1.0
    mask = torch.arange(5)[None, :] < torch.tensor([5, 3, 4, 2])[:, None]
    return PolicyBatch(logp=logp.requires_grad_(), behav_logp=behav, mask=mask,
                       advantages=torch.tensor([1.0, -0.5, 0.7, -1.3]), prox_logp=logp + 0.05 * torch.tensor(DELTA))


@pytest.mark.parametrize(("name", "loss"), list(RECORDED))
def test_presets_give_the_recorded_loss(name: str, loss: str) -> None:
    """The reference path exactly; the fused kernel (reinforce) to float32 rounding."""
    for fz in ([False, True] if loss == "reinforce" and fused.available() else [False]):
        b = _recorded_batch()
        value, m = policy_loss(b, AlgorithmConfig(loss=loss), CorrectionConfig(type=name), use_fused=fz)  # type: ignore[arg-type]
        value.backward()
        assert b.logp.grad is not None
        got = (float(value.detach()), float(b.logp.grad.abs().sum()), m.masked_token_frac, m.masked_seq_frac)
        assert got == (pytest.approx(RECORDED[name, loss], rel=1e-6) if fz else RECORDED[name, loss])


def test_the_default_run_keeps_the_fused_path() -> None:
    """reinforce + tis (the defaults) take the fused kernel, as before; a veto, M2PO's mask, the
    m2po preset, a custom composition or a ratio objective take the reference path."""
    algo, corr = AlgorithmConfig(), CorrectionConfig()
    assert (algo.loss, corr.type) == ("reinforce", "tis") and fusable(algo, corr, "cpu")
    for other in (CorrectionConfig(veto=1e-4), CorrectionConfig(m2po=True), CorrectionConfig(type="m2po"),
                  CorrectionConfig(type="custom", weight="token")):
        assert not fusable(algo, other, "cpu")
    assert not any(fusable(AlgorithmConfig(loss=n), corr, "cpu") for n in ("ppo", "gspo", "gspo-token", "cispo"))
    if fused.available():
        b1, b2 = _recorded_batch(), _recorded_batch()
        v1, _ = policy_loss(b1, algo, corr)
        v2, _ = policy_loss(b2, algo, corr, use_fused=True)
        v1.backward()
        v2.backward()
        assert float(v1.detach()) == float(v2.detach()) and torch.equal(b1.logp.grad, b2.logp.grad)   # type: ignore[arg-type]


def test_preset_compositions() -> None:
    cfg = CorrectionConfig(type="custom", weight="token", weight_cap=3.0, reject="token", reject_hi=4.0,
                           veto=1e-4, m2po=True)
    assert composition(cfg) == Composition("token", 3.0, "token", 0.25, 4.0, 1e-4, 0.04)
    assert composition(CorrectionConfig(type="m2po", m2po_tau=0.1)) == Composition("token", m2po_tau=0.1)
    assert composition(CorrectionConfig(type="icepop")) == Composition("token", math.inf, "token", 0.5, 5.0)
    assert composition(CorrectionConfig(type="seq-mask-tis", veto=1e-3)) == \
        Composition("token", 2.0, "geometric", 0.5, 2.0, veto=1e-3)


# -- the flags ----------------------------------------------------------------------------------------

def test_help_names_every_objective_preset_and_flag() -> None:
    text = " ".join(build_parser().format_help().split())
    for word in ("gspo", "gspo-token", "cispo", "--algorithm.ppo_clip_low", "--algorithm.ppo_clip_high",
                 "--algorithm.ratio_reference", "{proximal,behaviour}", "m2po", "seq-mask-tis", "icepop",
                 "{none,tis,icepop,seq-mask-tis,m2po,custom}", "--correction.weight", "--correction.weight_cap",
                 "--correction.reject", "--correction.reject_lo", "--correction.reject_hi", "--correction.veto",
                 "--correction.m2po", "--correction.m2po_tau", "{none,token,sequence,geometric}"):
        assert word in text, word


@pytest.mark.parametrize(("argv", "flag"), [
    (["--correction.weight", "token"], "--correction.weight: composes --correction.type custom"),
    (["--correction.type", "icepop", "--correction.reject_hi", "2"], "--correction.reject_hi: composes"),
    (["--correction.type", "custom", "--correction.weight_cap", "2"], "--correction.weight_cap: caps"),
    (["--correction.type", "custom", "--correction.reject", "token"], "--correction.reject_hi: --correction.reject"),
    (["--correction.type", "custom", "--correction.reject_lo", "0.5"], "--correction.reject_lo: bounds a rejection"),
    (["--correction.type", "custom", "--correction.reject", "sequence", "--correction.reject_lo", "3",
      "--correction.reject_hi", "2"], "--correction.reject_lo: must be <"),
    (["--correction.veto", "1.5"], "--correction.veto"),
    (["--correction.m2po_tau", "0"], "--correction.m2po_tau"),
    (["--algorithm.ppo_clip_high", "0.28"], "--algorithm.ppo_clip_high: applies to a ratio objective"),
    (["--algorithm.ratio_reference", "behaviour"], "--algorithm.ratio_reference: applies"),
    (["--algorithm.loss", "gspo2"], "--algorithm.loss"),
])
def test_bad_combinations_fail_in_one_line_naming_the_flag(argv: list[str], flag: str) -> None:
    with pytest.raises(UsageError) as err:
        parse_config(argv, check_cpu=False)
    assert str(err.value).startswith(flag) and "\n" not in str(err.value)


def test_good_combinations_parse() -> None:
    cfg, _ = parse_config(["--algorithm.loss", "cispo", "--algorithm.ppo_clip_low", "1", "--algorithm.ppo_clip_high",
                           "4", "--algorithm.ratio_reference", "behaviour", "--correction.type", "custom",
                           "--correction.weight", "sequence", "--correction.weight_cap", "5", "--correction.reject",
                           "geometric", "--correction.reject_hi", "1.001", "--correction.veto", "1e-4",
                           "--correction.m2po", "true"], check_cpu=False)
    assert cfg.correction.reject_bounds() == (1 / 1.001, 1.001) and cfg.algorithm.ppo_clip_low == 1.0
