"""titanloop.parallel.grad_norm on plain tensors (the DTensor mesh groups are covered through the trainer by
test_parallel_layouts.py): the norm equals torch's, clipping scales to max_norm after the norm is known, and a
parameter set without gradients has a norm of 0 (as torch.nn.utils.get_total_norm gives) rather than an error."""

from __future__ import annotations

import torch

from titanloop.parallel.grad_norm import clip_grads_, total_grad_norm


def _params(*grads):
    params = []
    for g in grads:
        p = torch.nn.Parameter(torch.zeros_like(g) if g is not None else torch.zeros(3))
        p.grad = g
        params.append(p)
    return params


def test_norm_equals_torchs_and_clipping_scales_to_max_norm():
    torch.manual_seed(0)
    params = _params(torch.randn(4, 5), None, torch.randn(7))
    expected = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    norm = total_grad_norm(params)
    torch.testing.assert_close(norm, expected)
    clip_grads_(params, 0.5, norm)
    torch.testing.assert_close(total_grad_norm(params), torch.tensor(0.5), rtol=1e-5, atol=0)
    before = [p.grad.clone() for p in params if p.grad is not None]
    clip_grads_(params, 10.0, total_grad_norm(params))  # under max_norm: unchanged
    for b, p in zip(before, [p for p in params if p.grad is not None]):
        torch.testing.assert_close(p.grad, b)


def test_no_gradients_is_a_norm_of_zero():
    """A rank whose trainable parameters got no gradient this step (all None, or none trainable): norm 0, finite,
    and clipping is a no-op; the engine then steps as usual."""
    for params in ([], _params(None, None)):
        norm = total_grad_norm(params)
        assert norm.shape == () and norm.item() == 0.0 and torch.isfinite(norm)
        clip_grads_(params, 1.0, norm)
