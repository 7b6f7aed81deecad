"""scripts/gpu_eval_check.py (issue 36's GPU run) at its tiny --smoke size on the CPU, so the script is known to run
and to write every row before anyone spends GPU time on it. The GPU numbers themselves come from a CUDA machine:
`python scripts/gpu_eval_check.py --out runs/gpu_eval_check.json`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import report
from helpers import load_script

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_eval_check.py"
ROWS = [  # in the order they run (issue 36's "done when" first)
    "validation_equals_cli_bf16",
    "generate_cache_equals_no_cache_small",
    "load_straight_to_device",
    "sweep_frontier_1p4b",
    "generate_cache_equals_no_cache_big",
    "generate_speed_1p4b",
    "cli_generate_auto",
    "head_stats_syncs",
    "hf_ouro_generate",
    "validation_equals_cli_fp32",
]


def run(*args, timeout=900):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, str(SCRIPT), *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)


def test_help_and_usage_errors(tmp_path):
    r = run("--help")
    assert r.returncode == 0 and "--smoke" in r.stdout and "--out" in r.stdout and "--ouro-code" in r.stdout
    r = run("--out", str(tmp_path / "x.json"), "--smoke", "--device", "tpu")
    assert r.returncode == 2 and r.stderr == "error: --device='tpu' is invalid: expected cuda, cuda:N or cpu\n"
    assert not (tmp_path / "x.json").exists()
    if not torch.cuda.is_available():  # the GPU run is the default: without CUDA it says how to get the CPU one
        r = run("--out", str(tmp_path / "x.json"))
        assert r.returncode == 2 and r.stderr == (
            "error: --device=cuda but torch.cuda.is_available() is False: run on a CUDA machine, or --smoke\n"
        )


@pytest.mark.slow
def test_smoke_run_writes_every_row(tmp_path):
    out = tmp_path / "smoke.json"
    r = run("--smoke", "--out", str(out))
    assert out.is_file(), r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads(out.read_text())
    report.validate(out, doc)  # the schema BENCHMARKS.md renders (committed as benchmarks/results/gpu_eval.json)
    assert doc["summary"][0]["row"] == "gpu_eval_check: rows passed" and doc["summary"][0]["met"] is True
    d = doc["result"]
    failed = {row["name"]: row.get("error") or row for row in d["rows"] if row["status"] == "FAIL"}
    assert not failed, failed
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert d["smoke"] is True and d["device"] == "cpu" and d["torch"] and "gpu_eval_check.py --smoke" in d["command"]
    assert d["git_commit"] is None or len(d["git_commit"]) == 40
    rows = {row["name"]: row for row in d["rows"]}
    assert list(rows) == ROWS
    for name, row in rows.items():
        if name == "hf_ouro_generate" and row["status"] == "SKIP":  # no Ouro model code here: it says why
            assert "OuroForCausalLM" in row["reason"] or "transformers does not import" in row["reason"]
            continue
        assert row["status"] == "PASS", (name, row.get("error"), row.get("traceback"))
    assert d["summary"]["FAIL"] == 0 and d["summary"]["PASS"] + d["summary"]["SKIP"] == len(ROWS)

    for dtype in ("fp32", "bf16"):
        v = rows[f"validation_equals_cli_{dtype}"]
        assert v["tokens"] == v["cli_tokens"] == d["sizes"]["val_steps"] * d["sizes"]["val_batch"] * 64
        assert 0 <= v["worst_ratio"] <= 1 and len(v["metrics"]) == 5 * 4 + 1 + 3 * 3
        assert all(m["tol"] > 0 for m in v["metrics"].values())
    assert rows["validation_equals_cli_bf16"]["cli_stdout"].endswith("on cpu in bfloat16")
    cache = rows["generate_cache_equals_no_cache_small"]["results"]
    assert [(c["dtype"], c["n_loops"]) for c in cache] == [(t, n) for t in ("float32", "bfloat16") for n in (1, 4, 8)]
    load = rows["load_straight_to_device"]
    assert set(load["loads"]) == {"hf", "dcp"} and all(x["checksum_matches"] for x in load["loads"].values())
    sweep = rows["sweep_frontier_1p4b"]
    assert sweep["tokens"] >= d["sizes"]["sweep_tokens"] and sweep["loops"] == list(range(1, 9))
    assert sweep["exit_loops"] == 4 and sweep["frontier_points"] > 0
    assert rows["head_stats_syncs"]["bitwise_equal_to_old"] is True
    speed = rows["generate_speed_1p4b"]["results"]
    assert [s["batch"] for s in speed] == [1, 16] and all(s["new_tokens"] == d["sizes"]["gen_new"] for s in speed)


def _module():
    return load_script(SCRIPT, "gpu_eval_check_script")


def test_budget_skips_rows_and_stops_subprocesses(tmp_path, monkeypatch):
    """--budget-s: a row that would start with less than ROW_RESERVE_S left is a SKIP (its function never runs), a
    subprocess is stopped at the budget, and --commit is what the json records (the GPU copy has no .git)."""
    mod = _module()
    out = tmp_path / "b.json"
    args = mod.parse_args(["--smoke", "--out", str(out), "--budget-s", "100", "--commit", "abc123"])
    monkeypatch.setattr(mod, "BUDGET", mod.Budget(100.0))
    report_ = mod.Report(args, mod.SIZES["smoke"])
    calls = []
    assert report_.row("fits", lambda: calls.append(1) or {"status": "PASS"})["status"] == "PASS"
    mod.BUDGET = mod.Budget(mod.ROW_RESERVE_S - 1)
    late = report_.row("late", lambda: calls.append(2) or {"status": "PASS"})
    assert late["status"] == "SKIP" and "--budget-s" in late["reason"] and calls == [1]
    pid_file = tmp_path / "grandchild.pid"
    with pytest.raises(subprocess.TimeoutExpired):  # as torchrun's workers: a grandchild goes with the group
        mod.BUDGET = mod.Budget(1.0)
        mod._run(["bash", "-c", f"sleep 30 & echo $! > {pid_file}; wait"])
    pid = int(pid_file.read_text())
    deadline = mod.time.monotonic() + 10
    ended = False
    while not ended and mod.time.monotonic() < deadline:
        try:  # gone, or a zombie waiting for its new parent to reap it
            ended = Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")
        except FileNotFoundError:
            ended = True
        mod.time.sleep(0.1)
    assert ended, "the grandchild outlived the timeout"
    doc = json.loads(out.read_text())
    assert doc["commit"] == "abc123" and doc["result"]["budget_s"] == 100 and doc["result"]["git_dirty"] is False
    assert [r[:2] for r in doc["tables"][0]["rows"]] == [["fits", "PASS"], ["late", "SKIP"]]
    r = run("--smoke", "--out", str(out), "--budget-s", "0")
    assert r.returncode == 2 and r.stderr == "error: --budget-s=0 is invalid: expected seconds > 0\n"


def test_cache_rule_catches_a_position_bug_and_measures_bf16_rounding(monkeypatch):
    """The cache == no-cache rule of the generate rows: on a random debug-tiny model, the real cache passes in
    float32 with no tolerance beyond 4 units in the last place; a decode that is one position off (a RoPE offset
    bug) fails it; in bfloat16 each divergence records its measured rounding error e against the float32 copy and
    is judged against max(ulp bound, 4 e), never against e alone (the float32 rows do not use e)."""
    from titanloop.eval import generate as gen_mod
    from titanloop.model import LoopLM, preset

    mod = _module()
    torch.manual_seed(0)
    model = LoopLM(preset("debug-tiny")).eval()
    prompt = torch.randint(0, model.cfg.vocab_size, (4, 8), generator=torch.Generator().manual_seed(1))
    pair = mod.both_precisions(model)
    assert pair[torch.float32] is model and pair[torch.bfloat16].embed_tokens.weight.dtype == torch.bfloat16
    assert torch.equal(pair[torch.bfloat16].lm_head.weight.float(), model.lm_head.weight.to(torch.bfloat16).float())
    for t in (1, 4):
        good = mod.cache_vs_recompute(model, prompt, 12, t)
        assert good["ok"] and good["match_fraction"] == 1.0, good

    real = gen_mod._run_loops

    def off_by_one(model_, ids, n_loops, cfg, **kw):
        if "position_offset" in kw:
            kw["position_offset"] += 1
        return real(model_, ids, n_loops, cfg, **kw)

    with monkeypatch.context() as m:
        m.setattr(gen_mod, "_run_loops", off_by_one)
        bad = [mod.cache_vs_recompute(model, prompt, 12, t) for t in (1, 4)]
    assert not all(b["ok"] for b in bad), bad
    assert all(d["rounding_err"] is None for b in bad for d in b["divergences"])  # float32: the ulp bound only

    row = mod.row_cache(pair, {"cache_prompt": 8, "cache_new": 12}, torch.device("cpu"), [1, 8])
    assert row["status"] == "PASS" and [r["dtype"] for r in row["results"]] == ["float32"] * 2 + ["bfloat16"] * 2
    divs = [d for r in row["results"] if r["dtype"] == "bfloat16" for d in r["divergences"]]
    assert divs  # bfloat16 flips near-ties of this random model (2 on CPU), each judged with its measured e
    for d in divs:
        assert d["rounding_err"] > 0 and d["tie_tol"] == max(d["ulp_tol"], 4 * d["rounding_err"])
    assert "4 * e" in row["rule"]


def test_sync_count_leaves_out_torchs_debug_mode_notice():
    """The H100 run at fdb31ea counted 2 syncs in the head statistics where its recorded sites show one sync and
    torch's notice that the sync debug mode is a prototype: only the per-sync warning counts."""
    import warnings

    mod = _module()

    def w(msg: str) -> warnings.WarningMessage:
        return warnings.WarningMessage(UserWarning(msg), UserWarning, "x.py", 1)

    caught = [
        w("Synchronization debug mode is a prototype feature and does not yet detect all synchronizing operations"),
        w("called a synchronizing CUDA operation (Triggered internally at /pytorch/c10/cuda/CUDAFunctions.cpp:176.)"),
        w("some other warning"),
    ]
    assert [str(x.message)[:8] for x in mod.sync_warnings(caught)] == ["called a"]


def test_rows_runs_a_subset_with_what_it_needs(tmp_path):
    """--rows: only the named rows run (the 1.4B-shaped model built by the first row that uses it), a row on the
    small trained model brings the row that trains it, and an unknown name is one line and exit 2."""
    mod = _module()
    out = tmp_path / "rows.json"
    args = mod.parse_args(["--smoke", "--out", str(out), "--rows", "cli_generate_auto, head_stats_syncs"])
    assert args.rows == ["validation_equals_cli_bf16", "cli_generate_auto", "head_stats_syncs"]
    r = run("--smoke", "--out", str(out), "--rows", "head_stats_syncs", timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert [row["name"] for row in doc["result"]["rows"]] == ["head_stats_syncs"]
    assert doc["result"]["rows"][0]["status"] == "PASS" and doc["summary"][0]["measured"] == "1/1"
    r = run("--smoke", "--out", str(out), "--rows", "head_stats,sweep_frontier_1p4b")
    assert r.returncode == 2 and r.stderr.startswith("error: --rows='head_stats,sweep_frontier_1p4b': unknown row")
    assert len(r.stderr.splitlines()) == 1


def test_summary_says_how_many_rows_were_skipped():
    mod = _module()
    rows = [{"name": "a", "status": "PASS", "seconds": 1}, {"name": "b", "status": "SKIP", "seconds": 0}]
    data = {"rows": rows, "summary": {"PASS": 1, "FAIL": 0, "SKIP": 1}, "command": "x", "seconds": 1.0}
    data.update(device="cpu", torch=torch.__version__, smoke=True, git_commit="abc123")
    doc = mod.report_document(data)
    assert doc["summary"][0]["measured"] == "1/1 (1 skipped)" and doc["summary"][0]["met"] is True
