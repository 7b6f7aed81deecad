"""Float8 training (`float8.recipe`, titanloop.parallel.float8) through the real trainer on 2 CPU ranks (gloo,
torchao's emulation: the float8 casts and scales of the recipe, the matmul in high precision), both recipes.

- loss: 50 steps of train_configs/debug.toml (lr 3e-3) in float8 vs the same run in fp32 (what
  `training.dtype = "auto"` gives on CPU): the first 5 steps within STEP_TOL, the mean loss of steps 41-50 within
  WINDOW_TOL (measured spreads and the reasons below), not bitwise equal (float8 is really on), and float8 trained.
- weight casts (metrics.count_comms logs comm/float8_weight_cast): tensorwise with the looped stack gathered once
  (`reshard_looped = "never"`, the default) casts each weight once per step; rowwise, or tensorwise with
  `reshard_looped = "always"`, 2T times (forward and backward of each of the T loops).
- kill + resume: SIGKILL of every process mid-run, resumed from the last periodic checkpoint: final weights,
  optimizer state, JSON states and every logged step bitwise equal to an uninterrupted run (the resumed run's first
  all-gathers compute their float8 scales in the all-gather, the uninterrupted run's come from
  precompute_float8_dynamic_scale_for_fsdp: equal bits).
- checkpoints are interchangeable: a float8 run's checkpoint has the entries, dtypes and shapes of an fp32 run's;
  a float8 checkpoint resumes without float8 and the reverse.
What this does not prove: speed or the hardware float8 matmul (CPU emulation), NCCL (gloo here; FSDP2 all-gathers
the float8 weights together with the layer's norm weights as bytes on both), torch.compile (the cast count is
counted in eager mode), a GPU's bf16 parameters (fp32 here).
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
import torch

from titanloop.checkpoint import layout
from titanloop.checkpoint.safe_reader import read_dcp_entries
from titanloop.config_errors import ConfigError
from titanloop.train.config import load_config

from helpers import assert_bitwise_same_run, final_state, history
from launch import DEBUG, REPO, start, train

SEED = 7  # the kill step
LOSS_SEED = 2  # the loss comparison's seed: not one of the seeds the tolerances were measured on (0 and 1)
RECIPES = ("tensorwise", "rowwise")
N_LAYERS, LINEARS_PER_LAYER = 2, 7  # debug-tiny's looped stack: q, k, v, o, gate, up, down per layer
# debug.toml at lr 3e-3 (at its own 1e-2 the runs are chaotic: float8 and fp32 runs drift apart by up to 0.27 in a
# single step's loss within 50 steps, as much as training moves the loss). Measured on seeds 0 and 1, float8 vs
# fp32: the first 5 steps (nearly the same weights) differ by at most STEP_MEASURED; after that the trajectories
# drift apart (a step's loss differs by up to 0.19), so the 50-step loss is the mean over steps 41-50, which differs
# by at most WINDOW_MEASURED. The tolerances are ~3x those; training moves the windowed loss by ~0.3 in 50 steps.
STEP_MEASURED, WINDOW_MEASURED = 0.0068, 0.0244
STEP_TOL, WINDOW_TOL = 0.02, 0.075


def test_float8_is_refused_where_it_is_not_built():
    for overrides, world, needle in [
        (["--parallelism.tp", "2"], 2, "parallelism.tp=2"),
        (["--parallelism.engine", "deepspeed"], 1, "parallelism.engine='deepspeed'"),
        (["--retrofit.hf_path", "/nonexistent/model"], 1, "retrofit run"),
    ]:
        with pytest.raises(ConfigError) as e:
            load_config(DEBUG, ["--float8.recipe", "tensorwise", *overrides], world_size=world)
        msg = str(e.value)
        assert msg.startswith("float8.recipe='tensorwise' is invalid") and needle in msg and "\n" not in msg, msg
    with pytest.raises(ConfigError, match="float8.recipe='fp8' is invalid"):
        load_config(DEBUG, ["--float8.recipe", "fp8"], world_size=1)
    from titanloop.model import LoopLM
    from titanloop.model.config import preset
    from titanloop.parallel.float8 import apply_float8

    with torch.device("meta"):
        model = LoopLM(preset("debug-tiny"))
    with pytest.raises(ConfigError, match="parallelism.compile=true without a GPU"):  # emulation: eager only
        apply_float8(model, "rowwise", emulate=True, compile=True)


@pytest.mark.parametrize("recipe", RECIPES)
def test_only_the_decoder_layers_linears_become_float8(recipe):
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    from titanloop.model import LoopLM
    from titanloop.model.config import preset
    from titanloop.parallel.float8 import apply_float8

    cfg = preset("debug-tiny", n_prelude_layers=1, n_coda_layers=1, gated_recurrence=True)
    torch.manual_seed(0)
    model = LoopLM(cfg)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert apply_float8(model, recipe, emulate=True) == 7 * 4
    converted = {n for n, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert all(n.startswith(("prelude.", "layers.", "coda.")) for n in converted)
    assert not any(isinstance(m, Float8Linear) for m in (model.lm_head, model.early_exit_gate, model.recurrence_gate))
    after = model.state_dict()  # the same names, dtypes and values: checkpoints do not see float8
    assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())
    wrapped = isinstance(model.layers[0].mlp.up_proj.weight, WeightWithDynamicFloat8CastTensor)
    assert wrapped == (recipe == "tensorwise")  # the FSDP2 float8 all-gather: tensorwise only
    out = model(torch.randint(0, cfg.vocab_size, (2, 16)), 2)
    sum(r.square().mean() for r in out.readouts).backward()
    assert model.layers[0].self_attn.q_proj.weight.grad is not None


def test_dry_run_converts_the_model_at_real_size():
    from titanloop.train.dry_run import dry_run

    cfg = load_config(REPO / "train_configs" / "ouro_1p4b.toml", ["--float8.recipe", "tensorwise"], world_size=64)
    text = dry_run(cfg, 64).text()
    layers = cfg.looplm.n_layers
    assert f"float8 tensorwise: {7 * layers} of {7 * layers + 2} linears converted" in text, text
    assert "float8 all-gather" in text, text


@pytest.mark.slow
def test_memory_plan_gathers_the_looped_weights_in_float8():
    """The plan (fake tensors, as on GPUs) holds the gathered looped stack in float8 with tensorwise: one byte less
    per looped linear weight than bf16 (measured: 1,605,576 of 1,605,632 bytes less)."""
    from titanloop.train.dry_run import dry_run

    overrides = ["--model.hidden_size", "256", "--model.ffn_hidden_size", "704"]
    gathered = {}
    for recipe in ("off", "tensorwise"):
        cfg = load_config(DEBUG, [*overrides, "--float8.recipe", recipe], world_size=2)
        gathered[recipe] = dry_run(cfg, 2, memory_plan=True).memory_plan.rows["parameters (gathered)"]
    looped = N_LAYERS * (4 * 256 * 256 + 3 * 256 * 704)  # q, k, v, o + gate, up, down weights
    saved = gathered["off"] - gathered["tensorwise"]
    assert abs(saved - looped) < 0.01 * looped, (gathered, looped)


# ----- through torchrun -m titanloop.train on 2 ranks --------------------------------------------------------------

STEPS = 16  # the kill-and-resume runs: checkpoints every 3 steps, the last two kept
RESUMABLE = {
    "training.steps": STEPS,
    "metrics.log_freq": 1,
    "checkpoint.enable": True,
    "checkpoint.interval": 3,
    "checkpoint.keep_latest_k": 2,
    "checkpoint.mode": "sync",
}


def _f8(recipe: str) -> dict:
    return {"float8.recipe": recipe}


def _train(run_dir: Path, overrides: dict | None = None) -> Path:
    return train(run_dir, {**RESUMABLE, **(overrides or {})}).run_dir


@pytest.fixture(scope="module")
def loss_runs(tmp_path_factory):
    """50 steps at SEED, fp32 and both recipes, with the per-step counts; and 3 steps of tensorwise resharding the
    looped stack after every use."""
    root = tmp_path_factory.mktemp("float8_loss")
    common = {
        "training.steps": 50,
        "training.seed": LOSS_SEED,
        "optimizer.lr": 3e-3,
        "checkpoint.enable": False,
        "metrics.count_comms": True,
    }
    runs = {r: _train(root / r, {**common, **_f8(r)}) for r in ("off", *RECIPES)}
    runs["always"] = _train(
        root / "always",
        {**common, "training.steps": 3, **_f8("tensorwise"), "parallelism.reshard_looped": "always"},
    )
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
def test_float8_loss_follows_fp32_within_the_stated_tolerance(loss_runs, recipe):
    ref = {s: recs[0]["loss"] for s, recs in history(loss_runs["off"]).items()}
    got = {s: recs[0]["loss"] for s, recs in history(loss_runs[recipe]).items()}
    assert sorted(got) == sorted(ref) == list(range(1, 51))
    early = max(abs(got[s] - ref[s]) for s in range(1, 6))
    window = {name: sum(losses[s] for s in range(41, 51)) / 10 for name, losses in (("f8", got), ("fp32", ref))}
    first = sum(got[s] for s in range(1, 11)) / 10
    print(
        f"{recipe} (seed {LOSS_SEED}): steps 1-5 max |loss - fp32 loss| {early:.4f} (tolerance {STEP_TOL}); "
        f"mean loss of steps 41-50 {window['f8']:.4f} vs fp32 {window['fp32']:.4f}: "
        f"{abs(window['f8'] - window['fp32']):.4f} (tolerance {WINDOW_TOL}); float8 steps 1-10 {first:.4f}"
    )
    assert early < STEP_TOL
    assert abs(window["f8"] - window["fp32"]) < WINDOW_TOL
    assert any(got[s] != ref[s] for s in ref)  # float8 changed the numerics: the conversion is on
    assert first - window["f8"] > WINDOW_TOL  # float8 trained, by more than the tolerance


@pytest.mark.slow
def test_weights_are_cast_once_per_step_when_the_looped_stack_is_gathered_once(loss_runs):
    weights = N_LAYERS * LINEARS_PER_LAYER
    for name, reshards in [("tensorwise", False), ("rowwise", False), ("always", True)]:
        for step, (rec, *_) in history(loss_runs[name]).items():
            t = rec["n_loops"]
            once = name == "tensorwise"  # float8 all-gather and the stack gathered once per step
            assert rec["comm/float8_weight_cast"] == (weights if once else 2 * t * weights), (name, step, rec)
            # one all-gather per layer per step (+ the root) unless the looped stack reshards after every use
            assert rec["comm/all_gather"] == 1 + N_LAYERS * (2 * t if reshards else 1), (name, step, rec)
    print(
        f"float8 weight casts per step at T=4: {weights} for {weights} weights (tensorwise, gathered once) vs "
        f"{8 * weights} (rowwise; tensorwise with reshard_looped='always')"
    )


@pytest.fixture(scope="module")
def resume_runs(tmp_path_factory):
    """16 steps (checkpoints every 3), per recipe: uninterrupted, and SIGKILLed + resumed; an fp32 run for the
    interchange checks."""
    root = tmp_path_factory.mktemp("float8_resume")
    rng = random.Random(SEED)
    out = {"off": _train(root / "off")}
    for recipe in RECIPES:
        out[f"ref_{recipe}"] = _train(root / f"ref_{recipe}", _f8(recipe))
        job = start(root / f"killed_{recipe}", {**RESUMABLE, **_f8(recipe)})
        kill_at = rng.randint(4, 11)
        job.wait_for_step(kill_at)
        job.kill()
        out[f"killed_at_{recipe}"] = kill_at
        out[f"killed_{recipe}"] = _train(root / f"killed_{recipe}", _f8(recipe))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
def test_float8_kill_and_resume_is_bitwise(resume_runs, recipe):
    assert_bitwise_same_run(resume_runs[f"killed_{recipe}"], resume_runs[f"ref_{recipe}"], STEPS)
    print(f"{recipe}: killed at step >= {resume_runs[f'killed_at_{recipe}']}, resumed, bitwise equal")


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
def test_float8_checkpoints_have_the_fp32_layout(resume_runs, recipe):
    got, ref = final_state(resume_runs[f"ref_{recipe}"], STEPS)[0], final_state(resume_runs["off"], STEPS)[0]
    ckpt = resume_runs[f"ref_{recipe}"] / "checkpoints" / layout.step_dir_name(STEPS)
    # plain tensors: no torchao class pickled (a run without torchao imported could not unpickle one)
    assert not any(b"torchao" in p.read_bytes() for p in ckpt.glob("*.distcp"))
    assert got.keys() == ref.keys()
    assert {k: (v.dtype, v.shape) for k, v in got.items() if torch.is_tensor(v)} == {
        k: (v.dtype, v.shape) for k, v in ref.items() if torch.is_tensor(v)
    }


@pytest.mark.slow
@pytest.mark.parametrize("saved, resumed", [("tensorwise", "off"), ("off", "rowwise")])
def test_checkpoints_resume_across_float8_and_fp32(resume_runs, tmp_path, saved, resumed):
    """The step-15 checkpoint of one run resumed with the other setting: the resumed step 16 equals the saving run's
    own step 16 within STEP_TOL (the same weights, batch and optimizer state; only the matmuls' precision differs).
    This shows the checkpoint loads and training goes on from it; the weights are not compared bit for bit (a float8
    and an fp32 step give different bits)."""
    source = resume_runs["off" if saved == "off" else f"ref_{saved}"]
    run_dir = tmp_path / "run"
    shutil.copytree(source, run_dir)
    shutil.rmtree(run_dir / "checkpoints" / layout.step_dir_name(STEPS))  # resume from step STEPS - 1
    _train(run_dir, _f8(resumed))
    records = history(run_dir)
    # resumed from step STEPS - 1: the launch logged step STEPS only (after the saving run's own records)
    assert [len(records[s]) for s in range(1, STEPS + 1)] == [1] * (STEPS - 1) + [2]
    theirs, ours = records[STEPS][0]["loss"], records[STEPS][1]["loss"]
    print(f"{saved} -> {resumed}: step {STEPS} loss {ours:.4f} vs {theirs:.4f} (step 1: {records[1][0]['loss']:.4f})")
    assert abs(ours - theirs) < STEP_TOL  # one step on the same weights and batch, float8 vs fp32
    entries = read_dcp_entries(run_dir / "checkpoints" / layout.step_dir_name(STEPS))
    assert any(k.startswith("model/") for k in entries)
