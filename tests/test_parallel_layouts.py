"""Multi-process tests of the trainer with real torchrun (gloo, CPU). Seven launches are shared by all tests
(each launch costs ~10 s of imports per process on the 2 CI cores):

- loss parity: 1 process vs 2-process FSDP vs 2-process TP (also with per-loop AC keeping its first loop, and
  with selective AC, as stages 2 and 4 ship it) vs 4-process 2x2 FSDP x TP (same seed, same global batch):
  the same loss and gradient norm at every one of 4 optimizer steps within LOSS_TOL and GRAD_NORM_RTOL (a few
  times the largest difference measured between layouts, docs/parallelism.md);
- multi-node launch simulated on one machine: two torchrun launchers with --nnodes 2 (c10d rendezvous on
  127.0.0.1), one process each, match the single-launcher 2-process loss;
- the collective counts of one step match docs/parallelism.md; per-loop AC under TP reruns the forward
  collectives of exactly the loops it recomputes, selective AC those of every loop;
- NaN handling: after the parity window, the 2-process FSDP run gets a NaN loss on its last rank at step 5
  (skipped on every rank, training continues); the multi-node run gets NaNs at steps 5 and 6 and must stop
  on every rank with max_nan_steps=2 (no hang, one-line error, nonzero exit);
- W&B offline: the 2-process FSDP run and the multi-node run (a "resumed job" in the same run dir) log
  offline with one stable run id; a fake WANDB_API_KEY appears nowhere in the run dir or the output.
"""

from __future__ import annotations

import pytest

from launch import SMALL_BATCH, free_port, multinode, start, train

STEPS = 4  # parity window
# fp32 everywhere; the layouts differ only in reduction order (FSDP reduce-scatter, TP partial sums,
# per-rank micro-batches vs gradient accumulation). Compared with 1 process at every step, the largest
# differences measured over steps 1-4 were loss 6e-6 (abs; 7e-7 with the seeded init) and grad norm 4.7e-6
# (relative): the tolerances are ~3x and ~10x those.
LOSS_TOL = 2e-5
KEPT = 1  # loops per-loop AC keeps in the AC layout
GRAD_NORM_RTOL = 5e-5
FAKE_KEY = "0123456789abcdef0123456789abcdef01234567"  # the shape of a real W&B key (40 hex chars)
ENV = {"WANDB_API_KEY": FAKE_KEY}
TINY = {
    **SMALL_BATCH,
    "training.steps": STEPS,
    "metrics.log_freq": 1,
    "lr_scheduler.warmup_steps": 1,
    "metrics.count_comms": True,
}

pytestmark = pytest.mark.slow


def metrics(rows: list[dict]) -> dict[int, dict]:
    """step -> {"loss", "grad_norm", "skipped_steps", "comms": {kind: count}} of rank 0's metrics.jsonl rows."""
    out = {}
    for rec in rows:
        comms = {k[5:]: v for k, v in rec.items() if k.startswith("comm/")}
        out[rec["step"]] = {
            "loss": rec["loss"],
            "grad_norm": rec["grad_norm"],
            "skipped_steps": rec["skipped_steps"],
            "comms": comms,
        }
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("layouts")
    layouts = {
        "1 proc": (1, {}),
        # + a NaN on the last rank at step 5 (after the parity window), W&B offline
        "2-proc FSDP": (2, {"training.steps": 6, "training.inject_nan_steps": [5], "metrics.wandb": "online"}),
        "2-proc TP": (2, {"parallelism.tp": 2}),
        "4-proc 2x2 FSDPxTP": (4, {"parallelism.tp": 2}),
        # per-loop AC keeping its first loop (stage1a keeps 3 of 8): backward recomputes the other loops
        "2-proc TP, AC loop 1 kept": (
            2,
            {"parallelism.tp": 2, "parallelism.activation_checkpoint": "loop", "parallelism.ac_kept_loops": KEPT},
        ),
        # selective AC (matmul and attention outputs saved), as stage 2 ships it
        "2-proc TP, AC selective": (2, {"parallelism.tp": 2, "parallelism.activation_checkpoint": "selective"}),
    }
    results = {"dirs": {}, "out": {}}
    for name, (nproc, extra) in layouts.items():
        run_dir = root / name.replace(" ", "_")
        run = train(run_dir, {**TINY, **extra}, nproc=nproc, env=ENV, timeout=300)
        results[name] = metrics(run.rows)
        results["dirs"][name], results["out"][name] = run_dir, run.out

    # Two launchers, --nnodes 2, one process each, in the 2-proc FSDP run dir (a resumed job for W&B).
    # Looped layers resharded after every use (same arithmetic, more all-gathers); NaN at steps 5 and 6.
    run_dir = results["dirs"]["2-proc FSDP"]
    port = free_port()
    overrides = {
        **TINY,
        "parallelism.reshard_looped": "always",
        "training.steps": 10,
        "training.inject_nan_steps": [5, 6],
        "training.max_nan_steps": 2,
        "metrics.wandb": "online",
    }
    nodes = [
        start(run_dir, overrides, nproc=1, env=ENV, rendezvous=multinode(2, node_rank, port)) for node_rank in range(2)
    ]
    results["multinode_rc"] = [node.finish(timeout=300) for node in nodes]
    results["multinode_out"] = [node.out for node in nodes]
    results["multinode"] = metrics(nodes[0].rows())

    table = ["| layout | loss step 1 | loss step 4 | collectives per step |", "|---|---|---|---|"]
    for name in [*layouts, "multinode"]:
        r = results[name]
        table.append(f"| {name} | {r[1]['loss']:.6f} | {r[STEPS]['loss']:.6f} | {r[STEPS]['comms']} |")
    print("\n".join(table))
    return results


def test_layouts_match_single_process_loss_and_grad_norm_every_step(runs):
    ref = runs["1 proc"]
    assert ref[STEPS]["loss"] != ref[1]["loss"]  # the optimizer steps changed the model
    spread = {"loss": 0.0, "grad_norm": 0.0}
    for name in (n for n in runs if n.startswith(("2-proc", "4-proc"))):  # every multi-process layout
        for step in range(1, STEPS + 1):
            got, want = runs[name][step], ref[step]
            spread["loss"] = max(spread["loss"], abs(got["loss"] - want["loss"]))
            spread["grad_norm"] = max(spread["grad_norm"], abs(got["grad_norm"] / want["grad_norm"] - 1))
            assert got["loss"] == pytest.approx(want["loss"], rel=0, abs=LOSS_TOL), (name, step, got, want)
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=GRAD_NORM_RTOL, abs=0), (name, step)
    print(
        f"largest difference from 1 process over steps 1-{STEPS}: loss {spread['loss']:.2e} (abs), "
        f"grad norm {spread['grad_norm']:.2e} (rel)"
    )


def test_two_launchers_multi_node_match_single_launcher(runs):
    ref = runs["2-proc FSDP"]
    for step in range(1, STEPS + 1):  # same layout and arithmetic as the single-launcher 2-process run
        assert runs["multinode"][step]["loss"] == pytest.approx(ref[step]["loss"], abs=1e-6)


def test_comm_counts_match_docs(runs):
    """docs/parallelism.md, one step of debug-tiny (L = 2 looped layers, T = 4), per rank:
    FSDP with reshard_looped='never' all-gathers and reduce-scatters each looped layer once, plus the root
    unit; 'always' all-gathers each looped layer 2T times (T forward + T backward). Two all-reduces: the
    packed loss/statistics and the gradient norm. Tensor parallel (sequence parallel) all-gathers and
    reduce-scatters follow from the plan; the all-reduce counts are only listed in the docs."""
    n_layers, n_loops = 2, 4
    never = runs["2-proc FSDP"][STEPS]["comms"]
    assert never == {"all_gather": 1 + n_layers, "reduce_scatter": 1 + n_layers, "all_reduce": 2}, never
    always = runs["multinode"][STEPS]["comms"]
    assert always == {"all_gather": 1 + 2 * n_loops * n_layers, "reduce_scatter": 1 + n_layers, "all_reduce": 2}
    # 1 process: FSDP on a 1-rank mesh issues no collectives and the gradient norm needs none.
    assert runs["1 proc"][STEPS]["comms"] == {"all_reduce": 1}
    tp = runs["2-proc TP"][STEPS]["comms"]
    micro_batches = 2  # dp = 1: the global batch of 4 is 2 micro-batches of 2
    # SP per layer call: 2 all-gathers + 2 reduce-scatters forward, the reduce-scatters' transposes in
    # backward; + embedding (1 reduce-scatter fwd, 1 all-gather bwd) + gathering T readouts, T states and
    # the gate logits for the objective.
    assert tp["all_gather"] == micro_batches * (2 * 2 * n_layers * n_loops + 1 + 2 * n_loops + 1), tp
    assert tp["reduce_scatter"] == micro_batches * (2 * n_layers * n_loops + 1), tp
    # per-loop AC reruns the forward of the T - KEPT loops it recomputes in backward, with their 2 all-gathers and
    # 2 reduce-scatters per layer call (measured: 108 and 58 against 84 and 34); the readouts are not recomputed
    kept = runs["2-proc TP, AC loop 1 kept"][STEPS]["comms"]
    rerun = micro_batches * 2 * n_layers * (n_loops - KEPT)
    assert kept == {**tp, "all_gather": tp["all_gather"] + rerun, "reduce_scatter": tp["reduce_scatter"] + rerun}, kept
    # selective AC saves the matmul and attention outputs and recomputes the rest, the SP collectives included: its
    # backward reruns every loop's 2 all-gathers and 2 reduce-scatters per layer call (measured: 116 and 66), and
    # no matmul, where per-loop AC keeping 1 loop reruns T - 1 loops' collectives and matmuls
    selective = runs["2-proc TP, AC selective"][STEPS]["comms"]
    rerun = micro_batches * 2 * n_layers * n_loops
    assert selective == {**tp, "all_gather": tp["all_gather"] + rerun, "reduce_scatter": tp["reduce_scatter"] + rerun}
    both = runs["4-proc 2x2 FSDPxTP"][STEPS]["comms"]  # TP counts for 1 micro-batch + the FSDP ones
    assert both["all_gather"] == tp["all_gather"] // 2 + 1 + n_layers, both
    assert both["reduce_scatter"] == tp["reduce_scatter"] // 2 + 1 + n_layers, both


def test_nan_on_one_rank_is_skipped_on_every_rank(runs):
    out = runs["out"]["2-proc FSDP"]
    assert "step     5 | non-finite loss (nan) on at least one rank: step skipped (1 in a row" in out
    logged = runs["2-proc FSDP"]
    assert 5 not in logged and logged[6]["skipped_steps"] == 1
    assert logged[6]["loss"] == logged[6]["loss"]  # finite again after the skip


def test_consecutive_nans_stop_every_rank(runs):
    assert all(rc != 0 for rc in runs["multinode_rc"]), runs["multinode_rc"]  # both launchers ended, no hang
    out = "".join(runs["multinode_out"])
    assert (
        "error: stopped at step 6 after 2 non-finite steps (loss or gradient norm) in a row (training.max_nan_steps=2)"
    ) in out
    assert "step     7" not in out and 7 not in runs["multinode"]


def test_wandb_offline_run_id_is_stable_and_no_secret_is_written(runs):
    run_dir = runs["dirs"]["2-proc FSDP"]
    run_id = (run_dir / "wandb_run_id").read_text().strip()
    offline = sorted((run_dir / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(offline) == 2, list((run_dir / "wandb").iterdir())  # first job + the resumed (multi-node) job
    assert all(list(d.glob("*.wandb")) for d in offline)
    # offline runs keep the config (the training config: no secret fields) inside the .wandb record file
    assert any(b"objective" in p.read_bytes() for p in offline[0].rglob("*") if p.is_file())
    for path in run_dir.rglob("*"):
        if path.is_file():
            assert FAKE_KEY.encode() not in path.read_bytes(), f"W&B key leaked into {path}"
    for out in [*runs["out"].values(), *runs["multinode_out"]]:
        assert FAKE_KEY not in out
