"""Layer-duplication upcycling: the duplicated stack computes what the chosen layer order says."""

import pytest
import torch

from titanloop.config_errors import ConfigError
from titanloop.model import LoopLM, preset
from titanloop.recipe.upcycle import count_layers, new_layer_sources, upcycle_dcp, upcycle_model, upcycle_state_dict


def _by_hand(model: LoopLM, order_layers, ids, n_loops):
    """Run the ORIGINAL model's layers in the given order, T times, with the same inter-loop norm."""
    cos, sin = model.rope(ids.shape[1], ids.device, torch.float32)
    x = model.embed_tokens(ids)
    for _ in range(n_loops):
        h = x
        for i in order_layers:
            h = model.layers[i](h, cos, sin)
        x = model.norm(h)
    return model.lm_head(x)


@pytest.mark.parametrize("order", ["stack", "interleave"])
def test_upcycled_stack_equals_original_layers_in_order(order):
    torch.manual_seed(0)
    model = LoopLM(preset("debug-tiny", n_layers=3)).eval()
    big = upcycle_model(model, order).eval()
    assert big.cfg.n_layers == 6
    ids = torch.randint(0, model.cfg.vocab_size, (2, 12))
    with torch.no_grad():
        got = big(ids, n_loops=2, return_logits="last").logits
        want = _by_hand(model, new_layer_sources(3, order), ids, 2)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # and it is NOT the original model (the duplication changed the function)
    with torch.no_grad():
        orig = model(ids, n_loops=2, return_logits="last").logits
    assert not torch.allclose(got, orig)


def test_orders():
    assert new_layer_sources(3, "stack") == [0, 1, 2, 0, 1, 2]
    assert new_layer_sources(3, "interleave") == [0, 0, 1, 1, 2, 2]
    with pytest.raises(ConfigError, match="upcycle order"):
        new_layer_sources(3, "shuffle")


def test_optimizer_state_duplicated_and_prelude_untouched():
    sd = {
        "model.layers.0.w": torch.tensor([1.0]),
        "model.layers.1.w": torch.tensor([2.0]),
        "model.prelude.0.w": torch.tensor([9.0]),
        "optimizer.state.layers.1.w.exp_avg": torch.tensor([5.0]),
        "optimizer.state.layers.0.w.step": torch.tensor(7.0),
        "optimizer.state.layers.1.w.step": torch.tensor(7.0),
        "optimizer/state.layers.1.w.exp_avg_sq": torch.tensor(3.0),  # titanloop.checkpoint's DCP key style
    }
    out = upcycle_state_dict(sd, "interleave")
    assert count_layers(out) == 4
    assert out["model.layers.3.w"].item() == 2.0 and out["model.layers.2.w"].item() == 2.0
    assert out["optimizer.state.layers.2.w.exp_avg"].item() == 5.0
    assert out["optimizer.state.layers.3.w.exp_avg"].item() == 5.0
    assert out["optimizer/state.layers.3.w.exp_avg_sq"].item() == 3.0
    assert out["model.prelude.0.w"].item() == 9.0 and "model.prelude.1.w" not in out
    out["model.layers.2.w"] += 1  # copies, not aliases
    assert out["model.layers.3.w"].item() == 2.0
    dropped = upcycle_state_dict(sd, "stack", drop_optimizer=True)
    assert not any(k.startswith("optimizer") for k in dropped)


def test_dcp_round_trip(tmp_path):
    import torch.distributed.checkpoint as dcp

    from titanloop.checkpoint.safe_reader import read_dcp_entries

    model = LoopLM(preset("debug-tiny"))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randint(0, 512, (1, 8))).readouts[-1].sum().backward()
    opt.step()
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    for name, p in model.named_parameters():
        for sk, sv in opt.state[p].items():
            state[f"optimizer.state.{name}.{sk}"] = sv
    state["optimizer.param_groups.lr"] = 1e-3  # plain data (stored pickled by DCP) is carried over
    state["optimizer.param_groups.betas"] = [0.9, 0.95]
    dcp.save(state, checkpoint_id=str(tmp_path / "src"), no_dist=True)
    upcycle_dcp(tmp_path / "src", tmp_path / "dst", "stack")
    loaded = read_dcp_entries(tmp_path / "dst")
    assert count_layers(loaded) == 2 * model.cfg.n_layers
    assert loaded["optimizer.param_groups.lr"] == 1e-3 and loaded["optimizer.param_groups.betas"] == [0.9, 0.95]
    big = upcycle_model(model, "stack")
    for k, v in big.state_dict().items():
        torch.testing.assert_close(loaded[f"model.{k}"], v, rtol=0, atol=0)
    n = model.cfg.n_layers
    moments = [k for k in loaded if ".exp_avg" in k and f"layers.{n}." in k]
    assert moments, "no duplicated optimizer moment found"
    for k in moments:
        torch.testing.assert_close(loaded[k], loaded[k.replace(f"layers.{n}.", "layers.0.")], rtol=0, atol=0)


def test_dcp_errors(tmp_path):
    with pytest.raises(ConfigError, match="not a DCP checkpoint"):
        upcycle_dcp(tmp_path, tmp_path / "out")
