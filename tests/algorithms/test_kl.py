"""The k3 KL estimator against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from periodic_rl.algorithms import k3_kl


def test_values():
    logps = torch.tensor([-1.0, -1.0, -1.0], dtype=torch.float64)
    # delta = ref - logp = 0, ln 2, -ln 2
    ref = logps + torch.tensor([0.0, math.log(2), -math.log(2)], dtype=torch.float64)
    # exp(0) - 0 - 1 = 0; 2 - ln2 - 1 = 0.30685282; 0.5 + ln2 - 1 = 0.19314718
    expected = torch.tensor([0.0, 1 - math.log(2), math.log(2) - 0.5], dtype=torch.float64)
    assert expected[1].item() == pytest.approx(0.3068528, abs=1e-7)
    assert expected[2].item() == pytest.approx(0.1931472, abs=1e-7)
    torch.testing.assert_close(k3_kl(logps, ref), expected)


def test_non_negative_and_gradient():
    torch.manual_seed(0)
    logps = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    ref = torch.randn(4, 5, dtype=torch.float64)
    kl = k3_kl(logps, ref)
    assert (kl >= 0).all()
    kl.sum().backward()
    # d/dlogp [exp(ref - logp) - (ref - logp) - 1] = 1 - exp(ref - logp)
    torch.testing.assert_close(logps.grad, 1 - torch.exp(ref - logps.detach()))


def test_shape_mismatch():
    with pytest.raises(ValueError, match="differ in shape"):
        k3_kl(torch.zeros(2, 3), torch.zeros(3, 2))
