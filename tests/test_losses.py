"""Chunked soft cross-entropy equals the plain one, value and gradient; β weights."""
import pytest
import torch

from beagle.losses import beta_weights, regression_loss, soft_cross_entropy


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_chunked_soft_ce_matches_dense(chunk):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(9, 16, generator=g, requires_grad=True)
    target = torch.randn(9, 16, generator=g) * 2
    head = torch.randn(64, 16, generator=g)
    loss, arg_q, arg_t = soft_cross_entropy(hidden, target, head, chunk)
    dense = -(torch.softmax(target @ head.T, -1) * torch.log_softmax(hidden @ head.T, -1)).sum(-1)
    torch.testing.assert_close(loss, dense)
    assert torch.equal(arg_q, (hidden @ head.T).argmax(-1))
    assert torch.equal(arg_t, (target @ head.T).argmax(-1))
    w = torch.rand(9, generator=g)
    (grad,) = torch.autograd.grad((loss * w).sum(), hidden)
    (dense_grad,) = torch.autograd.grad((dense * w).sum(), hidden)
    torch.testing.assert_close(grad, dense_grad)


def test_soft_ce_is_minimal_at_the_target():
    g = torch.Generator().manual_seed(1)
    target = torch.randn(4, 8, generator=g)
    head = torch.randn(20, 8, generator=g)
    at_target, _, _ = soft_cross_entropy(target.clone(), target, head, 6)
    elsewhere, _, _ = soft_cross_entropy(target + torch.randn(4, 8, generator=g), target, head, 6)
    assert (at_target < elsewhere).all()


def test_regression_and_betas():
    a = torch.zeros(2, 4)
    assert torch.equal(regression_loss(a, a), torch.zeros(2))
    assert beta_weights(4) == [0.4, 0.3, 0.2, 0.1]
    assert beta_weights(1) == [1.0]
