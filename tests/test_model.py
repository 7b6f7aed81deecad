"""LoopLM (RECIPE §1): T = 1 is a plain transformer, looping, readout variants and the optional components."""

import math

import pytest
import torch

from titanloop.config_errors import ConfigError
from titanloop.model import LoopLM, LoopLMConfig, preset

V, S = 96, 10


def tiny_cfg(**kw) -> LoopLMConfig:
    cfg = dict(vocab_size=V, hidden_size=32, n_heads=4, ffn_hidden_size=64, n_layers=2, n_loops=3, max_seq_len=64)
    cfg.update(kw)
    return LoopLMConfig(**cfg)


def tiny(**kw) -> LoopLM:
    torch.manual_seed(0)
    return LoopLM(tiny_cfg(**kw))


def ids(b=2, s=S):
    return torch.randint(0, V, (b, s), generator=torch.Generator().manual_seed(1))


# ----- an independent plain transformer (no titanloop code), reading the LoopLM's weights --------------------
def rms(x, w, eps):
    return w * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, theta):
    """x [B, heads, S, D]; rotate-half RoPE (Hugging Face / Llama layout)."""
    d, s = x.shape[-1], x.shape[-2]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.arange(s, dtype=torch.float64)[:, None] * inv[None, :]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def plain_transformer_logits(sd: dict, cfg: LoopLMConfig, tokens: torch.Tensor) -> torch.Tensor:
    """N-layer pre/post ('sandwich') RMSNorm transformer, float64, written out by hand."""
    w = {k: v.double() for k, v in sd.items()}
    eps, nh, nkv = cfg.norm_eps, cfg.n_heads, cfg.kv_heads
    hd = cfg.hidden_size // nh
    x = w["embed_tokens.weight"][tokens]
    b, s, _ = x.shape
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        a_in = rms(x, w[p + "input_layernorm.weight"], eps)
        q = (a_in @ w[p + "self_attn.q_proj.weight"].t()).view(b, s, nh, hd).transpose(1, 2)
        k = (a_in @ w[p + "self_attn.k_proj.weight"].t()).view(b, s, nkv, hd).transpose(1, 2)
        v = (a_in @ w[p + "self_attn.v_proj.weight"].t()).view(b, s, nkv, hd).transpose(1, 2)
        q, k = rope(q, cfg.rope_theta), rope(k, cfg.rope_theta)
        k, v = k.repeat_interleave(nh // nkv, dim=1), v.repeat_interleave(nh // nkv, dim=1)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
        att = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v
        att = att.transpose(1, 2).reshape(b, s, -1) @ w[p + "self_attn.o_proj.weight"].t()
        x = x + rms(att, w[p + "input_layernorm_2.weight"], eps)
        m_in = rms(x, w[p + "post_attention_layernorm.weight"], eps)
        gate, up = m_in @ w[p + "mlp.gate_proj.weight"].t(), m_in @ w[p + "mlp.up_proj.weight"].t()
        mlp = (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].t()
        x = x + rms(mlp, w[p + "post_attention_layernorm_2.weight"], eps)
    return rms(x, w["norm.weight"], eps) @ w["lm_head.weight"].t()


def randomize_norms(model: LoopLM):
    """RMSNorm weights start at 1; perturb them so tests can tell which norm is applied where."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name or "loop_norms" in name:
                p.uniform_(0.5, 1.5)


@pytest.mark.parametrize("kv_heads", [None, 2])
def test_t1_equals_a_plain_n_layer_transformer(kv_heads):
    model = tiny(n_kv_heads=kv_heads, rope_theta=500.0)
    randomize_norms(model)
    tokens = ids()
    got = model(tokens, n_loops=1, return_logits="last").logits
    ref = plain_transformer_logits(model.state_dict(), model.cfg, tokens)
    torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-5)


def test_looping_applies_the_same_stack_t_times_with_inter_loop_norm():
    """T = 3 equals the plain transformer's body run three times, with the final norm between loops."""
    model = tiny()
    randomize_norms(model)
    tokens = ids()
    out = model(tokens, n_loops=3)
    cos, sin = model.rope(S, tokens.device, torch.float32)
    x = model.embed_tokens(tokens)
    for t in range(3):
        h = x
        for layer in model.layers:
            h = layer(h, cos, sin)
        torch.testing.assert_close(out.states[t], h)
        x = model.norm(h)
        torch.testing.assert_close(out.readouts[t], x)
        torch.testing.assert_close(out.gate_logits[t], model.early_exit_gate(x).squeeze(-1))
    torch.testing.assert_close(out.next_input, x)


def test_changing_t_at_forward_time():
    model = tiny(n_loops=3)
    tokens = ids()
    short, default, long = model(tokens, n_loops=2), model(tokens), model(tokens, n_loops=7)
    assert (short.n_loops, default.n_loops, long.n_loops) == (2, 3, 7)
    assert long.gate_logits.shape == (7, 2, S)
    for t in range(2):  # loops are sequential: the first loops do not depend on how many follow
        torch.testing.assert_close(short.readouts[t], long.readouts[t], rtol=0, atol=0)
    torch.testing.assert_close(default.readouts[2], long.readouts[2], rtol=0, atol=0)
    assert not torch.allclose(long.readouts[6], long.readouts[2])  # more loops do change the state
    assert model(tokens, n_loops=4, return_logits="all").logits.shape == (4, 2, S, V)
    with pytest.raises(ConfigError, match="n_loops"):
        model(tokens, n_loops=0)


def test_readout_variants():
    tokens = ids()
    norm_m = tiny(readout="norm")
    raw_m = tiny(readout="raw")
    fon_m = tiny(readout="final_only_norm")
    randomize_norms(norm_m)
    raw_m.load_state_dict(norm_m.state_dict())
    fon_m.load_state_dict(norm_m.state_dict())
    on, raw, fon = norm_m(tokens), raw_m(tokens), fon_m(tokens)
    for t in range(3):
        torch.testing.assert_close(on.readouts[t], norm_m.norm(on.states[t]))  # norm: RMSNorm readout
        assert torch.equal(raw.readouts[t], raw.states[t])  # raw: logits from the raw state
        expect = fon.states[t] if t < 2 else fon_m.norm(fon.states[t])  # final_only_norm
        torch.testing.assert_close(fon.readouts[t], expect)
        # the readout does not change the recurrence or the gate (both read norm(h_t))
        torch.testing.assert_close(raw.states[t], on.states[t])
        torch.testing.assert_close(raw.gate_logits[t], on.gate_logits[t])


def test_inter_loop_norm_off_feeds_the_raw_state():
    model = tiny(inter_loop_norm=False)
    randomize_norms(model)
    tokens = ids()
    out = model(tokens)
    cos, sin = model.rope(S, tokens.device, torch.float32)
    x = model.embed_tokens(tokens)
    for t in range(3):
        x = model.loop_step(x, t, cos, sin)  # next input is the raw state, no norm in between
        torch.testing.assert_close(out.states[t], x)
        torch.testing.assert_close(out.readouts[t], model.norm(x))  # readout still 'norm'
    on = LoopLM(model.cfg.replace(inter_loop_norm=True))
    on.load_state_dict(model.state_dict())
    assert not torch.allclose(on(tokens).states[1], out.states[1])


@pytest.mark.parametrize("inter_loop_norm", [False, True])
def test_inject_embedding_adds_the_embedded_input_to_every_later_loop(inter_loop_norm):
    """Loop t + 1 reads (norm of) H_t plus the embedding, computed by hand from the loop step; T = 1 is the model
    without injection, weights unchanged (so a T = 1 baseline trains the same recipe); dropping the injection
    changes loop 2 onwards."""
    model = tiny(inter_loop_norm=inter_loop_norm, inject_embedding=True, n_prelude_layers=1)
    randomize_norms(model)
    tokens = ids()
    out = model(tokens)
    cos, sin = model.rope(S, tokens.device, torch.float32)
    e = model.prelude[0](model.embed_tokens(tokens), cos, sin)
    x = e
    for t in range(3):
        h = model.loop_step(x, t, cos, sin)
        torch.testing.assert_close(out.states[t], h)
        x = (model.norm(h) if inter_loop_norm else h) + e
    torch.testing.assert_close(out.next_input, x)
    plain = LoopLM(model.cfg.replace(inject_embedding=False))
    plain.load_state_dict(model.state_dict())
    torch.testing.assert_close(plain(tokens, n_loops=1).states[0], model(tokens, n_loops=1).states[0], rtol=0, atol=0)
    assert not torch.allclose(plain(tokens).states[1], out.states[1])


def test_prelude_and_coda():
    model = tiny(n_prelude_layers=1, n_coda_layers=1)
    assert len(model.prelude) == 1 and len(model.coda) == 1
    calls = {"prelude": 0, "coda": 0, "loop": 0}
    for name, mod in (("prelude", model.prelude[0]), ("coda", model.coda[0]), ("loop", model.layers[0])):
        mod.register_forward_hook(lambda *_, n=name: calls.__setitem__(n, calls[n] + 1))
    tokens = ids()
    out = model(tokens)
    assert calls == {"prelude": 1, "coda": 3, "loop": 3}  # prelude once, coda before every loop's readout
    cos, sin = model.rope(S, tokens.device, torch.float32)
    x = model.prelude[0](model.embed_tokens(tokens), cos, sin)
    for t in range(3):
        h = model.loop_step(x, t, cos, sin)
        torch.testing.assert_close(out.states[t], h)
        torch.testing.assert_close(out.readouts[t], model.norm(model.coda[0](h, cos, sin)))
        x = model.norm(h)  # the coda does not feed the recurrence
    assert model.num_params() == model.cfg.param_count()


def test_gated_recurrence_at_init():
    model = tiny(gated_recurrence=True)
    assert torch.all(model.recurrence_gate.weight == 0)
    g0 = torch.sigmoid(torch.tensor(-2.0))
    assert abs(g0.item() - 0.1192) < 1e-4  # ≈ 88% of the old state is retained at init
    tokens = ids()
    out = model(tokens)
    cos, sin = model.rope(S, tokens.device, torch.float32)
    x = model.embed_tokens(tokens)
    for t in range(3):
        h_new = x
        for layer in model.layers:
            h_new = layer(h_new, cos, sin)
        torch.testing.assert_close(out.states[t], g0 * h_new + (1 - g0) * x)
        x = model.norm(out.states[t])
    assert model.num_params() == model.cfg.param_count()


def test_per_loop_norm_is_distinct_per_loop():
    model = tiny(per_loop_norm=True, max_loops=4)
    assert len(model.loop_norms) == 4
    tokens = ids()
    before = model(tokens, n_loops=4)
    with torch.no_grad():
        model.loop_norms[2].weight.mul_(1.7)  # only loop 3 (index 2) uses this norm
    after = model(tokens, n_loops=4)
    for t in range(2):
        torch.testing.assert_close(after.states[t], before.states[t], rtol=0, atol=0)
    assert not torch.allclose(after.states[2], before.states[2])
    cos, sin = model.rope(S, tokens.device, torch.float32)
    x = model.norm(after.states[1])
    torch.testing.assert_close(after.states[2], model.loop_step(x, 2, cos, sin))
    h = model.loop_norms[2](x)
    for layer in model.layers:
        h = layer(h, cos, sin)
    torch.testing.assert_close(after.states[2], h)
    with pytest.raises(ConfigError, match="n_loops"):
        model(tokens, n_loops=5)  # no norm exists for a fifth loop
    assert model.num_params() == model.cfg.param_count()


def test_tied_embeddings():
    model = tiny(tie_embeddings=True)
    assert model.lm_head.weight is model.embed_tokens.weight
    assert model.num_params() == model.cfg.param_count() == tiny().num_params() - V * 32
    tokens = ids()
    out = model(tokens, return_logits="last")
    torch.testing.assert_close(out.logits, out.readouts[-1] @ model.embed_tokens.weight.t())


def test_embed_init_std_scales_only_the_embedding():
    torch.manual_seed(0)
    default = tiny()
    torch.manual_seed(0)
    scaled = tiny(embed_init_std=1.0)
    assert abs(default.embed_tokens.weight.std().item() - 0.02) < 0.004
    assert abs(scaled.embed_tokens.weight.std().item() - 1.0) < 0.2
    torch.testing.assert_close(scaled.embed_tokens.weight, default.embed_tokens.weight * 50.0)  # same draw, x50
    for (name, a), (_, b) in zip(default.named_parameters(), scaled.named_parameters()):
        if name != "embed_tokens.weight":
            assert torch.equal(a, b), name


def test_gqa_equals_mha_with_repeated_kv_heads():
    gqa = tiny(n_kv_heads=2)
    assert gqa.layers[0].self_attn.k_proj.weight.shape == (2 * 8, 32)
    mha = tiny()
    sd = gqa.state_dict()
    for name in list(sd):
        if name.endswith(("k_proj.weight", "v_proj.weight")):  # [kv*D, H] -> repeat each kv head for 2 q heads
            sd[name] = sd[name].view(2, 8, 32).repeat_interleave(2, dim=0).reshape(32, 32)
    mha.load_state_dict(sd)
    tokens = ids()
    torch.testing.assert_close(
        gqa(tokens, return_logits="all").logits, mha(tokens, return_logits="all").logits, rtol=1e-5, atol=1e-6
    )
    assert gqa.num_params() == gqa.cfg.param_count()


def test_param_count_and_flops_count_loops():
    for cfg in (tiny_cfg(), tiny_cfg(n_kv_heads=2, tie_embeddings=True, gated_recurrence=True, per_loop_norm=True)):
        assert LoopLM(cfg).num_params() == cfg.param_count()
        f2, f4 = cfg.flops_per_token(128, n_loops=2), cfg.flops_per_token(128, n_loops=4)
        assert f4 == pytest.approx(2 * f2)  # every loop (and its readout) costs the same compute
        assert cfg.flops_per_token(128, n_loops=4, readouts=1) < f4
        assert cfg.flops_per_token(128, n_loops=4, training=False) == pytest.approx(f4 / 3)
    c = tiny_cfg()  # hand count, forward, T=1: 2 x (attn + mlp matmul params) + causal attention + head + gate
    per_layer = 2 * (4 * 32 * 32 + 3 * 32 * 64) + 2 * 2 * (128 + 1) / 2 * 32  # (S+1)/2 keys per query
    assert c.flops_per_token(128, n_loops=1, training=False) == pytest.approx(2 * per_layer + 2 * 32 * V + 2 * 32)
    big = preset("ouro-1.4b")
    assert 1.3e9 < big.param_count() < 1.5e9, big.param_count()
    assert 2.5e9 < preset("ouro-2.6b").param_count() < 2.8e9


@pytest.mark.parametrize(
    "field,kwargs",
    [
        ("n_loops", dict(n_loops=0)),
        ("n_heads", dict(n_heads=5)),  # does not divide hidden_size=32
        ("n_kv_heads", dict(n_kv_heads=3)),
        ("readout", dict(readout="softmax")),
        ("max_loops", dict(n_loops=8, max_loops=4)),
        ("attention_backend", dict(attention_backend="xformers")),
        ("n_prelude_layers", dict(n_prelude_layers=-1)),
        ("hidden_size", dict(hidden_size=0)),
        ("embed_init_std", dict(embed_init_std=0.0)),
        ("embed_init_std", dict(embed_init_std=1.0, tie_embeddings=True)),
    ],
)
def test_bad_model_config_is_one_line_naming_the_field(field, kwargs):
    with pytest.raises(ConfigError) as e:
        tiny_cfg(**kwargs)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(field + "=") and "expected" in msg


def test_unknown_preset_and_unknown_key():
    with pytest.raises(ConfigError, match="preset"):
        preset("ouro-99b")
    with pytest.raises(ConfigError, match="unknown key"):
        LoopLMConfig.from_dict({"hidden_size": 64, "n_layerz": 2})


def test_dropout_acts_in_training_only():
    torch.manual_seed(0)
    plain = LoopLM(preset("debug-tiny"))
    torch.manual_seed(0)
    dropped = LoopLM(preset("debug-tiny", dropout=0.2))
    ids = torch.randint(0, 512, (2, 16))
    dropped.train()
    a, b = (dropped(ids, return_logits="last").logits for _ in range(2))
    assert not torch.equal(a, b)  # a fresh mask per call
    dropped.eval()
    assert torch.equal(dropped(ids, return_logits="last").logits, plain(ids, return_logits="last").logits)
    assert not any(isinstance(m, torch.nn.Dropout) for m in plain.modules())  # 0: no module at all
    with pytest.raises(ConfigError, match="dropout"):
        preset("debug-tiny", dropout=1.0)
