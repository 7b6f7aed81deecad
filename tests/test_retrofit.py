"""Ouroboros retrofit (titanloop.retrofit): import exactness vs the truncated HF model, SVD bases vs numpy,
zero-init identity, low-rank application vs materialized weights, pooling causality, export round trip."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from titanloop.config_errors import ConfigError
from titanloop.retrofit import TARGETS, RetrofitConfig
from titanloop.retrofit.controller import mean_pool
from titanloop.retrofit.hf_import import load_retrofit

L = 6  # dense layers of the tiny checkpoints
SPLIT = dict(n_prelude=2, recurrent_layer=3, n_coda=1)  # removes layers 2 and 4


def _save_tiny(path, kind: str):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0 if kind == "qwen2" else 1)
    common = dict(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=L,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rope_theta=500.0,
    )
    if kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=False))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=True, attention_bias=True, mlp_bias=True))
    with torch.no_grad():  # every weight and bias random (HF zero-inits biases, norms are ones)
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.dim() == 1 and p.numel() == 32 else 0.0))
    model.save_pretrained(path)
    return model.eval()


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def dense(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return path, _save_tiny(path, request.param)


def _truncated(model, kept):
    model.model.layers = torch.nn.ModuleList(model.model.layers[i] for i in kept)
    for i, layer in enumerate(model.model.layers):
        layer.self_attn.layer_idx = i
    model.config.num_hidden_layers = len(kept)
    if hasattr(model.config, "layer_types"):
        model.config.layer_types = [model.config.layer_types[i] for i in kept]
    return model


def _cfg(path, **kw):
    base = dict(hf_path=str(path), **SPLIT, lora_rank=4, style_dim=8, max_loops=4)
    return RetrofitConfig(**{**base, **kw})


def _randomize(module):
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * 0.5)


def test_import_matches_truncated_hf_model(dense):
    path, hf = dense
    cfg = _cfg(path, modulation="none", gated_recurrence=False, step_norm=False, n_loops=1)
    model = load_retrofit(cfg).eval()
    ids = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(0))
    import copy

    ref_model = _truncated(copy.deepcopy(hf), cfg.kept_layers(L))
    with torch.no_grad():
        ref = ref_model(ids).logits
        full = hf(ids).logits
        out = model(ids, return_logits="last").logits
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert (out - full).abs().max() > 1e-2  # the truncation is real: the full model differs
    trainable, frozen = model.param_counts()
    assert trainable == 0 and frozen == sum(p.numel() for p in ref_model.parameters())


def test_svd_bases_match_numpy(dense):
    path, hf = dense
    cfg = _cfg(path, modulation="static", lora_rank=5)
    model = load_retrofit(cfg)
    sd = {k: v.double().numpy() for k, v in hf.state_dict().items()}
    removed = cfg.removed_layers(L)
    assert removed == [2, 4]
    for k in TARGETS:
        sub = "self_attn" if k in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
        w = {i: sd[f"model.layers.{i}.{sub}.{k}.weight"] for i in (2, 3, 4)}
        delta = np.mean([w[i] - w[3] for i in removed], axis=0)
        u, s, vt = np.linalg.svd(delta, full_matrices=False)
        a = getattr(model.lora, f"{k}_A").double().numpy()
        b = getattr(model.lora, f"{k}_B").double().numpy()
        np.testing.assert_allclose(b @ a, (u[:, :5] * s[:5]) @ vt[:5], atol=1e-5)  # the rank-5 truncation
        np.testing.assert_allclose(np.linalg.norm(b, axis=0), s[:5], rtol=1e-5)  # B = U_r S_r
        np.testing.assert_allclose(a @ a.T, np.eye(5), atol=1e-5)  # A = V_r^T has orthonormal rows
        assert not getattr(model.lora, f"{k}_A").requires_grad


@pytest.mark.parametrize("modulation", ["controller", "static"])
def test_zero_init_changes_nothing_then_training_does(dense, modulation):
    path, _ = dense
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))
    plain = load_retrofit(_cfg(path, modulation="none", n_loops=3)).eval()
    model = load_retrofit(_cfg(path, modulation=modulation, n_loops=3)).eval()
    with torch.no_grad():
        torch.testing.assert_close(
            model(ids, return_logits="last").logits, plain(ids, return_logits="last").logits, rtol=0, atol=0
        )
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(n.split(".")[0] in ("modulation", "recurrence_gate", "step_norms") for n in trainable)
    _randomize(model.modulation)
    with torch.no_grad():
        assert (model(ids, return_logits="last").logits - plain(ids, return_logits="last").logits).abs().max() > 1e-3


def test_low_rank_application_equals_materialized_weights(dense):
    """Sequence pooling, one sample: the modulated layer equals the layer with W_k + (α/r) B diag(δ) A."""
    path, _ = dense
    kw = dict(gated_recurrence=False, step_norm=False, n_loops=1)
    model = load_retrofit(_cfg(path, modulation="controller", pooling="sequence", **kw)).eval()
    _randomize(model.modulation)
    dense_model = load_retrofit(_cfg(path, modulation="none", **kw)).eval()
    ids = torch.randint(0, 96, (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        x = model.embed_tokens(ids)
        cos, sin, _ = model.rope_and_mask(ids)
        for layer in model.prelude:
            x = layer(x, cos, sin)
        deltas = model.modulation(x, 0)
        layer = dense_model.layers[0]
        for k in TARGETS:
            sub = layer.self_attn if k in ("q_proj", "k_proj", "v_proj", "o_proj") else layer.mlp
            getattr(sub, k).weight += model.lora.delta_weight(k, deltas[k].view(-1), model.rcfg.lora_scale)
        torch.testing.assert_close(
            model(ids, return_logits="last").logits, dense_model(ids, return_logits="last").logits, rtol=1e-4, atol=1e-4
        )


def test_low_rank_per_token_delta(dense):
    """Causal pooling gives each token its own δ: the low-rank form equals (W + ΔW(δ_i)) x_i per token."""
    path, _ = dense
    model = load_retrofit(_cfg(path, modulation="controller", pooling="causal"))
    x = torch.randn(1, 7, 32, dtype=torch.float64)
    deltas = {k: torch.randn(1, 7, 4, dtype=torch.float64) for k in TARGETS}
    model.double()
    proj = model.lora.modulated(deltas, model.rcfg.lora_scale)
    lin = model.layers[0].self_attn.q_proj
    y = proj(lin, "q_proj", x)
    for i in range(7):
        w = lin.weight + model.lora.delta_weight("q_proj", deltas["q_proj"][0, i], model.rcfg.lora_scale)
        torch.testing.assert_close(y[0, i], w @ x[0, i] + lin.bias)


def test_mean_pool_causal_and_documents():
    x = torch.randn(2, 9, 3)
    doc = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2], [5, 5, 5, 5, 5, 5, 5, 5, 5]])
    causal = mean_pool(x, doc, causal=True)
    seq = mean_pool(x, doc, causal=False)
    for b in range(2):
        for i in range(9):
            same = (doc[b] == doc[b, i]).nonzero().view(-1)
            prefix = same[same <= i]
            torch.testing.assert_close(causal[b, i], x[b, prefix].mean(0))
            torch.testing.assert_close(seq[b, i], x[b, same].mean(0))
    torch.testing.assert_close(mean_pool(x, None, causal=True)[:, -1], x.mean(1))


@pytest.mark.parametrize("pooling", ["causal", "sequence"])
def test_pooling_future_tokens(dense, pooling):
    """Causal pooling: logits at positions <= i do not depend on later tokens; whole-sequence pooling: they do."""
    path, _ = dense
    model = load_retrofit(_cfg(path, modulation="controller", pooling=pooling, n_loops=2)).eval()
    _randomize(model.modulation)
    a = torch.randint(0, 96, (1, 16), generator=torch.Generator().manual_seed(3))
    b = a.clone()
    b[0, 10:] = (b[0, 10:] + 7) % 96
    with torch.no_grad():
        diff = (model(a, return_logits="last").logits - model(b, return_logits="last").logits)[0, :10].abs().max()
    if pooling == "causal":
        assert diff < 1e-5
    else:
        assert diff > 1e-4


def test_bad_split_and_checkpoint_are_one_line_errors(dense, tmp_path):
    path, _ = dense
    with pytest.raises(ConfigError, match="recurrent_layer"):
        load_retrofit(_cfg(path, recurrent_layer=5))  # inside the coda of a 6-layer model
    with pytest.raises(ConfigError, match="removes at least one"):
        load_retrofit(_cfg(path, n_prelude=3, recurrent_layer=3, n_coda=2))
    with pytest.raises(ConfigError, match="no config.json"):
        load_retrofit(_cfg(tmp_path))
    with pytest.raises(ConfigError, match="modulation"):
        RetrofitConfig(modulation="dynamic")


@pytest.mark.parametrize("modulation,pooling", [("controller", "causal"), ("static", "sequence")])
def test_export_round_trip(dense, tmp_path, modulation, pooling):
    """Own model_type + remote code: transformers and titanloop give the same logits as the trained model."""
    import json

    from transformers import AutoModelForCausalLM

    from titanloop.retrofit.export import export_hf, load_exported

    path, _ = dense
    model = load_retrofit(_cfg(path, modulation=modulation, pooling=pooling, n_loops=3)).eval()
    for m in model.trainable_modules().values():
        _randomize(m)
    out = export_hf(model, tmp_path / "export")
    assert json.loads((out / "config.json").read_text())["model_type"] == "titanloop_retrofit"
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = model(ids, return_logits="last").logits
        hf = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
        torch.testing.assert_close(hf(ids).logits, ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(
            hf(ids, n_loops=2).logits, model(ids, 2, return_logits="last").logits, rtol=1e-5, atol=1e-5
        )
        back = load_exported(out).eval()
        torch.testing.assert_close(back(ids, return_logits="last").logits, ref, rtol=0, atol=0)
    assert {n for n, p in back.named_parameters() if p.requires_grad} == {
        n for n, p in model.named_parameters() if p.requires_grad
    }


def test_training_config_section_and_checks(dense):
    """[retrofit] in the training config: the shape comes from the checkpoint; unsupported settings are one line."""
    from pathlib import Path

    from titanloop.train.config import load_config

    path, _ = dense
    config = Path(__file__).resolve().parents[1] / "train_configs" / "ouroboros_retrofit.toml"
    base = [
        "--retrofit.hf_path",
        str(path),
        "--retrofit.n_prelude",
        "2",
        "--retrofit.recurrent_layer",
        "3",
        "--retrofit.n_coda",
        "1",
        "--data.kind",
        "synthetic_text",
        "--training.seq_len",
        "32",
    ]
    cfg = load_config(config, base, world_size=2)
    assert cfg.family.name == "retrofit" and cfg.looplm.vocab_size == 96 and cfg.looplm.n_prelude_layers == 2
    # its loop settings come from [model] and the loop sampler (their one home), the rest from [retrofit]
    assert (cfg.family.config.n_loops, cfg.family.config.max_loops, cfg.family.config.gate_bias_init) == (1, 16, -2.0)
    tuned = load_config(config, base + ["--model.max_loops", "6", "--loop_sampler.n_loops", "3"], world_size=2)
    assert (tuned.family.config.n_loops, tuned.family.config.max_loops, tuned.family.config.n_coda) == (3, 6, 1)
    assert load_config(config, base + ["--model.gated_recurrence", "false"]).family.config.gated_recurrence is False
    for extra, needle in [
        (["--objective.name", "stage1"], "final_only"),
        (["--parallelism.tp", "2"], "tensor"),
        (["--model.n_layers", "2"], r"no \[model\] keys but max_loops, gated_recurrence, gate_bias_init"),
        (["--retrofit.max_loops", "4"], r"retrofit\.max_loops has moved to model\.max_loops"),
        (["--loop_sampler.n_loops", "20"], "max_loops"),
        (["--retrofit.recurrent_layer", "5"], "recurrent_layer"),
        (["--parallelism.engine", "deepspeed"], "'fsdp2' for a retrofit run"),
    ]:
        with pytest.raises(ConfigError, match=needle):
            load_config(config, base + extra, world_size=2)


def test_training_flop_count_of_a_retrofit_run_is_its_own(dense):
    """The trainer's MFU for a retrofit run comes from its family's FLOP count (RetrofitLM.flops_per_token: frozen
    prelude forward only, frozen coda / recurrent layer / LM head without weight gradients, controller and gate
    trained), checked against torch.utils.flop_counter on a real forward + backward at T = 3. Measured 2026-11-25:
    ours / counted 0.996 for both checkpoints; the LoopLM-shaped view the trainer used before gave 1.93."""
    from pathlib import Path

    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from titanloop.train.config import load_config

    path, _ = dense
    config = Path(__file__).resolve().parents[1] / "train_configs" / "ouroboros_retrofit.toml"
    b, s, t = 2, 24, 3
    cfg = load_config(
        config,
        [
            "--retrofit.hf_path",
            str(path),
            "--retrofit.n_prelude",
            "2",
            "--retrofit.recurrent_layer",
            "3",
            "--retrofit.n_coda",
            "1",
            "--retrofit.lora_rank",
            "4",
            "--retrofit.style_dim",
            "8",
            "--data.kind",
            "synthetic_text",
            "--training.seq_len",
            str(s),
            "--loop_sampler.n_loops",
            str(t),
        ],
        world_size=1,
    )
    family = cfg.family
    model = family.build()
    _randomize(model.modulation)
    x = torch.randint(0, 96, (b, s), generator=torch.Generator().manual_seed(1))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(x, t, return_logits="last").logits.float().pow(2).mean().backward()
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    attention = counts.pop("aten.bmm")  # the math kernel computes every score; we count the causal half
    expected = sum(counts.values()) + attention * (s + 1) / (2 * s)
    ours = family.flops_per_token(s, t) * b * s
    assert ours == pytest.approx(expected, rel=0.02), (ours, expected, counts, attention)
    # the LoopLM-shaped view the trainer used before counted the frozen prelude and coda as trained, T times
    assert cfg.looplm.flops_per_token(s, n_loops=t) * b * s > 1.1 * expected
