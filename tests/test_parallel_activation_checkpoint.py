"""Activation checkpointing policies (titanloop.parallel.activation_checkpoint): none, selective, layer, loop.

Every policy gives the same loss and gradients as none; what they differ in is what they keep for backward and
what they recompute there. Selective keeps the matmul and attention outputs (so backward recomputes no matmul) and
recomputes the elementwise rest; layer keeps each layer's input (backward recomputes every matmul of the forward);
loop keeps each loop's input."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from torch.distributed._tools.mem_tracker import MemTracker

from titanloop.model import LoopLM, preset
from titanloop.parallel.activation_checkpoint import apply_activation_checkpointing, saves_output

POLICIES = ("none", "selective", "layer", "loop")


def test_selective_saves_matmuls_and_attention_only():
    aten = torch.ops.aten
    saved = [aten.mm.default, aten.addmm.default, aten._scaled_mm.default]
    saved += [aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_efficient_attention.default]
    recomputed = [aten.mul.Tensor, aten.add.Tensor, aten.rsqrt.default, aten.silu.default, aten.mean.dim]
    assert all(saves_output(op) for op in saved)
    assert not any(saves_output(op) for op in recomputed)


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def _run(policy: str):
    torch.manual_seed(0)
    model = LoopLM(preset("debug-tiny", vocab_size=64, n_layers=2))
    apply_activation_checkpointing(model, policy)
    x = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(1))
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        out = model(x, 3)
        loss = torch.stack([r.float().pow(2).mean() for r in out.readouts]).sum()
        held = _activations(tracker)  # what the forward keeps for backward
        with _Count() as backward:
            loss.backward()
    grads = {
        n.replace("_checkpoint_wrapped_module.", ""): p.grad.clone()
        for n, p in model.named_parameters()
        if p.grad is not None
    }
    return loss.detach(), grads, held, backward.ops


def _activations(tracker) -> int:
    snap = next(iter(tracker.get_tracker_snapshot("current").values()))
    return sum(v for k, v in snap.items() if str(k).endswith("ACT"))


@pytest.fixture(scope="module")
def runs():
    return {p: _run(p) for p in POLICIES}


def test_every_policy_computes_the_same_loss_and_gradients(runs):
    loss, grads = runs["none"][:2]
    for policy in POLICIES[1:]:
        assert torch.equal(runs[policy][0], loss), policy
        for name, g in grads.items():
            assert torch.allclose(runs[policy][1][name], g, atol=1e-6, rtol=1e-5), (policy, name)


def test_selective_keeps_less_than_none_and_recomputes_no_matmul(runs):
    saved = {p: runs[p][2] for p in POLICIES}  # activation bytes alive between forward and backward
    mm = {p: runs[p][3]["mm"] + runs[p][3]["addmm"] for p in POLICIES}
    print("saved bytes", saved, "backward matmuls", mm)
    assert saved["selective"] < saved["none"]  # the elementwise intermediates are not kept
    assert saved["layer"] < saved["selective"]  # layer keeps only the inputs
    assert mm["selective"] == mm["none"]  # its backward recomputes no matmul ...
    assert mm["layer"] > mm["none"]  # ... while layer AC recomputes every forward matmul
    assert runs["selective"][3]["mul"] > runs["none"][3]["mul"]  # the elementwise work is recomputed
