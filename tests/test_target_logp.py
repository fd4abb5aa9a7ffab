"""The trainer's log-prob kernel: value and gradient equal autograd's ``gather - logsumexp``."""

from __future__ import annotations

import pytest
import torch

from pipeline_rl.training.logprobs import _target_logp


def _reference(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    scaled = logits / temperature                                                    # [B, N, V]
    return scaled.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(scaled, dim=-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
def test_value_and_gradient_match_autograd(temperature: float) -> None:
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 5, 37, generator=g, dtype=torch.float64) * 4).requires_grad_()
    targets = torch.randint(0, 37, (3, 5), generator=g)
    weights = torch.randn(3, 5, generator=g, dtype=torch.float64)   # a loss that weighs every position
    ours = _target_logp(logits, targets, temperature)
    (d_ours,) = torch.autograd.grad((ours * weights).sum(), logits)
    ref = _reference(logits, targets, temperature)
    (d_ref,) = torch.autograd.grad((ref * weights).sum(), logits)
    assert ours.dtype == torch.float64
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(d_ours, d_ref, rtol=0, atol=1e-12)


def test_gradcheck_and_bfloat16_logits_reach_float32() -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 3, 11, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 11, (2, 3), generator=g)
    assert torch.autograd.gradcheck(lambda x: _target_logp(x, targets, 0.9), (logits,))
    low = torch.randn(2, 3, 11, generator=g).to(torch.bfloat16).requires_grad_()
    out = _target_logp(low, targets, 1.0)
    out.sum().backward()
    assert out.dtype == torch.float32 and low.grad is not None and low.grad.dtype == torch.bfloat16
