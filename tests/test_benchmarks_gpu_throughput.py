"""benchmarks/gpu_throughput.py without a GPU: the settings and matrices, the chrome-trace summary and the float8
against bf16 comparison of two traces, OOM detection, the summary's targets, the command line, and (slow) the
whole --smoke run on the CPU, its json checked against the report schema."""

from __future__ import annotations

import dataclasses
import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import gpu_throughput as gt
from benchmarks.report import expected_met, validate

ROOT = Path(__file__).resolve().parent.parent


def test_settings_and_the_shipped_setting():
    assert gt.parse_setting("2:selective:off") == gt.Setting(2, "selective")
    assert gt.parse_setting("1:loop2:tensorwise:8:2") == gt.Setting(1, "loop2", "tensorwise", 8, 2)
    assert gt.Setting(1, "loop2", accum=2).overrides() == [
        "--parallelism.activation_checkpoint", "loop", "--parallelism.ac_kept_loops", "2",
        "--training.global_batch_size", "2"]  # fmt: skip
    for bad, says in (("2:loop", "expected MB:AC:PRECISION"), ("2:loop:fp8", "'fp8' is not one of"),
                      ("x:loop:off", "must be integers"), ("0:loop:off", "must be >= 1")):  # fmt: skip
        with pytest.raises(ValueError, match=says):
            gt.parse_setting(bad)
    # the shipped setting is ouro_1p4b.toml's, and the default matrix starts from it with its float8 twins
    assert (gt.SHIPPED.micro_batch, gt.SHIPPED.ac) == (2, "selective") and gt.DEFAULT_MATRIX[0] == gt.SHIPPED
    twins = [dataclasses.replace(gt.SHIPPED, precision=p) for p in ("tensorwise", "rowwise")]
    assert all(t in gt.DEFAULT_MATRIX for t in twins) and gt.SHIPPED in gt.FULL_MATRIX


def test_every_matrix_row_is_accepted_by_the_trainer(tmp_path):
    from titanloop.checks import runs
    from titanloop.train.config import load_config

    for s in {*gt.DEFAULT_MATRIX, *gt.FULL_MATRIX}:
        args = runs.train_args(tmp_path, "ouro-1.4b", {}, s.n_loops, 4096, 1, "bf16", 8, s.micro_batch)
        cfg = load_config(runs.TRAIN_CONFIG, args + s.overrides(), world_size=1)
        assert cfg.training.global_batch_size == s.micro_batch * s.accum, s


def _row(s, tok=None, status="ok", **kw):
    return gt.Row(s, status, tokens_per_s_gpu=tok, **kw)


def test_summary_targets_agree_with_the_report():
    tw = dataclasses.replace(gt.SHIPPED, precision="tensorwise")
    rows = [_row(gt.SHIPPED, 12000.0, mfu=0.452), _row(tw, 14000.0), _row(gt.Setting(2, "none"), 13000.0)]
    s = {r["row"].split(" (")[0].split(",")[0]: r for r in gt.summary_rows(rows)}
    assert s["MFU"]["measured"] == 0.452 and s["MFU"]["met"] and s["MFU"]["target"] == ">= 0.45"
    assert s["float8 tensorwise / bf16 tokens/s"]["measured"] == 1.167 and s["float8 tensorwise / bf16 tokens/s"]["met"]
    assert s["best tokens/s/GPU at T=4"]["measured"] == 14000
    for r in gt.summary_rows(rows):
        assert expected_met(r["measured"], r["target"]) in (None, r["met"]), r
    failed = gt.summary_rows([_row(gt.SHIPPED, status="oom", reason="exit 1: torch.OutOfMemoryError")])
    assert failed[0]["measured"].startswith("not measured (oom: exit 1") and failed[0]["met"] is None
    na = gt.summary_rows([_row(gt.SHIPPED, 12000.0)])  # a device without a known peak: n/a, not a number
    assert na[0]["measured"] == "n/a (no peak known for this device)" and na[0]["met"] is None


OOM_LOG = """step     1 | loss 10.9 | ...
[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.00 GiB. GPU 0 has a total capacity of 79.19 GiB
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
"""


def test_oom_detection():
    assert gt.is_oom(1, OOM_LOG)
    assert gt.is_oom(1, "RuntimeError: CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported")
    assert not gt.is_oom(0, OOM_LOG)  # a run that finished is not an OOM whatever it printed
    assert not gt.is_oom(1, OOM_LOG.replace("torch.OutOfMemoryError: CUDA out of memory", "ValueError: bad shape"))


# ----- the profile --------------------------------------------------------------------------------------------------
def _kernel(name, ts, dur, stream=7, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": stream, "pid": 0}


def test_trace_summary_shares_idle_and_top_kernels():
    gemm = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_cublas"
    events = [
        _kernel(gemm, 0, 40),
        _kernel("flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128>>", 40, 20),
        _kernel("triton_poi_fused_add_mul_silu_0", 60, 10),
        # idle 70..80
        _kernel(gemm, 80, 10),
        _kernel("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevComm*)", 85, 15, stream=20),  # overlaps gemm
        _kernel("Memcpy DtoH (Device -> Pinned)", 100, 0, cat="gpu_memcpy"),
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 500, "tid": 1},  # CPU ops are not kernels
        {"ph": "i", "name": "marker", "ts": 5},
    ]
    s = gt.summarize_trace({"traceEvents": events}, top=3)
    assert s["source"] == "cuda" and s["events"] == 6 and s["span_ms"] == pytest.approx(0.1)
    sh = s["shares"]
    assert sh["gemm"] == pytest.approx(0.5) and sh["attention"] == pytest.approx(0.2)
    assert sh["elementwise"] == pytest.approx(0.1) and sh["nccl"] == pytest.approx(0.15)
    assert sh["idle"] == pytest.approx(0.1)  # busy = union: 0-70 and 80-100
    assert [k["name"] for k in s["top"]] == [
        gemm,
        "flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128>>",
        s["top"][2]["name"],
    ]
    assert s["top"][0]["calls"] == 2 and s["top"][0]["total_ms"] == pytest.approx(0.05)
    assert s["top"][0]["share_of_kernel_time"] == pytest.approx(50 / 95)


def test_trace_summary_without_cuda_uses_outermost_cpu_operators():
    ops = [
        {"ph": "X", "cat": "cpu_op", "name": "aten::linear", "ts": 0, "dur": 10, "tid": 1},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1, "dur": 8, "tid": 1},  # inside aten::linear
        {"ph": "X", "cat": "cpu_op", "name": "aten::add", "ts": 20, "dur": 5, "tid": 1},
    ]
    s = gt.summarize_trace({"traceEvents": ops})
    assert s["source"] == "cpu_op" and s["events"] == 2
    assert s["shares"]["gemm"] == pytest.approx(10 / 25) and s["shares"]["idle"] == pytest.approx(10 / 25)
    with pytest.raises(ValueError):
        gt.summarize_trace({"traceEvents": []})


BF16_GEMM, F8_GEMM = "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT", "nvjet_sm90_qqtst_128x256_128x4_2x1_v_bz_TNT"


def _bf16_trace():
    # 2 steps of: GEMM 40, attention 20, the SiLU kernel 10 and 10 us idle
    return {
        "traceEvents": [
            ev
            for t0 in (0, 80)
            for ev in (
                _kernel(BF16_GEMM, t0, 40),
                _kernel("flash_fwd_kernel<traits>", t0 + 40, 20),
                _kernel("triton_poi_fused_mul_silu_3", t0 + 60, 10),
            )
        ]
    }


def _float8_trace():
    # 2 steps of: float8 GEMM 25 (faster), the LM head's bf16 GEMM 5, attention 20, the same SiLU kernel under
    # another index, an amax 15 and a cast 10 (new), and 10 us idle: 85 us of kernels against bf16's 70
    events = []
    for t0 in (0, 95):
        t = t0
        for name, dur in (
            (F8_GEMM, 25),
            (BF16_GEMM, 5),
            ("flash_fwd_kernel<traits>", 20),
            ("triton_poi_fused_mul_silu_7", 10),
            ("triton_red_fused_abs_amax_0", 15),
            ("triton_poi_fused__to_copy_clamp_mul_1", 10),
        ):
            events.append(_kernel(name, t, dur))
            t += dur
    return {"traceEvents": events}


def test_float8_against_bf16_from_two_traces():
    c = gt.float8_vs_bf16(_bf16_trace(), _float8_trace(), steps=2)
    ms = {row[0]: row[1:] for row in c["ms_per_step"]}
    # us per step / 1000: GEMM 40 -> 30, attention 20 -> 20, elementwise 10 -> 35, idle 10 -> 10 (between steps)
    assert ms["gemm"] == pytest.approx([0.040, 0.030, -0.010])
    assert ms["attention"] == pytest.approx([0.020, 0.020, 0.0])
    assert ms["elementwise"] == pytest.approx([0.010, 0.035, 0.025])
    assert ms["idle"] == pytest.approx([0.005, 0.005, 0.0])  # one 10-us gap over 2 steps
    assert ms["timeline"] == pytest.approx([0.075, 0.090, 0.015])  # first to last kernel
    # the SiLU kernel matches across its two indices: only the float8 GEMM, the amax and the cast are new
    assert c["float8_only_kernels"] == 3
    assert c["float8_only_ms"] == pytest.approx({"gemm": 0.025, "other": 0.025})
    assert [g["kernel"] for g in c["growth"]] == [
        F8_GEMM,
        "triton_red_fused_abs_amax",
        "triton_poi_fused__to_copy_clamp_mul",
    ]
    assert c["growth"][0]["float8_calls_per_step"] == 1
    e = c["explanation"]
    assert "float8 takes 0.1 ms against bf16's 0.1 (slower)" in e and "GEMMs take 0.0 ms less (0.0 -> 0.0)" in e
    # the other way round the GEMMs are slower and float8 faster: both said
    back = gt.float8_vs_bf16(_float8_trace(), _bf16_trace(), steps=2)["explanation"]
    assert "(faster)" in back and "GEMMs take 0.0 ms MORE" in back


def test_float8_comparison_pairs_each_float8_row_with_its_bf16_twin(tmp_path):
    for name, trace in {"b.json.gz": _bf16_trace(), "f.json.gz": _float8_trace()}.items():
        with gzip.open(tmp_path / name, "wt") as f:
            json.dump(trace, f)
    shipped, tw = gt.Setting(2, "selective"), gt.Setting(2, "selective", "tensorwise")
    other = gt.Setting(1, "loop", "tensorwise")  # profiled, but its bf16 twin is not: no comparison
    rows = [
        _row(s, 1.0, profile={"trace": t}) for s, t in ((shipped, "b.json.gz"), (tw, "f.json.gz"), (other, "f.json.gz"))
    ]
    gt.attach_float8_comparisons(rows, tmp_path)
    assert "float8_vs_bf16" not in rows[0].profile and "float8_vs_bf16" not in rows[2].profile
    cmp = rows[1].profile["float8_vs_bf16"]
    assert cmp["bf16_row"] == shipped.label and cmp["float8_only_kernels"] == 3
    titles = [t["title"] for t in gt.float8_tables(tw.label, cmp)]
    assert titles[0].startswith(f"{tw.label} against {shipped.label}") and "grew most" in titles[1]
    (tmp_path / "f.json.gz").write_text("not gzip")  # a damaged trace: the error, not a crash
    gt.attach_float8_comparisons(rows, tmp_path)
    assert "error" in rows[1].profile["float8_vs_bf16"]


def test_compare_traces_command_line(tmp_path, capsys):
    paths = []
    for name, trace in (("b.json.gz", _bf16_trace()), ("f.json", _float8_trace())):
        path = tmp_path / name
        with gzip.open(path, "wt") if name.endswith(".gz") else open(path, "w") as f:
            json.dump(trace, f)
        paths.append(str(path))
    assert gt.main(["--compare-traces", *paths]) == 0
    out = capsys.readouterr().out
    assert "f.json against b.json.gz" in out and "triton_red_fused_abs_amax" in out and "(slower)" in out
    assert gt.main(["--compare-traces", paths[0], str(tmp_path / "missing.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot read the traces" in err


@pytest.mark.parametrize(
    "name,cat,want",
    [
        ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", "kernel", "gemm"),
        ("triton_tem_fused_mm_3", "kernel", "gemm"),
        ("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8>", "kernel", "gemm"),
        ("aten::addmm", "cpu_op", "gemm"),
        ("triton_tem_fused_flex_attention_0", "kernel", "attention"),
        # attention kernels built from GEMM pieces: attention, not gemm
        (
            "fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<...>::Params)",
            "kernel",
            "attention",
        ),
        (
            "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128_4x1x1_kernel0_0",
            "kernel",
            "attention",
        ),
        ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<...>", "kernel", "attention"),
        ("ncclDevKernel_AllGather_RING_LL(ncclDevComm*, unsigned long, ncclWork*)", "kernel", "nccl"),
        ("triton_red_fused__to_copy_mean_pow_1", "kernel", "elementwise"),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>", "kernel", "elementwise"),
        ("Memset (Device)", "gpu_memset", "memory"),
        ("some_custom_kernel", "kernel", "other"),
    ],
)
def test_kernel_categories(name, cat, want):
    assert gt.kernel_category(name, cat) == want


def test_without_cuda_one_line_and_exit_1():
    if __import__("torch").cuda.is_available():
        pytest.skip("this machine has CUDA: no CUDA-less path to show")
    assert gt.main([]) == 1


@pytest.mark.slow
def test_smoke_run_through_the_command_line(tmp_path):
    """--smoke --profile: the shipped setting and its tensorwise twin run and are profiled, each with its trace kept
    and the float8 row set against the bf16 one; a policy the trainer refuses is a row saying so, not a crash."""
    out, art = tmp_path / "g.json", tmp_path / "art"
    cmd = [
        sys.executable,
        "benchmarks/gpu_throughput.py",
        "--smoke",
        "--profile",
        "--out",
        str(out),
        "--artifacts",
        str(art),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = validate(out, json.loads(out.read_text()))
    runs = doc["result"]["runs"]
    assert [r["status"] for r in runs] == ["ok", "ok", "unsupported"] and runs[0]["mfu"] is None  # the CPU: n/a
    assert "activation_checkpoint='no-such-policy' is invalid" in runs[2]["reason"]
    assert "float8_vs_bf16" in runs[1]["profile"] and len(list(art.glob("trace_*.json.gz"))) == 2
    assert doc["title"] == "GPU throughput" and doc["torch"] and [t["title"][:8] for t in doc["tables"][:3]] == [
        "Training", "Profile ", "Top kern"]  # fmt: skip
