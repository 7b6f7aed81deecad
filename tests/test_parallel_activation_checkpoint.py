"""Activation checkpointing policies (titanloop.parallel.activation_checkpoint): none, selective, layer, loop.

Every policy gives the same loss and gradients as none; what they differ in is what they keep for backward and
what they recompute there. Selective keeps the matmul and attention outputs (so backward recomputes no matmul) and
recomputes the elementwise rest; layer keeps each layer's input (backward recomputes every matmul of the forward);
loop keeps each loop's input, and with kept loops (parallelism.ac_kept_loops) the first k loops' activations too."""

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


def _run(policy: str, kept_loops: int = 0):
    torch.manual_seed(0)
    model = LoopLM(preset("debug-tiny", vocab_size=64, n_layers=2))
    apply_activation_checkpointing(model, policy, kept_loops)
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


def test_kept_loops_recompute_only_the_other_loops(runs):
    """Per-loop AC with the first k of T = 3 loops kept: the same loss and gradients; backward recomputes the
    forward matmuls of T - k loops (k = 0 is "loop", k = T is "none"), and the forward keeps more with every kept
    loop, up to what "none" keeps."""
    mm = lambda ops: ops["mm"] + ops["addmm"]  # noqa: E731
    base, full = mm(runs["none"][3]), mm(runs["loop"][3])
    per_loop = (full - base) // 3
    assert per_loop > 0 and full - base == 3 * per_loop
    kept = {k: _run("loop", k) for k in (1, 2, 3)}
    loss, grads = runs["none"][:2]
    held = [runs["loop"][2]] + [kept[k][2] for k in (1, 2, 3)]
    print("held bytes for kept 0..3", held, "none", runs["none"][2])
    for k, (k_loss, k_grads, _, ops) in kept.items():
        assert torch.equal(k_loss, loss), k
        for name, g in grads.items():
            assert torch.allclose(k_grads[name], g, atol=1e-6, rtol=1e-5), (k, name)
        assert mm(ops) - base == (3 - k) * per_loop, (k, mm(ops), base, per_loop)
    assert held[0] < held[1] < held[2] < held[3]
    assert held[3] == runs["none"][2]  # every loop kept: what "none" keeps


def test_kept_loops_apply_to_per_loop_ac_only():
    from titanloop.config_errors import ConfigError

    model = LoopLM(preset("debug-tiny", vocab_size=64, n_layers=2))
    with pytest.raises(ConfigError, match=r"ac_kept_loops=1 is invalid: expected 0 with .*'layer'"):
        apply_activation_checkpointing(model, "layer", 1)
    with pytest.raises(ConfigError, match=r"ac_kept_loops=-1 is invalid: expected an integer >= 0"):
        apply_activation_checkpointing(model, "loop", -1)
