"""Ouro Hugging Face interchange: exact round trip, the published layout, and one-line errors."""

import json
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from titanloop.config_errors import ConfigError
from titanloop.interchange import export_ouro_hf, import_ouro_hf
from titanloop.interchange.__main__ import main
from titanloop.model import LoopLM, LoopLMConfig

V, H, FFN, LAYERS = 96, 32, 64, 2


def tiny(**kw) -> LoopLM:
    torch.manual_seed(0)
    cfg = dict(
        vocab_size=V,
        hidden_size=H,
        n_heads=4,
        ffn_hidden_size=FFN,
        n_layers=LAYERS,
        n_loops=3,
        max_seq_len=64,
        rope_theta=40000.0,
    )
    cfg.update(kw)
    model = LoopLM(LoopLMConfig(**cfg))
    with torch.no_grad():  # non-default values everywhere so a dropped or swapped tensor is visible
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


TOKENS = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(3))


def _tensors(path) -> dict:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _assert_identical(a: LoopLM, b: LoopLM):
    assert a.cfg == b.cfg
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert sa[name].dtype == sb[name].dtype and torch.equal(sa[name], sb[name]), name
    for t in (1, a.cfg.n_loops, a.cfg.n_loops + 2):
        if a.cfg.per_loop_norm and t > a.cfg.max_loops:
            continue
        la = a(TOKENS, n_loops=t, return_logits="all")
        lb = b(TOKENS, n_loops=t, return_logits="all")
        assert torch.equal(la.logits, lb.logits) and torch.equal(la.gate_logits, lb.gate_logits)


VARIANTS = {
    "ouro": {},
    "gqa": dict(n_kv_heads=2),
    "tied": dict(tie_embeddings=True),
    "raw_readout_no_inter_norm": dict(readout="raw", inter_loop_norm=False),
    "final_only_norm": dict(readout="final_only_norm"),
    "prelude_coda": dict(n_prelude_layers=1, n_coda_layers=1),
    "gated_per_loop_norm": dict(gated_recurrence=True, per_loop_norm=True, max_loops=6, gate_bias_init=-3.0),
}


# variants the Ouro HF code cannot compute -> the field its refusal names
REFUSED = {
    "raw_readout_no_inter_norm": "readout='raw'",
    "final_only_norm": "readout='final_only_norm'",
    "prelude_coda": "n_prelude_layers=1",
    "gated_per_loop_norm": "gated_recurrence=true",
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_export_import_round_trip_is_exact(tmp_path, variant):
    model = tiny(**VARIANTS[variant])
    export_ouro_hf(model, tmp_path, allow_variant=True)
    model_type = json.loads((tmp_path / "config.json").read_text())["model_type"]
    assert model_type == ("titanloop_looplm" if variant in REFUSED else "ouro")
    again = import_ouro_hf(tmp_path)
    _assert_identical(model, again)
    if model.cfg.tie_embeddings:
        assert again.lm_head.weight is again.embed_tokens.weight
        assert "lm_head.weight" not in _tensors(tmp_path)
    # a second export of the imported model writes the same bytes' worth of tensors
    export_ouro_hf(again, tmp_path / "again", allow_variant=True)
    t1, t2 = _tensors(tmp_path), _tensors(tmp_path / "again")
    assert t1.keys() == t2.keys() and all(torch.equal(t1[k], t2[k]) for k in t1)


def ouro_reference(path, ids) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(logits, exit-gate logit) per loop as the Ouro Hugging Face code (ByteDance's modeling_ouro.py, which is
    not importable offline) computes them from an exported directory. Written independently of LoopLM from
    that code's published structure, reading only what it reads: the Ouro keys of config.json and the Ouro
    tensors (the "titanloop" sub-dict and extra tensors are ignored, as transformers ignores them). Per loop:
    the stack of sandwich-norm decoder layers (RoPE with rotate-half, GQA, causal softmax attention, SwiGLU),
    then the final RMSNorm, whose output is decoded by lm_head, gated and fed to the next loop."""
    c, w = json.loads((path / "config.json").read_text()), _tensors(path)
    nh, nkv, hd, eps = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"], c["rms_norm_eps"]
    b, s = ids.shape

    def rms(x, name):
        return w[name] * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    inv_freq = 1.0 / (c["rope_theta"] ** (torch.arange(0, hd, 2).float() / hd))
    freqs = torch.outer(torch.arange(s).float(), inv_freq)
    cos, sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()
    causal = torch.full((s, s), float("-inf")).triu(1)

    def rotate(x):
        x1, x2 = x.chunk(2, -1)
        return x * cos + torch.cat([-x2, x1], -1) * sin

    def attention(x, p):
        q = (x @ w[p + "q_proj.weight"].T).view(b, s, nh, hd).transpose(1, 2)
        k = (x @ w[p + "k_proj.weight"].T).view(b, s, nkv, hd).transpose(1, 2).repeat_interleave(nh // nkv, 1)
        v = (x @ w[p + "v_proj.weight"].T).view(b, s, nkv, hd).transpose(1, 2).repeat_interleave(nh // nkv, 1)
        att = torch.softmax(rotate(q) @ rotate(k).transpose(-1, -2) * hd**-0.5 + causal, -1)
        return (att @ v).transpose(1, 2).reshape(b, s, nh * hd) @ w[p + "o_proj.weight"].T

    def mlp(x, p):
        gate = torch.nn.functional.silu(x @ w[p + "gate_proj.weight"].T)
        return (gate * (x @ w[p + "up_proj.weight"].T)) @ w[p + "down_proj.weight"].T

    head = w["model.embed_tokens.weight"] if c["tie_word_embeddings"] else w["lm_head.weight"]
    h, out = w["model.embed_tokens.weight"][ids], []
    for _ in range(c["total_ut_steps"]):
        for i in range(c["num_hidden_layers"]):
            p = f"model.layers.{i}."
            h = h + rms(
                attention(rms(h, p + "input_layernorm.weight"), p + "self_attn."), p + "input_layernorm_2.weight"
            )
            h = h + rms(
                mlp(rms(h, p + "post_attention_layernorm.weight"), p + "mlp."), p + "post_attention_layernorm_2.weight"
            )
        h = rms(h, "model.norm.weight")
        out.append((h @ head.T, (h @ w["model.early_exit_gate.weight"].T + w["model.early_exit_gate.bias"])[..., 0]))
    return out


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_export_is_what_the_ouro_code_computes_or_refused(tmp_path, variant):
    model = tiny(**VARIANTS[variant])
    with torch.no_grad():
        ours = model(TOKENS, return_logits="all")
    if variant not in REFUSED:
        export_ouro_hf(model, tmp_path)
        assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "ouro"
        with torch.no_grad():
            ref = ouro_reference(tmp_path, TOKENS)
        for t, (logits, gate) in enumerate(ref):  # every loop's exit, not only the last
            torch.testing.assert_close(logits, ours.logits[t], rtol=0, atol=1e-5)
            torch.testing.assert_close(gate, ours.gate_logits[t], rtol=0, atol=1e-5)
        return
    with pytest.raises(ConfigError) as e:
        export_ouro_hf(model, tmp_path / "refused")
    assert "\n" not in str(e.value) and REFUSED[variant] in str(e.value), str(e.value)
    assert not (tmp_path / "refused").exists()
    # the refusal is real: read as Ouro, these weights give other logits at some loop
    export_ouro_hf(model, tmp_path / "variant", allow_variant=True)
    with torch.no_grad():
        ref = ouro_reference(tmp_path / "variant", TOKENS)
    worst = max((logits - ours.logits[t]).abs().max().item() for t, (logits, _) in enumerate(ref))
    assert worst > 1e-2, worst


def test_ouro_model_type_must_match_the_variant_keys(tmp_path):
    export_ouro_hf(tiny(readout="raw"), tmp_path, allow_variant=True)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "model_type": "ouro"}))
    _one_line_error(tmp_path, "model_type='ouro' is invalid for this model", "readout='raw'")


def test_exported_layout_matches_ouro(tmp_path):
    model = tiny()
    export_ouro_hf(model, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] == "ouro" and cfg["architectures"] == ["OuroForCausalLM"]
    expected_values = {
        "vocab_size": V,
        "hidden_size": H,
        "intermediate_size": FFN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "total_ut_steps": 3,
        "max_position_embeddings": 64,
        "rope_theta": 40000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "early_exit_threshold": 1.0,
        "head_dim": 8,
        "torch_dtype": "float32",
    }
    assert {k: cfg[k] for k in expected_values} == expected_values
    # tensor names and shapes as in the published Ouro checkpoints (RECIPE §1), written out by hand
    expected = {
        "model.embed_tokens.weight": (V, H),
        "model.norm.weight": (H,),
        "lm_head.weight": (V, H),
        "model.early_exit_gate.weight": (1, H),
        "model.early_exit_gate.bias": (1,),
    }
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        for proj in ("q", "k", "v", "o"):
            expected[p + f"self_attn.{proj}_proj.weight"] = (H, H)
        expected[p + "mlp.gate_proj.weight"] = (FFN, H)
        expected[p + "mlp.up_proj.weight"] = (FFN, H)
        expected[p + "mlp.down_proj.weight"] = (H, FFN)
        for norm in ("input_layernorm", "input_layernorm_2", "post_attention_layernorm", "post_attention_layernorm_2"):
            expected[p + norm + ".weight"] = (H,)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        got = {n: tuple(f.get_slice(n).get_shape()) for n in f.keys()}
        assert f.metadata() == {"format": "pt"}
    assert got == expected


def test_bf16_export_and_sharded_weights(tmp_path):
    model = tiny(n_kv_heads=2)
    export_ouro_hf(model, tmp_path, dtype=torch.bfloat16, max_shard_bytes=20_000)
    shards = sorted(p.name for p in tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 2 and not (tmp_path / "model.safetensors").exists()
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    tensors = _tensors(tmp_path)
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in tensors.values())
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    again = import_ouro_hf(tmp_path)
    assert again.embed_tokens.weight.dtype == torch.bfloat16
    for name, t in model.state_dict().items():
        assert torch.equal(again.state_dict()[name], t.to(torch.bfloat16)), name
    as_fp32 = import_ouro_hf(tmp_path, dtype=torch.float32)
    assert as_fp32.lm_head.weight.dtype == torch.float32
    # re-exporting unsharded into the same directory removes the stale shards and index
    export_ouro_hf(again, tmp_path)
    assert not list(tmp_path.glob("model-*")) and not (tmp_path / "model.safetensors.index.json").exists()
    _assert_identical(again, import_ouro_hf(tmp_path))


def test_failed_export_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    first = tiny()
    export_ouro_hf(first, tmp_path / "ckpt")
    import titanloop.interchange.ouro_hf as ouro_hf

    calls = []
    real_save = ouro_hf.save_file

    def failing_save(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise OSError("disk full")
        real_save(*args, **kwargs)

    monkeypatch.setattr(ouro_hf, "save_file", failing_save)
    with pytest.raises(OSError, match="disk full"):
        export_ouro_hf(tiny(n_kv_heads=2), tmp_path / "ckpt", max_shard_bytes=20_000)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no staging directory left behind
    _assert_identical(first, import_ouro_hf(tmp_path / "ckpt"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="out_dir="):
        export_ouro_hf(first, tmp_path / "file")


def test_plain_ouro_directory_imports_with_defaults(tmp_path):
    """A directory as published (no titanloop sub-dict, extra HF keys) loads as the default Ouro variant."""
    model = tiny()
    export_ouro_hf(model, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["titanloop"]
    cfg.update(
        {
            "auto_map": {"AutoConfig": "configuration_ouro.OuroConfig"},
            "bos_token_id": 0,
            "eos_token_id": 0,
            "transformers_version": "4.55.0",
        }
    )
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    again = import_ouro_hf(tmp_path)
    assert again.cfg.readout == "norm" and again.cfg.inter_loop_norm and again.cfg.n_prelude_layers == 0
    _assert_identical(model, again)


def _one_line_error(path, *fragments):
    with pytest.raises(ConfigError) as e:
        import_ouro_hf(path)
    msg = str(e.value)
    assert "\n" not in msg, msg
    for frag in fragments:
        assert frag in msg, msg
    return msg


def test_missing_misshaped_and_unexpected_tensors_name_the_tensor(tmp_path):
    export_ouro_hf(tiny(), tmp_path)
    tensors = _tensors(tmp_path)
    weights = tmp_path / "model.safetensors"

    missing = dict(tensors)
    del missing["model.layers.1.mlp.up_proj.weight"]
    save_file(missing, str(weights))
    _one_line_error(tmp_path, "'model.layers.1.mlp.up_proj.weight'", "missing", f"[{FFN}, {H}]")

    bad_shape = dict(tensors)
    bad_shape["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(H // 2, H)
    save_file(bad_shape, str(weights))
    _one_line_error(tmp_path, "'model.layers.0.self_attn.k_proj.weight'", f"[{H // 2}, {H}]", f"expected [{H}, {H}]")

    extra = dict(tensors)
    extra["model.layers.7.mlp.up_proj.weight"] = torch.zeros(FFN, H)
    save_file(extra, str(weights))
    _one_line_error(tmp_path, "'model.layers.7.mlp.up_proj.weight'", "unexpected")


def test_sharded_index_errors(tmp_path):
    export_ouro_hf(tiny(), tmp_path, max_shard_bytes=30_000)
    index_file = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    name = "model.layers.0.mlp.down_proj.weight"
    del index["weight_map"][name]
    index_file.write_text(json.dumps(index))
    # the tensor still sits in a shard but the index does not list it: report it as missing from the index
    _one_line_error(tmp_path, repr(name), "missing")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[-1]
    shard.unlink()
    _one_line_error(tmp_path, repr(shard.name), "missing")


def test_not_an_ouro_directory(tmp_path):
    _one_line_error(tmp_path, "config.json")  # empty directory
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 32}))
    _one_line_error(tmp_path, "model_type='llama'", "'ouro'")
    export_ouro_hf(tiny(), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    for key, value, frag in (
        ("hidden_act", "gelu", "hidden_act='gelu'"),
        ("num_attention_heads", 5, "n_heads=5"),
        ("head_dim", 16, "head_dim=16"),
    ):
        (tmp_path / "config.json").write_text(json.dumps({**cfg, key: value}))
        _one_line_error(tmp_path, frag)
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "hidden_size"}))
    _one_line_error(tmp_path, "hidden_size")
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "titanloop": {"readout": "sideways"}}))
    _one_line_error(tmp_path, "readout='sideways'")
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "titanloop": {"warp": 1}}))
    _one_line_error(tmp_path, "'warp'")
    with pytest.raises(ConfigError, match="max_shard_bytes"):
        export_ouro_hf(tiny(), tmp_path / "x", max_shard_bytes=0)


def test_cli_module_runs_with_help():
    r = subprocess.run(
        [sys.executable, "-m", "titanloop.interchange", "--help"], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0 and "inspect" in r.stdout and "export" in r.stdout and "verify" in r.stdout


def test_cli_export_inspect_verify_and_errors(tmp_path, capsys):
    out = tmp_path / "m"
    with pytest.raises(SystemExit) as e:
        main(["export", "--preset", "debug-tiny", "--set", "readout=raw", "--out", str(out)])
    assert str(e.value).startswith(
        "error: cannot export as Ouro (model_type 'ouro'): readout='raw' (the Ouro code "
        "decodes norm(h_t) at every loop); pass allow_variant=True (CLI --allow-variant)"
    )
    main(
        [
            "export",
            "--preset",
            "debug-tiny",
            "--set",
            "n_loops=2",
            "--set",
            "readout=raw",
            "--allow-variant",
            "--out",
            str(out),
        ]
    )
    main(["inspect", str(out)])
    n = import_ouro_hf(out).num_params()
    printed = capsys.readouterr().out
    assert f"{n:,} stored" in printed and "T=2" in printed and "readout=raw" in printed
    main(["verify", str(out)])
    assert "bitwise" in capsys.readouterr().out
    for argv, start in (
        (["inspect", str(tmp_path / "nothing")], "error: path="),
        (["export", "--out", str(tmp_path / "x"), "--set", "n_heads=5"], "error: n_heads=5"),
        (["export", "--out", str(tmp_path / "x"), "--set", "nheads=4"], "error: --set 'nheads=4'"),
    ):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert str(e.value).startswith(start) and "\n" not in str(e.value)
    assert not (tmp_path / "x").exists()
