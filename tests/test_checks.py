"""`python -m titanloop.checks` without a GPU: its command line, what it does without CUDA, the memory plans a CPU
writes and a GPU node reuses, the training row's use of plans, free memory and the time limit (with a launcher that
writes a run's metrics), every verdict against the numbers that must pass and fail it, the json and the wrapper
script; and (slow) every row's orchestration at tiny sizes on the CPU (--smoke)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import no_setup_env
from launch import environment

from benchmarks import report
from titanloop.checks import __main__ as ck
from titanloop.checks import runs
from titanloop.checks import verdicts as vd
from titanloop.checks.numerics import Check

ROOT = Path(__file__).resolve().parent.parent
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: no CUDA-less path to show")
TINY = ["--shape", "debug-tiny", "--seq-len", "64", "--precisions", "bf16", "--no-memory-runs"]


def checks(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "titanloop.checks", *args]
    return subprocess.run(cmd, cwd=ROOT, env=environment(), capture_output=True, text=True, timeout=timeout)


def test_help_explains_every_row():
    out = checks("--help").stdout
    for row in ck.ROWS:
        assert f"\n  {row} " in out, row
    for name in ("attention docs", "bf16 logits", "readout fused", "kernel choice", "memory plan", "float8"):
        assert name in out, name


@pytest.mark.parametrize(
    "bad, says",
    [
        (["--rows", "plans,warp"], "--rows 'plans,warp': expected some of plans,numerics"),
        (["--loops", "4,x"], "--loops '4,x': expected comma-separated integers >= 1"),
        (["--precisions", "tensorwise"], "bf16 and any of tensorwise, rowwise"),
        (["--steps", "0"], "--steps 0: expected an integer >= 1"),
        (["--time-limit", "-5"], "--time-limit -5: expected seconds > 0"),
        (["--plans", "/no/such.json"], "--plans /no/such.json: not a json with memory plans"),
    ],
)
def test_bad_input_is_one_line(bad, says, capsys):
    with pytest.raises(SystemExit) as e:
        ck.parse_args(bad)
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and says in err, err


@NO_CUDA
def test_without_cuda_the_gpu_rows_are_named_in_one_line_and_exit_1(tmp_path):
    out = tmp_path / "c.json"
    proc = checks("--rows", "plans,numerics,kernels,preemption", *TINY, "--out", str(out))  # (the plans run)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[1] == "no CUDA device: numerics, kernels, preemption need one and are not run (n/a); exit status 1"
    doc = json.loads(out.read_text())
    assert doc["result"]["not_run"] == ["numerics", "kernels", "preemption"] and doc["summary"][0]["met"] is False
    assert [c["name"] for c in doc["result"]["checks"]] == ["plan T=4 bf16"]
    assert doc["commit"] == runs.git_commit() and doc["result"]["torch"] == torch.__version__


def test_plans_written_on_a_cpu_are_reused_by_their_key(tmp_path):
    """`--rows plans` on the CPU plans every training run (exit 0, nothing needs CUDA); --plans FILE reads them back by
    the runs' arguments and GPU count, and a run with other arguments is planned anew."""
    out = tmp_path / "plans.json"
    proc = checks("--rows", "plans", "--gpus", "2", *TINY, "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    written = json.loads(out.read_text())["plans"]
    a = ck.parse_args([*TINY, "--plans", str(out)])
    a.gpus, a.model, a.free_bytes, a.shape_text = 2, {}, None, "debug-tiny"
    (key,) = written
    assert key == ck.plan_key(ck.run_args(a, ck.training_runs(a)[0], Path("elsewhere")), 2)
    c = ck.Checks(a, _meta(commit="now"))
    c.a.out, c.plans = tmp_path / "again.json", dict(a.plan_records)
    ck.row_plans(c)
    assert c.checks[-1].detail.startswith(f"debug-tiny: {written[key]['gib']:.2f} GiB per GPU (planned before, at ")
    a.steps = 7  # another run: its plan is made here
    c.plans = dict(a.plan_records)
    ck.row_plans(c)
    assert "(planned in " in c.checks[-1].detail and len(c.plans) == 2


def _meta(**kw) -> dict:
    meta = {"device": "NVIDIA H200", "n_gpus": 8, "torch": "2.11.0", "commit": "abc", "shape": "ouro-1.4b",
            "seq_len": 4096, "steps": 60, "command": "python -m titanloop.checks", "date": "2026-12-01"}  # fmt: skip
    return {**meta, "not_run": [], **kw}


def _fake_runs(monkeypatch, peak_gib=30.0, code=0):
    """runs.run replaced by a launcher that writes the metrics a training run logs (or exits with `code`)."""
    launched = []

    def fake(cmd, log, timeout, env=None):
        launched.append((cmd, timeout))
        if "--training.run_dir" in cmd and code == 0:
            run_dir = Path(cmd[cmd.index("--training.run_dir") + 1])
            run_dir.mkdir(parents=True)
            rows = [{"step": s, "loss": 10.0 - s / 2, "tokens_per_s": 8000.0, "tflops": 100.0, "mfu": 0.35,
                     "max_mem_gib": peak_gib} for s in (1, 5, 10)]  # fmt: skip
            (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return code

    monkeypatch.setattr(runs, "run", fake)
    return launched


def _gpu_args(tmp_path, **kw) -> argparse.Namespace:
    a = ck.parse_args(["--loops", "4", "--precisions", "bf16,tensorwise", "--no-memory-runs", "--steps", "10"])
    a.gpus, a.model, a.shape, a.shape_text, a.free_bytes = 2, {}, "ouro-1.4b", "ouro-1.4b", 79 * ck.GIB
    a.out = tmp_path / "c.json"
    for k, v in kw.items():
        setattr(a, k, v)
    return a


def test_the_train_row_judges_memory_against_the_plan_and_float8_against_bf16(tmp_path, monkeypatch):
    launched = _fake_runs(monkeypatch)
    a = _gpu_args(tmp_path)
    c = ck.Checks(a, _meta())
    for spec, gib in zip(ck.training_runs(a), (28.0, 50.0)):
        c.plans[ck.plan_key(ck.run_args(a, spec, Path("x")), 2)] = {"gib": gib, "commit": "x"}
    ck.row_train(c, tmp_path)
    got = {x.name: x for x in c.checks}
    assert [cmd[:6] for cmd, _ in launched][0][-2:] == ["--nproc_per_node=2", "-m"] and launched[0][1] is None
    assert got["train T=4 bf16"].ok and "4,000 tokens/s/GPU" in got["train T=4 bf16"].detail  # 8,000 over 2 GPUs
    assert "MFU 35.0%" in got["train T=4 bf16"].detail  # the trainer's own MFU, as logged
    assert got["memory plan T=4 bf16"].ok and got["memory plan T=4 bf16"].numbers["rel"] == pytest.approx(30 / 28 - 1)
    assert got["memory plan T=4 tensorwise"].ok is False  # 30 GiB measured against 50 planned: -40%
    assert got["float8 tensorwise T=4 speed"].numbers["ratio"] == 1.0  # the same speed (the rule: test_float8_rules)
    # a plan larger than the free memory: not run, n/a; the time limit passed: not run, n/a and remembered
    a.free_bytes, c.checks, c.runs = 40 * ck.GIB, [], []
    ck.row_train(c, tmp_path / "big")
    big = {x.name: x for x in c.checks}["train T=4 tensorwise"]
    assert big.ok is None and big.detail == "not run: its plan is 50.00 GiB, 40.0 GiB free"
    a.time_limit, c.start, c.checks = 1.0, c.start - 5, []
    ck.row_train(c, tmp_path / "late")
    assert [x.ok for x in c.checks[:2]] == [None, None] and "train T=4 bf16" in c.meta["not_run"]


def test_a_run_stopped_at_the_time_limit_is_na_and_a_crash_fails(tmp_path, monkeypatch):
    a = _gpu_args(tmp_path, precisions=["bf16"])
    c = ck.Checks(a, _meta())
    _fake_runs(monkeypatch, code=None)
    ck.row_train(c, tmp_path / "stopped")
    assert c.checks[0].ok is None and c.checks[0].detail.startswith("stopped at the time limit")
    _fake_runs(monkeypatch, code=1)
    (tmp_path / "T4-bf16-loop.log").write_text("[rank0]: ValueError: boom\nChildFailedError: x\n")
    c.checks = []
    ck.row_train(c, tmp_path)
    assert c.checks[0].ok is False and c.checks[0].detail == "exit 1: ValueError: boom"


def test_pick_shape_by_free_memory():
    assert ck.pick_shape(80 * ck.GIB, 1) == ("ouro-1.4b", {})  # 1.4B x 16 B = 22 GB + looped stack + 16 GiB
    assert ck.pick_shape(30 * ck.GIB, 1) == ("ouro-1.4b", {"n_layers": 12})
    assert ck.pick_shape(30 * ck.GIB, 8) == ("ouro-1.4b", {})  # FSDP2 shards the fp32 state over 8
    assert ck.pick_shape(1 * ck.GIB, 1) == ("debug-small", {})


# ----- verdicts ---------------------------------------------------------------------------------------------------
def test_memory_plan_check():
    assert vd.memory_plan_check("m", 10.0, 9.0).ok  # +11%: within 15%
    assert vd.memory_plan_check("m", 12.0, 10.0).ok is False  # +20%
    assert vd.memory_plan_check("m", 7.0, 10.0).ok is False  # -30%: a plan too pessimistic fails too
    assert vd.memory_plan_check("m", None, 10.0).ok is False  # a run that logged no peak is not a pass


def _run(t, precision, tok, first, last, **kw):
    return vd.RunResult(t, precision, tokens_per_s_gpu=tok, loss_first=first, loss_last=last, **kw)


def test_float8_rules():
    res = [
        _run(4, "bf16", 1000.0, 10.8, 6.00),
        _run(4, "tensorwise", 1250.0, 10.8, 6.10),
        _run(4, "rowwise", 900.0, 10.8, 6.30),
        _run(8, "bf16", 500.0, 10.8, 10.5),
        _run(8, "tensorwise", 450.0, 10.8, 10.5),
        vd.RunResult(8, "rowwise", error="exit 1: boom"),
        _run(4, "bf16", 5000.0, 10.8, 9.0, ac="none"),  # a memory run: not the T=4 base
    ]
    c = {x.name: x for x in vd.float8_checks(res)}
    assert c["float8 tensorwise T=4 loss"].ok and c["float8 tensorwise T=4 speed"].ok  # +1.7%, 1.25x
    assert c["float8 rowwise T=4 loss"].ok is False and c["float8 rowwise T=4 speed"].ok is None  # +5%; reported
    assert c["float8 tensorwise T=8 loss"].ok is False and "not judgeable" in c["float8 tensorwise T=8 loss"].detail
    assert c["float8 tensorwise T=8 speed"].ok is False and c["float8 rowwise T=8 loss"].ok is False
    lower = {x.name: x for x in vd.float8_checks([res[0], _run(4, "tensorwise", 1250.0, 10.8, 5.0)])}
    assert lower["float8 tensorwise T=4 loss"].ok  # lower than bf16 is not what the check is for
    for last, ok in ((6.0 * 1.031, False), (6.0 * 1.029, True)):
        c8 = {x.name: x for x in vd.float8_checks([res[0], _run(4, "tensorwise", 1250.0, 10.8, last)])}
        assert c8["float8 tensorwise T=4 loss"].ok is ok, last
    skipped = vd.RunResult(4, "bf16", error="not run: --time-limit reached", skipped=True)
    assert vd.float8_checks([skipped, res[1]])[0].ok is None  # no base because it did not run: n/a, not FAIL


def test_preemption_verdict():
    ref = [{"step": s, "loss": 5.0 - 0.1 * s} for s in range(1, 31)]
    same = [dict(r) for r in ref]
    assert vd.preemption_verdict(ref, same, same, 12).ok  # bitwise, as the reference repeats bitwise
    off = [{**r, "loss": r["loss"] + 1e-7} for r in ref]
    assert vd.preemption_verdict(ref, same, off, 12).ok is False  # bitwise required: 1e-7 is a lost state
    noisy = [{**r, "loss": r["loss"] + 1e-4} for r in ref]
    lost = [{**r, "loss": r["loss"] + 1e-2} for r in ref]
    assert vd.preemption_verdict(ref, noisy, noisy, 12).ok and not vd.preemption_verdict(ref, noisy, lost, 12).ok
    assert vd.preemption_verdict(ref, same, same, 25).ok is False  # 5 steps after the resume: too few


def _report(loss: float, acc: float, tokens: int = 1000) -> dict:
    loops, qs = ck.VAL_LOOPS, ck.VAL_QS
    points = [{"loops": t, "loss": loss, "perplexity": 2.0, "token_accuracy": acc, "sequence_accuracy": 0.1}
              for t in loops]  # fmt: skip
    q = [{"strategy": "q_exit", "param": {"q": x}, "avg_loops": 2.0, "loss": loss, "token_accuracy": acc} for x in qs]
    return {"depth_sweep": {"points": points}, "data": {"scored_tokens": tokens, "examples": 10},
            "diagnostics": {"exit_distribution": {"mean_exit_loop": 2.5}}, "exit_frontier": {"points": q}}  # fmt: skip


def _val(loss: float, acc: float, tokens: int = 1000) -> dict:
    out = {"val/tokens": tokens, "val/exit_depth": 2.5}
    for t in ck.VAL_LOOPS:
        out |= {f"val/loss/loop_{t}": loss, f"val/ppl/loop_{t}": 2.0, f"val/token_acc/loop_{t}": acc}
        out[f"val/seq_acc/loop_{t}"] = 0.1
    for q in ck.VAL_QS:
        out |= {f"val/q_exit/q{q:g}/avg_loops": 2.0, f"val/q_exit/q{q:g}/loss": loss}
        out[f"val/q_exit/q{q:g}/token_acc"] = acc
    return out


def test_validation_check_tolerances():
    """float32: 1e-5 relative; bfloat16: 2x the CLI's own distance from float32 plus the rounding floor."""
    fp32 = _report(2.0, 0.5)
    assert vd.validation_check("float32", _val(2.0 + 1e-6, 0.5), fp32, fp32, ck.VAL_LOOPS, ck.VAL_QS).ok
    assert not vd.validation_check("float32", _val(2.0 + 1e-4, 0.5), fp32, fp32, ck.VAL_LOOPS, ck.VAL_QS).ok
    bf16 = _report(2.01, 0.5)  # 0.01 from float32: validation may be 0.02 (+ floor) from the bf16 CLI
    assert vd.validation_check("bfloat16", _val(2.029, 0.5), bf16, fp32, ck.VAL_LOOPS, ck.VAL_QS).ok
    assert not vd.validation_check("bfloat16", _val(2.04, 0.5), bf16, fp32, ck.VAL_LOOPS, ck.VAL_QS).ok
    assert vd.validation_check("bfloat16", _val(2.01, 0.5019), bf16, fp32, ck.VAL_LOOPS, ck.VAL_QS).ok  # < 2 tokens
    assert not vd.validation_check("bfloat16", _val(2.01, 0.504), bf16, fp32, ck.VAL_LOOPS, ck.VAL_QS).ok
    other = _report(2.01, 0.5, tokens=999)
    assert not vd.validation_check("bfloat16", _val(2.01, 0.5), other, fp32, ck.VAL_LOOPS, ck.VAL_QS).ok


def test_the_json_follows_the_report_schema_and_renders(tmp_path):
    res = [_run(4, "bf16", 9000.0, 10.8, 5.0, mfu=0.41, peak_gib=30.0, plan_gib=28.0),
           _run(4, "tensorwise", 9900.0, 10.8, 5.05, mfu=0.45)]  # fmt: skip
    doc = ck.result_json([Check("attention docs", True, "ok"), Check("flash-attn", None, "n/a")], res, {}, _meta())
    report.validate(Path("x.json"), doc)
    rows = {r["row"]: r for r in doc["summary"]}
    assert rows["checks passed"]["measured"] == "1/1" and rows["checks passed"]["met"]
    assert (
        rows["float8 tensorwise / bf16 tokens/s, T=4"]["measured"] == 1.1
        and doc["title"].startswith("GPU check")
        and doc["torch"]
    )
    assert doc["tables"][1]["rows"][0][:7] == [4, "bf16", "loop", "9,000", "41.0", "30.00", "28.00"]
    assert doc["machine"] == "8 x NVIDIA H200, torch 2.11.0" and doc["commit"] == "abc"
    name = f"{doc['date']}-h200-check"  # the dated record a GPU run writes
    (tmp_path / f"{name}.json").write_text(json.dumps(doc))
    text = report.render(report.load_results(tmp_path))
    assert f"| checks passed ([{name}](#{name})) | 1/1 | all | yes | {doc['date']} | abc | h200 |" in text


# ----- the wrapper ------------------------------------------------------------------------------------------------
def _script(*args, **env):
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHON"}, **env}
    return subprocess.run(["bash", "scripts/gpu_check.sh", *args], cwd=ROOT, capture_output=True, text=True, env=env)


def test_the_wrapper_refuses_an_interpreter_without_torch(tmp_path):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nexit 1\n")
    fake.chmod(0o755)
    proc = _script("--python", str(fake), PYTHON=sys.executable)  # --python wins over PYTHON
    assert proc.returncode == 2 and proc.stdout == "" and proc.stderr.count("\n") == 1
    assert proc.stderr.startswith(f"error: python '{fake}' cannot import torch")


def test_the_wrapper_help_runs_no_setup(tmp_path):
    env = no_setup_env(tmp_path)
    proc = _script("--help", **env)
    assert proc.returncode == 0 and proc.stdout.startswith("The acceptance check of a GPU node")
    assert "[setup]" not in proc.stdout
    assert not (tmp_path / "venv").exists()
    proc = _script("-h", "--python", sys.executable, **env)
    assert proc.returncode == 0 and "usage: python -m titanloop.checks" in proc.stdout


@NO_CUDA
def test_the_wrapper_runs_this_checkouts_checks(tmp_path):
    proc = _script("--rows", "plans", *TINY, "--out", str(tmp_path / "c.json"), PYTHON=sys.executable)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((tmp_path / "c.json").read_text())["title"].startswith("GPU check")


# ----- every row's orchestration on the CPU -----------------------------------------------------------------------
@pytest.mark.slow
def test_smoke_runs_every_rows_orchestration_on_the_cpu(tmp_path):
    """--smoke: the kernel recorder in a compiled torchrun run, the plans, training runs of two precisions and the
    memory runs, the float8 verdicts, the eval rows; the json rewritten after every row. The numbers mean nothing;
    every row must be there and no run may have crashed (the preemption row takes ~10 minutes on 2 cores here: its
    verdict is tested above, its orchestration on a GPU)."""
    out = tmp_path / "c.json"
    proc = checks("--smoke", "--rows", "plans,kernels,train,eval", "--precisions", "bf16,tensorwise", "--out", str(out),
                  timeout=1200)  # fmt: skip
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]  # the CPU's kernels and speed fail
    doc = json.loads(out.read_text())
    report.validate(out, doc)
    rows = {c["name"]: c for c in doc["result"]["checks"]}
    assert [n for n in rows if n.startswith("train ")] == [
        "train T=4 bf16", "train T=4 tensorwise", "train T=4 bf16 AC none", "train T=4 bf16 AC none eager"]  # fmt: skip
    assert all(rows[n]["ok"] for n in rows if n.startswith(("train ", "eval ")))
    assert rows["kernel choice"]["ok"] is False and "not fused bf16 CUDA" in rows["kernel choice"]["detail"]
    assert len(doc["plans"]) == 3 and {"float8 tensorwise T=4 loss", "float8 tensorwise T=4 speed"} <= set(rows)
