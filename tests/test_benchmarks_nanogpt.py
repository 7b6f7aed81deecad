"""benchmarks/nanogpt.py without a nanoGPT checkout: its argument checks, the held-out scoring both models share,
nanoGPT's data files, the whole-step profile of a loop shaped as nanoGPT's train.py (a small stand-in checkout, run
through benchmarks/nanogpt_step_profile.py as the benchmark runs the real one), the commit read from a checkout's
.git, titanloop's commands and profile rows, and the summary's verdicts and record
(the measured run: benchmarks/results/2026-12-02-cpu-nanogpt.json)."""

import math
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import nanogpt  # noqa: E402  (benchmarks/nanogpt.py)


def test_a_directory_that_is_no_nanogpt_checkout_is_refused(tmp_path):
    proc = subprocess.run(
        [sys.executable, "benchmarks/nanogpt.py", "--nanogpt", str(tmp_path)], cwd=REPO, capture_output=True, text=True
    )
    assert proc.returncode == 2 and "no train.py there; pass a checkout of karpathy/nanoGPT" in proc.stderr


def test_windows_score_every_target_once_and_the_loss_is_the_mean_ce():
    ids = list(range(10)) * 14  # 140 tokens: 2 windows of 64 inputs, 128 targets
    x, y = nanogpt.windows(ids)
    assert x.shape == y.shape == (2, 64) and torch.equal(y.flatten(), torch.tensor(ids[1:129]))
    uniform = nanogpt.heldout_loss(lambda xb: torch.zeros(*xb.shape, 10), x, y, batch=1)
    assert uniform == pytest.approx(math.log(10))  # a model that knows nothing: ln V per character
    exact = nanogpt.heldout_loss(lambda xb: 50.0 * torch.nn.functional.one_hot((xb + 1) % 10, 10).float(), x, y)
    assert exact < 1e-6


def test_nanogpt_data_is_the_same_split_in_its_format(tmp_path):
    nanogpt.prepare_nanogpt_data(tmp_path)
    d = tmp_path / "data" / "shakespeare_char"
    train, val = nanogpt.corpus_text()
    chars = sorted(set(train + val))
    assert len(chars) == 65 and len(train) == 1003854 and len(val) == 111540
    meta = {"vocab_size": 65, "itos": dict(enumerate(chars)), "stoi": {c: i for i, c in enumerate(chars)}}
    assert (d / "meta.pkl").read_bytes() == pickle.dumps(meta)  # what nanoGPT's prepare.py writes, byte for byte
    got = np.fromfile(d / "val.bin", dtype=np.uint16)
    assert "".join(chars[int(i)] for i in got) == val


def _run(who: str, heldout: float, tps: float, wall: float, seed: int) -> dict:
    step_ms = [BATCH_MS / tps] * 4
    return {
        "heldout": heldout,
        "tokens_per_s": tps,
        "wall_s": wall,
        "startup_s": 5.0,
        "steps_s": wall - 6.0,
        "exit_s": 1.0,
        "final_eval_s": 2.0,
        "score_s": 3.0,
        "step_ms": step_ms,
        "profile_ms": {"forward": 10.0, "backward": 20.0, "uncovered": 1.0, "wall": 40.0},
        "seed": seed,
        "command": f"python {who}",
    }


BATCH_MS = 12 * 64 * 1000


def test_summary_verdicts_follow_the_numbers():
    def run(i, tl_loss, tl_tps):
        return {
            "run": i,
            "order": "x",
            "nanogpt": _run("nanogpt", 1.88, 20000.0, 70.0, 1337 + i),
            "titanloop": _run("titanloop", tl_loss, tl_tps, 80.0, i),
            "titanloop_plain": _run("titanloop_plain", tl_loss, 3 * tl_tps, 60.0, i),
            "titanloop_compile": _run("titanloop_compile", tl_loss, 2 * tl_tps, 90.0, i),
        }

    args = type("A", (), {"steps": 2000, "threads": 2})()
    good = nanogpt.summarize(args, [run(0, 1.72, 21000.0), run(1, 1.73, 19000.0), run(2, 1.74, 20500.0)])
    assert [r["met"] for r in good["summary"][:2]] == [True, True]
    assert good["summary"][1]["measured"] == 1.025  # the median run's ratio
    slow = nanogpt.summarize(args, [run(0, 1.90, 15000.0)])
    assert [r["met"] for r in slow["summary"][:2]] == [False, False]
    assert [r["measured"] for r in slow["summary"][2:4]] == [2.25, 1.5]  # plain, then compiled, over nanoGPT
    assert "titanloop plain: 1.167" in slow["summary"][4]["row"]  # 70 s / 60 s
    per_run = slow["tables"][0]
    assert per_run["rows"][0][:3] == [0, "nanogpt", 1337] and [r[2] for r in per_run["rows"]] == [1337, 0, 0, 0]
    parts = [r[1:4] for r in slow["tables"][1]["rows"] if r[0] == "titanloop"]
    assert parts[:3] == [["forward", 10.0, "25.0%"], ["backward", 20.0, "50.0%"], ["uncovered", 1.0, "2.5%"]]
    assert "1.53 passes" in slow["notes"][-1] and "nanoGPT over seeds 1337" in slow["notes"][0]


def test_the_record_carries_every_field_and_the_report_accepts_it(tmp_path):
    from benchmarks.common import stamp
    from benchmarks.report import load_results, render, validate

    runs = [{"run": 0, "order": "nanogpt/titanloop", "nanogpt": _run("nanogpt", 1.9, 2e4, 70.0, 1337)}]
    runs[0]["titanloop"] = _run("titanloop", 1.7, 1.6e4, 80.0, 0)
    args = type("A", (), {"steps": 2000, "threads": 2})()
    result = nanogpt.summarize(args, runs)
    result["result"]["nanogpt_commit"] = "ab" * 20  # as main() records them
    result["notes"].insert(0, nanogpt.provenance_note("ab" * 20, runs))
    record = stamp({"title": "t", "command": "python benchmarks/nanogpt.py", "machine": "m", **result})
    name = f"{record['date']}-cpu-nanogpt"
    validate(tmp_path / f"{name}.json", record)
    for who in ("nanogpt", "titanloop"):
        got = record["result"]["runs"][0][who]
        assert {"seed", "command", "step_ms", "profile_ms", "startup_s", "final_eval_s", "score_s"} <= set(got)
    text = render([(name, record)])
    assert f"nanoGPT at commit {'ab' * 20}" in text and '"nanogpt": [1337], "titanloop": [0]' in text
    assert "`python nanogpt`" in text and "shuffled non-overlapping windows" in text
    assert "Measured before the benchmark timed both alike" not in text  # this record says it all itself
    old = dict(load_results())["2026-12-02-cpu-nanogpt"]  # recorded before: the report says what it lacks
    text = render([("2026-12-02-cpu-nanogpt", old)])
    assert "1.53 passes" in text and "its fixed seed 1337 in every run" in text and "titanloop_plain" not in text


FAKE_TRAIN = """
# A stand-in with the shape of nanoGPT's train.py: module-level get_batch / estimate_loss, the same loop.
import os, time
import numpy as np
import torch
from model import GPT
out_dir, max_iters, eval_interval, eval_iters, block_size, batch_size = "out", 3, 250, 2, 8, 2
always_save_checkpoint = False
exec(open("configurator.py").read())
torch.manual_seed(1337)
print("seed", torch.initial_seed())
data = np.fromfile(os.path.join("data", "shakespeare_char", "train.bin"), dtype=np.uint16)
def get_batch(split):
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([torch.from_numpy(data[i : i + block_size].astype(np.int64)) for i in ix])
    return x, x
model = GPT()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
@torch.no_grad()
def estimate_loss():
    model.eval()
    out = [model(*get_batch(s))[1].item() for s in ("train", "val") for _ in range(eval_iters)]
    model.train()
    return out
iter_num = 0
X, Y = get_batch("train")
t0 = time.time()
while True:
    if iter_num % eval_interval == 0:
        estimate_loss()
        if always_save_checkpoint and iter_num > 0:
            os.makedirs(out_dir, exist_ok=True)
            torch.save({"model": model.state_dict()}, os.path.join(out_dir, "ckpt.pt"))
    logits, loss = model(X, Y)
    X, Y = get_batch("train")
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    t1 = time.time()
    dt, t0 = t1 - t0, t1
    print(f"iter {iter_num}: loss {loss.item():.4f}, time {dt * 1000:.2f}ms")
    iter_num += 1
    if iter_num > max_iters:
        break
"""

FAKE_MODEL = """
import time
import torch
class GPT(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(65, 65)
    def forward(self, idx, targets):
        time.sleep(0.03)  # a forward of known length
        logits = self.emb(idx)
        return logits, torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
"""

FAKE_CONFIGURATOR = """
import sys
from ast import literal_eval
for arg in sys.argv[1:]:
    if arg.startswith("--"):
        key, value = arg[2:].split("=", 1)
        try:
            value = literal_eval(value)
        except (SyntaxError, ValueError):
            pass
        globals()[key] = value
"""


def test_nanogpt_loop_is_profiled_part_by_part_with_the_runs_seed(tmp_path):
    """Through the real wrapper and subprocess: one row per iteration (0..steps), an evaluation's forwards count as
    eval and not as forward, the checkpoint as checkpoint, the seed is 1337 + run, the parts cover the step."""
    checkout = tmp_path / "nanoGPT"
    (checkout / "config").mkdir(parents=True)
    (checkout / "train.py").write_text(FAKE_TRAIN)
    (checkout / "model.py").write_text(FAKE_MODEL)
    (checkout / "configurator.py").write_text(FAKE_CONFIGURATOR)
    (checkout / "config" / "train_shakespeare_char.py").write_text("")
    work = tmp_path / "work"
    nanogpt.prepare_nanogpt_data(work)
    args = type("A", (), {"nanogpt": str(checkout), "steps": 3})()
    env = {**__import__("os").environ, "OMP_NUM_THREADS": "1"}
    r = nanogpt.run_nanogpt(args, work, 2, env)
    assert r["seed"] == 1339 and "seed 1339" in (work / "nanogpt-2.log").read_text()
    assert "nanogpt_step_profile.py" in r["command"] and "--eval_interval=3" in r["command"]
    _, rows = nanogpt._profile_rows(work / "profile-2.jsonl")
    assert [row["step"] for row in rows] == [1, 2, 3, 4] and len(r["step_ms"]) == 4  # iterations 0..3
    evals = [row["parts"]["eval"] for row in rows]
    assert evals[1] == evals[2] == 0.0 and min(evals[0], evals[3]) >= 40 * 0.03  # 2 splits x 20 batches
    assert all(rows[i]["parts"]["forward"] < evals[i] / 4 for i in (0, 3))  # the eval's 40 forwards are not its own
    for row in rows:
        assert row["parts"]["forward"] >= 0.03  # its own forward
        assert row["parts"]["backward"] > 0 and row["parts"]["optimizer"] > 0 and row["parts"]["data"] > 0
        assert sum(row["parts"].values()) >= 0.8 * row["wall_s"]
    assert [row["parts"]["checkpoint"] > 0 for row in rows] == [False, False, False, True]
    assert r["final_eval_s"] == pytest.approx(rows[-1]["parts"]["eval"] + rows[-1]["parts"]["checkpoint"])
    assert r["startup_s"] + r["steps_s"] <= r["wall_s"] + 0.02  # the process's age: within its own wall time
    assert r["profile_ms"]["forward"] == pytest.approx(1000 * sum(x["parts"]["forward"] for x in rows) / 4, abs=1e-3)


def test_the_commit_is_read_from_the_checkouts_git(tmp_path):
    h1, h2, h3 = "1" * 40, "2" * 40, "3" * 40
    git = tmp_path / "a" / ".git"
    (git / "refs" / "heads").mkdir(parents=True)
    (git / "HEAD").write_text("ref: refs/heads/master\n")
    (git / "refs" / "heads" / "master").write_text(h1 + "\n")
    assert nanogpt.git_commit(tmp_path / "a") == h1
    (git / "refs" / "heads" / "master").unlink()
    (git / "packed-refs").write_text(f"# pack-refs with: peeled\n{h2} refs/heads/master\n")
    assert nanogpt.git_commit(tmp_path / "a") == h2
    (git / "HEAD").write_text(h3 + "\n")  # detached
    assert nanogpt.git_commit(tmp_path / "a") == h3
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / ".git").write_text(f"gitdir: {git}\n")  # a worktree's .git file
    assert nanogpt.git_commit(tmp_path / "b") == h3
    assert nanogpt.git_commit(tmp_path) is None


def test_titanloop_rows_profile_every_step_and_the_plain_row_is_pre_norm(tmp_path):
    from titanloop.train.step_timer import profile_record

    plain = nanogpt.titanloop_command(type("A", (), {"steps": 5})(), tmp_path / "r", 2, "titanloop_plain")
    line = " ".join(plain)
    assert "-m titanloop.train" in line and "torch.distributed.run" not in line
    assert "--metrics.step_profile true" in line and "--metrics.log_freq 1" in line
    assert "--training.seed 2 --data.seed 2" in line and line.endswith("--model.block_norm pre")
    from titanloop.train.config import load_config

    cfg = load_config(REPO / nanogpt.CONFIG, plain[plain.index("--config") + 2 :], world_size=1)
    assert (cfg.looplm.block_norm, cfg.objective.name, cfg.loop_sampler.kind, cfg.loop_sampler.n_loops) == (
        "pre",
        "final_only",
        "fixed",
        1,
    )
    steps = [profile_record(s, 0.1 * s, {"model": 0.05 * s, "post_step": 0.01, "post_step/Validation": 0.004})
             for s in (1, 2, 3)]  # fmt: skip
    out = nanogpt._run_times(10.0, 2.0, steps, 0.004)
    assert out["step_ms"] == [100.0, 200.0, 300.0] and out["exit_s"] == pytest.approx(10.0 - 2.0 - 0.6)
    assert out["profile_ms"]["model"] == pytest.approx(100.0) and out["profile_ms"]["wall"] == pytest.approx(200.0)
    assert out["profile_ms"]["uncovered"] == pytest.approx(200.0 - 100.0 - 10.0)


def test_the_op_profile_splits_aten_ops_into_its_named_kinds():
    """Each profiled op counts once, in the first kind it matches (the op names are named once, in OP_KINDS)."""
    kinds = {op: nanogpt.op_kind(op) for op in ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul")}
    assert kinds == {"aten::mm": "matmul", "aten::addmm": "matmul", "aten::bmm": "matmul", "aten::matmul": "other"}
    assert nanogpt.op_kind("aten::_scaled_dot_product_flash_attention_for_cpu") == "attention"
    assert nanogpt.op_kind("aten::add_") == "other" and list(nanogpt.OP_KINDS) == ["matmul", "attention"]


def test_the_record_names_no_path_of_the_machine(tmp_path):
    """Commands in a record name the work directory and the checkout by placeholders, never by this machine's paths
    (tests/test_benchmarks_report.py refuses a record that does)."""
    work, checkout = tmp_path / "work", tmp_path / "src" / "nanoGPT"
    cmd = f"{sys.executable} {nanogpt.ROOT}/benchmarks/nanogpt_step_profile.py {work}/p.jsonl {checkout}/train.py"
    args = type("A", (), {"nanogpt": str(checkout)})()
    out = nanogpt.without_machine_paths({"notes": [f"run 0: `{cmd}`"], "n": 1.5}, args, work)
    assert out == {
        "notes": ["run 0: `python benchmarks/nanogpt_step_profile.py <work>/p.jsonl <nanoGPT checkout>/train.py`"],
        "n": 1.5,
    }
