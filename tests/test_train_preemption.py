"""Preemption and resume through the real trainer (`torchrun -m titanloop.train`, debug config, gloo), no Slurm.

Launches (seeded: the interruption points are drawn from random.Random(SEED), printed, and reproducible):
- dp 2 (with STARS' JSRR term, whose random probes must come back identical): one uninterrupted reference
  run; the same run interrupted three times and resumed each time:
  SIGUSR1 to ONE rank (every rank must agree to stop and save), SIGTERM to torchrun (forwarded to the ranks),
  SIGKILL of every process while a checkpoint is being written (the resume falls back to the previous one and
  deletes the partial save), then a last launch to the end. Final weights, optimizer state, RNG and the JSON
  states (LR schedule, data position, counters) must be bitwise identical to the reference, and every logged
  step's loss, grad norm and per-loop statistics equal to the reference's (steps re-run after the SIGKILL
  included).
- dp 2 with asynchronous saves (`checkpoint.mode = "async"`, the default on CUDA): its interval saves hold bit for
  bit what the synchronous reference saved.
- dp 1 x tp 2: reference + a run stopped by SIGUSR1 and resumed: bitwise identical as above.
- dp 2 -> 1: the dp-2 run's SIGUSR1 checkpoint resumed on ONE process (which trains the plain module, no
  FSDP2): the same data position at the end; the first RESHARD_TIGHT_STEPS steps after the resume within
  RESHARD_LOSS_TOL (grad norm RESHARD_GRAD_RTOL) of the 2-rank reference (the same weights and samples, summed
  in another order; a different sample order changes the loss by ~1e-3 or more, see
  test_other_samples_change_the_loss_far_beyond_the_tolerance); every later step's loss nearer the reference's
  loss at that step than at the steps beside it (the same samples, after the last-bit differences have grown).
- W&B: every launch has a (fake) WANDB_API_KEY in its environment; the 2 -> 1 launch runs with
  `metrics.wandb = "online"` against a closed port on 127.0.0.1 (WANDB_BASE_URL): W&B's init fails, the run
  logs offline instead and trains to the end; the key appears in no file of any run dir (checkpoints included)
  and in no output.
- the real trainer refuses a crafted checkpoint whose `.metadata` unpickling would run code (one line, exit 2).
Signals are sent while every process of the launch is SIGSTOPped, so where they land does not depend on the
machine's speed; the SIGKILL check that a save is in progress happens while the processes are stopped.
"""

from __future__ import annotations

import pickle
import random
import shutil
import signal
import time
from pathlib import Path

import pytest

from titanloop.checkpoint import layout
from titanloop.checkpoint.safe_reader import read_dcp_metadata

from helpers import assert_bitwise_same_run, assert_same_checkpoint, final_state, history
from launch import Launch, free_port, start

pytestmark = pytest.mark.slow
SEED = 16
STEPS = 16
# 2 -> 1 ranks: the same samples, summed in another order. FSDP2's hooks order the backward's sums differently
# from the plain module one process trains, so the weights differ in their last bits after the first step after
# the resume, and Adam amplifies that about 3x per step (measured from step 1, 1 plain process against 2 FSDP2
# ranks, with JSRR: grad norm 1e-7 relative at step 2, 1e-3 at step 11, 1.7e-2 at step 15; loss 2.7e-4 at step
# 16). Consecutive steps' losses differ by >= 8.4e-4.
RESHARD_LOSS_TOL = 5e-5
RESHARD_GRAD_RTOL = 1e-3
RESHARD_TIGHT_STEPS = 3
ARGS = {
    "training.steps": STEPS,
    "metrics.log_freq": 1,
    "metrics.wandb": "off",
    "checkpoint.enable": True,
    "checkpoint.interval": 3,
    "checkpoint.keep_latest_k": 2,
    "checkpoint.mode": "sync",
}
# dp runs add STARS' Jacobian regularizer (its random probes must come back identical on resume at any world size;
# tensor parallelism does not support it)
JSRR = {"objective.jsrr_weight": 0.1}
FAKE_KEY = "0123456789abcdef0123456789abcdef01234567"  # the shape of a real W&B key (40 hex chars)
# every launch has the key in its environment, and no WANDB_MODE (one launch runs W&B online)
ENV = {"WANDB_MODE": None, "WANDB_API_KEY": FAKE_KEY}


def launch(run_dir: Path, nproc: int, overrides: dict | None = None, env: dict | None = None) -> Launch:
    """One `torchrun -m titanloop.train` in the background, output to <run_dir>.<ns>.log beside the run dir."""
    log = run_dir.parent / f"{run_dir.name}.{time.monotonic_ns()}.log"
    return start(run_dir, {**ARGS, **(overrides or {})}, nproc=nproc, log=log, env={**ENV, **(env or {})})


def run(run_dir: Path, nproc: int, overrides: dict | None = None, env: dict | None = None) -> Launch:
    job = launch(run_dir, nproc, overrides, env)
    code = job.finish()
    assert code == 0, job.out[-3000:]
    return job


def ckpt_root(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def stop_with(job: Launch, sig: int, at_step: int, pid: int | None = None) -> int:
    """Signal the launch once step `at_step` is logged; it must save, publish and exit non-zero (75 from the
    ranks, 1 from torchrun). Returns the step it stopped at."""
    job.wait_for_step(at_step)
    job.interrupt(sig, pid)
    code = job.finish()
    out = job.out
    assert code != 0 and "preempted at step" in out, out[-3000:]
    stopped = int(out.split("preempted at step ")[1].split()[0])
    assert stopped >= at_step and layout.latest_step(ckpt_root(job.run_dir)) == stopped, out[-3000:]
    return stopped


def kill_during_save(job: Launch, timeout: float = 240) -> int:
    """SIGKILL every process of the launch while a checkpoint save is in progress; returns that save's step."""
    root, deadline = ckpt_root(job.run_dir), time.time() + timeout
    while time.time() < deadline and job.proc.poll() is None:
        if any(p.name.startswith(layout.STAGING_PREFIX) for p in root.iterdir()):
            job.group(signal.SIGSTOP)  # frozen: is the save still unpublished?
            staging = [p for p in root.iterdir() if p.name.startswith(layout.STAGING_PREFIX)]
            if staging:
                job.kill()
                return int(staging[0].name.rsplit("-", 1)[1])
            job.group(signal.SIGCONT)  # it was published in between: wait for the next save
        time.sleep(0.001)
    raise AssertionError(f"no checkpoint save caught in progress:\n{job.out[-3000:]}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("preempt")
    rng = random.Random(SEED)
    plan = {
        "usr1_step": rng.randint(2, 4),
        "usr1_rank": rng.randint(0, 1),
        "term_after": rng.randint(1, 3),
        "tp_usr1_step": rng.randint(2, 8),
        "tp_usr1_rank": rng.randint(0, 1),
    }
    print(f"interruption plan (seed {SEED}): {plan}")
    r = {"root": root, "plan": plan, "stops": {}}
    t0 = time.time()

    r["ref_dp2"] = run(root / "ref_dp2", 2, JSRR).run_dir
    r["async_dp2"] = run(root / "async_dp2", 2, {**JSRR, "checkpoint.mode": "async"}).run_dir
    chain = r["dp2"] = root / "dp2"
    first = launch(chain, 2, JSRR)
    first.wait_for_step(1)
    r["stops"]["usr1"] = stop_with(first, signal.SIGUSR1, plan["usr1_step"], first.rank_pid(plan["usr1_rank"]))
    shutil.copytree(chain, root / "dp2_to_1")  # resumed on one process below
    r["stops"]["term"] = stop_with(launch(chain, 2, JSRR), signal.SIGTERM, r["stops"]["usr1"] + plan["term_after"])
    r["killed_save"] = kill_during_save(launch(chain, 2, JSRR))
    r["staging_left"] = sorted(p.name for p in ckpt_root(chain).iterdir() if p.name.startswith(layout.STAGING_PREFIX))
    r["fallback"] = layout.latest_step(ckpt_root(chain))
    r["last"] = run(chain, 2, JSRR)

    tp = {"parallelism.tp": 2}
    r["ref_tp2"] = run(root / "ref_tp2", 2, tp).run_dir
    r["tp2"] = root / "tp2"
    first = launch(r["tp2"], 2, tp)
    first.wait_for_step(1)
    r["stops"]["tp_usr1"] = stop_with(first, signal.SIGUSR1, plan["tp_usr1_step"], first.rank_pid(plan["tp_usr1_rank"]))
    run(r["tp2"], 2, tp)

    # W&B online, but unreachable: a closed port on the loopback interface (never any other address)
    unreachable = {"WANDB_BASE_URL": f"http://127.0.0.1:{free_port()}", "WANDB_INIT_TIMEOUT": "10"}
    last = run(root / "dp2_to_1", 1, {**JSRR, "metrics.wandb": "online"}, env=unreachable)
    r["dp2_to_1"], r["wandb_out"] = last.run_dir, last.out
    r["outputs"] = [p.read_text() for p in root.glob("*.log")]
    print(
        f"launches took {time.time() - t0:.0f} s; stops {r['stops']}, SIGKILL during the save of step "
        f"{r['killed_save']} (fell back to {r['fallback']})"
    )
    return r


def test_dp2_interrupted_by_usr1_term_and_kill_matches_uninterrupted_run_bitwise(runs):
    stops = runs["stops"]
    assert stops["usr1"] < stops["term"]
    # the SIGKILL landed during a save: its staging folder was left behind, the resume fell back to the
    # previous checkpoint, and the next start deleted the partial save
    assert runs["staging_left"] == [f"{layout.STAGING_PREFIX}{layout.step_dir_name(runs['killed_save'])}"]
    assert runs["fallback"] < runs["killed_save"]
    assert not any(p.name.startswith(layout.STAGING_PREFIX) for p in ckpt_root(runs["dp2"]).iterdir())
    assert_bitwise_same_run(runs["dp2"], runs["ref_dp2"], STEPS)


def test_async_saves_of_the_sharded_run_equal_its_sync_saves(runs):
    """checkpoint.mode = "async" (the default on CUDA) with FSDP2's DTensors, as the H100 preemption row runs it (its
    first try died in torch 2.11's DCP stager): the interval save of step STEPS - 1, written by the async path, holds
    bit for bit what the sync reference saved there, and the run ends as the reference does."""
    step = STEPS - 1
    assert step % ARGS["checkpoint.interval"] == 0
    assert_same_checkpoint(runs["async_dp2"], runs["ref_dp2"], step)
    assert_bitwise_same_run(runs["async_dp2"], runs["ref_dp2"], STEPS)


def saved_chunk_offsets(run_dir: Path, key: str) -> list[tuple[int, ...]]:
    """The offsets of the pieces each rank wrote of DCP entry `key` in the run's final checkpoint."""
    md = read_dcp_metadata(ckpt_root(run_dir) / layout.step_dir_name(STEPS) / ".metadata")
    return sorted(tuple(c.offsets) for c in md.state_dict_metadata[key].chunks)


def test_tp2_interrupted_and_resumed_matches_uninterrupted_run_bitwise(runs):
    # the run really was tensor parallel: each rank saved half of q_proj's rows (column-parallel) and half of
    # o_proj's columns (row-parallel); FSDP at dp 2 shards every weight by rows only
    hidden = final_state(runs["tp2"], STEPS)[0]["model/layers.0.self_attn.o_proj.weight"].shape[1]
    for run in ("tp2", "ref_tp2"):
        assert saved_chunk_offsets(runs[run], "model/layers.0.self_attn.q_proj.weight") == [(0, 0), (hidden // 2, 0)]
        assert saved_chunk_offsets(runs[run], "model/layers.0.self_attn.o_proj.weight") == [(0, 0), (0, hidden // 2)]
    assert saved_chunk_offsets(runs["dp2"], "model/layers.0.self_attn.o_proj.weight") == [(0, 0), (hidden // 2, 0)]
    assert_bitwise_same_run(runs["tp2"], runs["ref_tp2"], STEPS)


def test_resume_2_to_1_ranks_keeps_the_sample_order(runs):
    resumed, ref = runs["dp2_to_1"], runs["ref_dp2"]
    start = runs["stops"]["usr1"]
    got, want = history(resumed), history(ref)
    for step in range(1, start + 1):  # logged by the 2-rank launch before the stop
        assert got[step] == want[step]
    for step in range(start + 1, start + 1 + RESHARD_TIGHT_STEPS):  # one process, 2 micro-batches per step
        assert got[step][0]["loss"] == pytest.approx(want[step][0]["loss"], rel=0, abs=RESHARD_LOSS_TOL), step
        assert got[step][0]["grad_norm"] == pytest.approx(want[step][0]["grad_norm"], rel=RESHARD_GRAD_RTOL, abs=0), (
            step
        )
    ref_losses = {s: recs[0]["loss"] for s, recs in want.items()}
    for step in range(start + 1, STEPS + 1):  # nearer its own step's samples than the neighbours' other samples
        off = {s: abs(ref_losses[s] - got[step][0]["loss"]) for s in (step - 1, step, step + 1) if s in ref_losses}
        assert min(off, key=off.get) == step, (step, off)
    _, states = final_state(resumed, STEPS)
    _, ref_states = final_state(ref, STEPS)
    assert states["dataloader"] == ref_states["dataloader"]  # the same global data position at the end
    assert states["train_state"] == ref_states["train_state"]


def test_other_samples_change_the_loss_far_beyond_the_tolerance(runs):
    """RESHARD_LOSS_TOL can tell sample orders apart: consecutive steps (other batches, nearly the same weights)
    differ by far more than it."""
    losses = [recs[0]["loss"] for _, recs in sorted(history(runs["ref_dp2"]).items())]
    assert min(abs(a - b) for a, b in zip(losses, losses[1:])) > 10 * RESHARD_LOSS_TOL, losses


def test_unreachable_wandb_neither_blocks_nor_stops_training(runs):
    out = runs["wandb_out"]
    assert "W&B online init failed" in out and "logging offline instead" in out, out[-3000:]
    assert max(history(runs["dp2_to_1"])) == STEPS  # trained to the end (the launch exited 0)
    run_id = (runs["dp2_to_1"] / "wandb_run_id").read_text().strip()
    assert list((runs["dp2_to_1"] / "wandb").glob(f"offline-run-*-{run_id}/*.wandb"))  # kept for `wandb sync`


def test_no_wandb_key_in_run_dirs_checkpoints_or_logs(runs):
    files = [p for p in runs["root"].rglob("*") if p.is_file()]
    assert any("checkpoints" in p.parts for p in files) and any("wandb" in p.parts for p in files)
    leaked = [str(p) for p in files if FAKE_KEY.encode() in p.read_bytes()]
    assert not leaked, f"W&B key written to {leaked[:5]}"
    assert all(FAKE_KEY not in out for out in runs["outputs"])


def test_trainer_refuses_a_checkpoint_whose_metadata_would_run_code(runs, tmp_path, hostile):
    run_dir, marker = tmp_path / "run", tmp_path / "pwned"
    shutil.copytree(runs["ref_dp2"], run_dir)
    ckpt = ckpt_root(run_dir) / layout.step_dir_name(STEPS)
    (ckpt / ".metadata").write_bytes(pickle.dumps(hostile.payload(marker)))
    hostile.refresh_manifest(ckpt)
    job = launch(run_dir, 1)
    assert job.finish() != 0
    errors = [line for line in job.out.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "refusing to load posix.system" in errors[0], job.out[-3000:]
    assert not marker.exists()
