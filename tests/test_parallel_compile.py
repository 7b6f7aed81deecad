"""torch.compile of the decoder layers compiles once and is reused for every loop and every loop count."""

from __future__ import annotations

import torch
from torch._dynamo.testing import CompileCounter

from titanloop.model import LoopLM, preset
from titanloop.parallel import apply_activation_checkpointing, apply_compile


def _run(model, n_loops, x=None):
    x = torch.randint(0, model.cfg.vocab_size, (2, 16)) if x is None else x
    out = model(x, n_loops)
    sum(r.float().pow(2).mean() for r in out.readouts).backward()


def test_compiled_layers_do_not_recompile_across_loops_and_loop_counts():
    torch._dynamo.reset()
    model = LoopLM(preset("debug-tiny", n_layers=2))
    counter = CompileCounter()
    apply_compile(model, backend=counter)
    _run(model, 1)
    after_first = counter.frame_count
    assert 1 <= after_first <= len(model.layers)  # at most one graph per layer (shared code may reuse it)
    for n_loops in (4, 2, 7, 3):
        _run(model, n_loops)
    assert counter.frame_count == after_first, f"recompiled: {after_first} -> {counter.frame_count} graphs"


def test_compiled_model_matches_eager():
    torch._dynamo.reset()
    model = LoopLM(preset("debug-tiny"))
    x = torch.randint(0, model.cfg.vocab_size, (2, 16))
    ref = model(x, 3).readouts[-1]
    apply_compile(model, backend="aot_eager")
    out = model(x, 3).readouts[-1]
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert all("_orig_mod" not in n for n, _ in model.named_parameters())  # names unchanged


def test_loop_and_layer_activation_checkpointing_keep_gradients():
    torch.manual_seed(0)
    ref = LoopLM(preset("debug-tiny"))
    x = torch.randint(0, ref.cfg.vocab_size, (2, 16))
    grads = {}
    for mode in ("none", "loop", "layer"):
        model = LoopLM(preset("debug-tiny"))
        model.load_state_dict(ref.state_dict())
        apply_activation_checkpointing(model, mode)
        _run(model, 3, x)
        grads[mode] = [p.grad for p in model.parameters() if p.grad is not None]
        assert len(grads[mode]) > 10
    for mode in ("loop", "layer"):
        for a, b in zip(grads["none"], grads[mode]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
