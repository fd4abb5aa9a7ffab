"""The ratio objectives (``--algorithm.loss ppo|gspo|gspo-token|cispo``, docs/objectives.md): value
and gradient of ``policy_loss`` against hand computations from each paper's formula on batches of
2 sequences x 3 tokens, in float64, plus the edge cases (a sequence of length 1, every token masked,
a ratio exactly on the clip bound) and the ratio's reference (proximal or behaviour).

The hand computations are plain Python (``math``) over lists; ``d`` is the per-token log-ratio
``logπ_θ − log π_ref`` and the ratio's reference is the proximal policy unless said otherwise."""

from __future__ import annotations

import math

import pytest
import torch

from pipeline_rl.config import AlgorithmConfig, CorrectionConfig
from pipeline_rl.correction import OBJECTIVES, PolicyBatch, policy_loss
from pipeline_rl.correction.objectives import clip_range

F64 = torch.float64
NONE = CorrectionConfig(type="none")
RATIO_LOSSES = [n for n in OBJECTIVES if n != "reinforce"]


def batch(d: list[list[float]], adv: list[float], lengths: list[int] | None = None,
          base: float = -1.0, behav_shift: list[list[float]] | None = None) -> PolicyBatch:
    """Rows of log-ratios ``d`` (padded to 3 with 0): ``prox = base``, ``logp = base + d``,
    ``behav = base - behav_shift`` (so ``log π_prox/μ = behav_shift``)."""
    T = 3
    rows = [r + [0.0] * (T - len(r)) for r in d]
    lengths = lengths or [len(r) for r in d]
    prox = torch.full((len(d), T), base, dtype=F64)
    shift = torch.tensor([r + [0.0] * (T - len(r)) for r in behav_shift], dtype=F64) if behav_shift \
        else torch.zeros_like(prox)
    mask = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]
    return PolicyBatch(logp=(prox + torch.tensor(rows, dtype=F64)).requires_grad_(), behav_logp=prox - shift,
                       mask=mask, advantages=torch.tensor(adv, dtype=F64), prox_logp=prox.clone())


def run(b: PolicyBatch, algo: AlgorithmConfig, corr: CorrectionConfig = NONE
        ) -> tuple[float, list[list[float]], float]:
    """(loss, gradient rows cut to each sequence's length, ppo_clipped_frac)."""
    loss, m = policy_loss(b, algo, corr, use_fused=False)
    loss.backward()
    assert b.logp.grad is not None
    lengths = b.mask.sum(dim=1).tolist()
    return float(loss.detach()), [b.logp.grad[i, :n].tolist() for i, n in enumerate(lengths)], m.ppo_clipped_frac


def clip(x: float, lo: float, hi: float) -> float:
    return min(max(x, lo), hi)


def close(got: list[list[float]], want: list[list[float]], rel: float = 1e-12) -> bool:
    return all(g == pytest.approx(w, rel=rel, abs=1e-15) for g, w in zip(got, want, strict=True))


# -- the hand computations (each paper's formula) -----------------------------------------------

def gspo_hand(d: list[list[float]], adv: list[float], lo: float, hi: float, norm: str
              ) -> tuple[float, list[list[float]]]:
    """GSPO (arXiv 2507.18071, eq. 5-7): s_i = exp(mean_t d), J = Σ_i c_i min(s_i A_i, clip(s_i) A_i)
    with c_i = 1/G (sequence normalisation, the paper's) or |y_i| / Σ|y| (token: the sequence's
    term on each token); ∇J = c_i s_i A_i · (1/|y_i|) Σ_t ∇logπ_t on the unclipped branch."""
    total = sum(len(r) for r in d)
    value, grads = 0.0, []
    for r, a in zip(d, adv):
        c = 1 / len(d) if norm == "sequence" else len(r) / total
        s = math.exp(sum(r) / len(r))
        unclipped = s * a <= clip(s, lo, hi) * a
        value += c * min(s * a, clip(s, lo, hi) * a)
        grads.append([-c * s * a / len(r) if unclipped else 0.0] * len(r))
    return -value, grads


def ppo_hand(d: list[list[float]], adv: list[float], lo: float, hi: float
             ) -> tuple[float, list[list[float]]]:
    """PPO's clipped surrogate (token normalisation): -1/N Σ min(ρA, clip(ρ, lo, hi)A)."""
    n = sum(len(r) for r in d)
    value, grads = 0.0, []
    for r, a in zip(d, adv):
        rho = [math.exp(x) for x in r]
        value += sum(min(p * a, clip(p, lo, hi) * a) for p in rho)
        grads.append([-p * a / n if p * a <= clip(p, lo, hi) * a else 0.0 for p in rho])
    return -value / n, grads


def cispo_hand(d: list[list[float]], adv: list[float], lp: list[list[float]], lo: float, hi: float
               ) -> tuple[float, list[list[float]]]:
    """CISPO (arXiv 2506.13585, eq. 4): -1/N Σ sg(clip(ρ, lo, hi)) A logπ; ∇ = -clip(ρ) A / N."""
    n = sum(len(r) for r in d)
    value = sum(clip(math.exp(x), lo, hi) * a * y for r, a, lps in zip(d, adv, lp) for x, y in zip(r, lps))
    return -value / n, [[-clip(math.exp(x), lo, hi) * a / n for x in r] for r, a in zip(d, adv)]


# -- GSPO ------------------------------------------------------------------------------------------

D = [[0.3, -0.1, 0.1], [0.5]]          # s_0 = e^0.1 (inside [0.8, 1.2]), s_1 = e^0.5 (outside)


@pytest.mark.parametrize("norm", ["sequence", "token"])
@pytest.mark.parametrize("adv", [[1.0, -2.0], [1.0, 2.0], [-1.5, 0.5]])
def test_gspo_value_and_gradient_by_hand(adv: list[float], norm: str) -> None:
    """Row 1 has one token (its sequence ratio is its token ratio); with A_1 = -2 it is on the
    unclipped branch (gradient s·A), with A_1 = +2 clipped (gradient 0). (The sequence
    normalisation's row scale A_b / |y_b| is float32 on every path, hence its looser tolerance.)"""
    algo = AlgorithmConfig(loss="gspo", normalization=norm)   # type: ignore[arg-type]
    value, grad, clipped = run(batch(D, adv), algo)
    want_v, want_g = gspo_hand(D, adv, 0.8, 1.2, norm)
    rel = 1e-7 if norm == "sequence" else 1e-12
    assert value == pytest.approx(want_v, rel=rel) and close(grad, want_g, rel)
    assert clipped == (0.25 if adv[1] > 0 else 0.0)            # row 1's one token of 4


def test_gspo_token_equals_gspo_with_sequence_advantages() -> None:
    """GSPO-token: s_t = sg[s] π_t / sg[π_t]: the same value, clip and gradient as GSPO when every
    token of a sequence has the sequence's advantage (the paper's remark)."""
    for adv in ([1.0, -2.0], [1.0, 2.0]):
        a = run(batch(D, adv), AlgorithmConfig(loss="gspo", normalization="sequence"))
        b = run(batch(D, adv), AlgorithmConfig(loss="gspo-token", normalization="sequence"))
        assert a[0] == pytest.approx(b[0], rel=1e-14) and close(b[1], a[1]) and a[2] == b[2]


def test_gspo_token_keeps_each_tokens_own_weight() -> None:
    """Per-token weights w_t (here TIS on π_prox/μ = 0.5, 1, 2 against a cap of 5): GSPO-token's
    gradient on token t is -s·A·w_t / N, GSPO's -s·A·mean_t(w) / N on every token."""
    w = [0.5, 1.0, 2.0]
    shift = [[math.log(x) for x in w], [0.0]]
    corr = CorrectionConfig(type="tis", tis_cap=5.0)
    s, a, n = math.exp(0.1), 1.0, 4
    tok = run(batch(D, [a, -2.0], behav_shift=shift), AlgorithmConfig(loss="gspo-token"), corr)
    seq = run(batch(D, [a, -2.0], behav_shift=shift), AlgorithmConfig(loss="gspo"), corr)
    assert tok[1][0] == pytest.approx([-s * a * x / n for x in w], rel=1e-12)
    assert seq[1][0] == pytest.approx([-s * a * sum(w) / 3 / n] * 3, rel=1e-12)
    assert tok[0] == pytest.approx(seq[0], rel=1e-14)           # the same value


# -- PPO with a decoupled clip, CISPO ---------------------------------------------------------------

D2 = [[0.35, -0.4, 0.05], [-0.1, 0.2, 0.0]]   # ratios 1.42, 0.67, 1.05 / 0.90, 1.22, 1.0


@pytest.mark.parametrize("adv", [[1.0, -0.5], [-1.0, 2.0]])
def test_ppo_decoupled_clip_by_hand(adv: list[float]) -> None:
    """DAPO's clip-higher: [1 - 0.2, 1 + 0.28]; 1.42 is above 1.28, 0.67 below 0.8."""
    algo = AlgorithmConfig(loss="ppo", ppo_clip_low=0.2, ppo_clip_high=0.28)
    assert clip_range(algo) == (0.8, 1.28)
    value, grad, _ = run(batch(D2, adv), algo)
    want_v, want_g = ppo_hand(D2, adv, 0.8, 1.28)
    assert value == pytest.approx(want_v, rel=1e-12) and close(grad, want_g)


@pytest.mark.parametrize("low", [0.2, 1.0])
def test_cispo_by_hand(low: float) -> None:
    """Every token keeps a gradient, weighted by the clipped ratio (ε_low = 1: no lower bound, as
    MiniMax-M1); the clipped share counts the tokens whose weight was cut."""
    adv = [1.0, -0.5]
    algo = AlgorithmConfig(loss="cispo", ppo_clip_low=low, ppo_clip_high=0.28)
    b = batch(D2, adv)
    lp = [r[:3] for r in b.logp.detach().tolist()]
    value, grad, clipped = run(b, algo)
    want_v, want_g = cispo_hand(D2, adv, lp, 1.0 - low, 1.28)
    assert value == pytest.approx(want_v, rel=1e-12) and close(grad, want_g)
    assert all(g != 0.0 for row in grad for g in row)
    assert clipped == pytest.approx((2 if low < 1.0 else 1) / 6)


def test_first_epoch_ratio_objectives_are_reinforce() -> None:
    """No proximal log-probs yet (the first pass over a batch): every ratio is 1, so each ratio
    objective's gradient is REINFORCE's (its clip never binds)."""
    base = batch(D2, [1.0, -0.5])
    base.prox_logp = None
    _, want, _ = run(base, AlgorithmConfig(loss="reinforce"))
    for name in RATIO_LOSSES:
        b = batch(D2, [1.0, -0.5])
        b.prox_logp = None
        _, grad, clipped = run(b, AlgorithmConfig(loss=name))   # type: ignore[arg-type]
        assert close(grad, want) and clipped == 0.0, name


# -- the ratio's reference --------------------------------------------------------------------------

def test_behaviour_reference_takes_the_ratio_against_the_generator() -> None:
    """ratio_reference behaviour: ρ = π_θ/μ (here prox = μ + 0.3 per token, so ρ = e^{d + 0.3});
    the correction's weight is dropped (TIS would weight by π_prox/μ again), its rejection kept
    (ICEPOP's band [0.5, 1.3] drops the tokens whose π_prox/μ = e^0.3 = 1.35 is above it)."""
    adv = [1.0, -0.5]
    shift = [[0.3] * 3, [0.3] * 3]
    d_behav = [[x + 0.3 for x in r] for r in D2]
    algo = AlgorithmConfig(loss="ppo", ratio_reference="behaviour")
    value, grad, _ = run(batch(D2, adv, behav_shift=shift), algo, CorrectionConfig(type="tis"))
    want_v, want_g = ppo_hand(d_behav, adv, 0.8, 1.2)
    assert value == pytest.approx(want_v, rel=1e-12) and close(grad, want_g)
    value, grad, _ = run(batch(D2, adv, behav_shift=shift), algo,
                         CorrectionConfig(type="icepop", icepop_beta=1.3))
    assert value == 0.0 and all(g == 0.0 for row in grad for g in row)


def test_proximal_reference_is_the_default_and_weights_by_prox_over_behaviour() -> None:
    """The default (today's ppo): ρ = π_θ/π_prox, times the TIS weight min(π_prox/μ, 2) = e^0.3."""
    assert AlgorithmConfig().ratio_reference == "proximal"
    adv = [1.0, -0.5]
    value, grad, _ = run(batch(D2, adv, behav_shift=[[0.3] * 3] * 2), AlgorithmConfig(loss="ppo"),
                         CorrectionConfig(type="tis"))
    want_v, want_g = ppo_hand(D2, adv, 0.8, 1.2)
    w = math.exp(0.3)
    assert value == pytest.approx(want_v * w, rel=1e-12)
    assert close(grad, [[g * w for g in row] for row in want_g])


# -- edge cases --------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_every_token_masked_gives_zero_loss_and_gradient(name: str) -> None:
    b = batch(D2, [1.0, -0.5], lengths=[0, 0])
    loss, m = policy_loss(b, AlgorithmConfig(loss=name), NONE, use_fused=False)   # type: ignore[arg-type]
    loss.backward()
    assert float(loss.detach()) == 0.0 and m.all_masked and m.ppo_clipped_frac == 0.0
    assert b.logp.grad is not None and not bool(b.logp.grad.any())


def test_length_one_sequences_make_gspo_ppo() -> None:
    """A sequence of one token: its sequence ratio is its token ratio, so GSPO, GSPO-token and
    PPO agree in value and gradient."""
    d, adv = [[0.3], [-0.4]], [1.0, -2.0]
    want = run(batch(d, adv), AlgorithmConfig(loss="ppo"))
    for name in ("gspo", "gspo-token"):
        got = run(batch(d, adv), AlgorithmConfig(loss=name))   # type: ignore[arg-type]
        assert got[0] == pytest.approx(want[0], rel=1e-14) and close(got[1], want[1]) and got[2] == want[2]


@pytest.mark.parametrize("name", RATIO_LOSSES)
def test_a_ratio_exactly_on_the_bound_is_not_clipped(name: str) -> None:
    """Every token's ratio (and so each sequence's geometric mean) is exactly 1 + ε: the clip
    interval is inclusive, so the gradient is the unclipped one, -ρ·A/N per token, and nothing is
    counted as clipped. x = 2^-5 keeps the mean of three x exact; ρ = exp(x) as torch computes it,
    and ε = ρ - 1 is exact (Sterbenz), so 1 + ε == ρ."""
    x = 2.0 ** -5
    rho = float(torch.exp(torch.tensor(x, dtype=F64)))
    algo = AlgorithmConfig(loss=name, ppo_clip=rho - 1.0)   # type: ignore[arg-type]
    assert clip_range(algo)[1] == rho
    _, grad, clipped = run(batch([[x, x, x], [x]], [1.0, 1.0], base=0.0), algo)
    assert close(grad, [[-rho / 4] * 3, [-rho / 4]]) and clipped == 0.0


def test_ratio_flags_with_reinforce_fail_in_one_line() -> None:
    for kw in ({"ppo_clip_low": 0.2}, {"ppo_clip_high": 0.28}, {"ratio_reference": "behaviour"}):
        with pytest.raises(ValueError, match=f"algorithm.{next(iter(kw))}: applies to a ratio objective"):
            AlgorithmConfig(**kw)   # type: ignore[arg-type]
