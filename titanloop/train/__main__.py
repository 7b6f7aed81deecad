"""`torchrun -m titanloop.train --config train_configs/<name>.toml [--section.key value ...]`; one process also
runs without torchrun: `python -m titanloop.train --config ...` (world size 1, no launcher to start first).

The config and the mesh are validated before any process group exists: bad input is a one-line
`error: ...` and exit status 2, as is a start-up error (a missing data path, shards of another tokenizer), printed
once by rank 0 (`--debug` or TITANLOOP_DEBUG=1: the traceback).
A run that stops because of too many non-finite losses in a row exits 3;
a preempted run exits 75 after saving (titanloop.checkpoint.preemption).
`--dry-run --world-size N [--memory-plan | --fit-ac]` starts the run at N ranks in one process on torchtitan's
fake backend and prints the plan instead of training (titanloop.train.dry_run).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from titanloop.cli import debug_enabled, error_line
from titanloop.config_errors import ConfigError
from titanloop.train.config import SECTIONS, load_config

USAGE = f"""\
torchrun --nproc_per_node=N -m titanloop.train --config train_configs/<name>.toml [--section.key value ...]

Train a looped LM (LoopLM) with torchtitan: FSDP2 over data-parallel ranks, optional tensor parallelism,
per-loop objectives and metrics. Every config field can be overridden on the command line, e.g.
  --training.steps 10 --parallelism.tp 2 --objective.beta 0.05 --metrics.wandb offline
Sections: {", ".join(SECTIONS)}. See docs/training.md for every field.
"""


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="python -m titanloop.train", usage=USAGE, add_help=True)
    parser.add_argument("--config", help="TOML training config (train_configs/*.toml)")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="start at --world-size ranks on torchtitan's fake "
        "backend (one process, meta tensors, no GPU), print the plan and exit "
        "(titanloop.train.dry_run)",
    )
    parser.add_argument("--world-size", type=int, help="ranks of the dry run (e.g. nodes x 8)")
    parser.add_argument(
        "--debug", action="store_true", help="a start-up error with its traceback, not one line (TITANLOOP_DEBUG=1 too)"
    )
    parser.add_argument("--memory-plan", action="store_true", help="dry run: also print the per-GPU memory plan")
    parser.add_argument(
        "--gpu-mem-gb",
        type=float,
        default=None,
        help="memory plan: GB per GPU (default: this machine's GPU, without one 80, an H100)",
    )
    parser.add_argument(
        "--fit-ac",
        action="store_true",
        help="dry run: plan several activation-checkpointing settings and name the least recomputation that fits",
    )
    parser.add_argument(
        "--fit-margin",
        type=float,
        default=0.0,
        help="--fit-ac: also keep this fraction of the planned peak free (e.g. 0.1; default 0)",
    )
    return parser.parse_known_args(argv)


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    config_path = args.config
    if args.dry_run or args.world_size is not None or args.memory_plan or args.fit_ac:
        if config_path is None or not args.dry_run or not args.world_size or args.world_size < 1:
            print(
                "error: a dry run needs --config C --dry-run --world-size N (N >= 1, e.g. nodes x 8)", file=sys.stderr
            )
            return 2
        from titanloop.train.dry_run import main as dry_run_main  # (CLI: a bad command line answers in ~0.1 s)

        return dry_run_main(
            config_path, overrides, args.world_size, args.memory_plan, args.gpu_mem_gb, args.fit_ac, args.fit_margin
        )
    try:
        if config_path is None:
            raise ConfigError("no config given: pass --config train_configs/<name>.toml (see --help)")
        cfg = load_config(config_path, overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    threads = cpu_threads_per_process()

    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)

    # (CLI: torch.distributed and the trainer load only after the config is read and valid)
    from titanloop.train.run_callbacks import default_callbacks
    from titanloop.train.loop import train
    from titanloop.train.startup import build_run, single_process_env, start_up_seconds

    def report(e: Exception) -> None:
        # Problems found while starting (data, previous-stage checkpoint, resume state vs config): one line on rank
        # 0, exit 2; the traceback with --debug or TITANLOOP_DEBUG=1.
        if debug_enabled(args.debug):
            raise e
        if (dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))) == 0:
            print(error_line(e), file=sys.stderr, flush=True)

    run, callbacks = None, []
    try:
        single_process_env()  # no launcher: one process (torchrun's variables for world size 1)
        before = start_up_seconds()  # interpreter, imports and config, and the launcher before this process
        run = build_run(cfg)
        started = time.perf_counter()
        callbacks = default_callbacks(run)
        run.startup = {**before, **run.startup, "callbacks": time.perf_counter() - started}
        print_summary(run)
        return train(run, callbacks)
    except ConfigError as e:
        report(e)
        return 2
    except Exception as e:
        if run is not None:  # started: an error while training is reported with its traceback
            raise
        report(e)
        return 2
    finally:
        for cb in callbacks:
            cb.close()
        if run is not None:
            run.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def cpu_threads_per_process() -> int:
    """CPU threads for this process's intra-op work: OMP_NUM_THREADS when set (torchrun sets 1 for several
    processes per node), else this machine's cores shared among the node's processes (LOCAL_WORLD_SIZE), so one
    process uses every core and N processes do not oversubscribe them. Exported as OMP_NUM_THREADS, which the
    data loader's and compile's workers inherit."""
    if os.environ.get("OMP_NUM_THREADS", "").isdigit() and int(os.environ["OMP_NUM_THREADS"]) >= 1:
        return int(os.environ["OMP_NUM_THREADS"])
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    os.environ["OMP_NUM_THREADS"] = str(threads)
    return threads


def print_summary(run) -> None:
    cfg, mesh, t = run.cfg, run.mesh, run.cfg.training
    p = cfg.parallelism
    from torch.distributed.fsdp import FSDPModule

    if p.engine == "fsdp2":  # one fp32 rank trains the plain module (titanloop.parallel.parallelize.needs_fsdp)
        engine = "fsdp2" if isinstance(run.engine.model, FSDPModule) else "one rank, no FSDP2"
    else:
        engine = f"deepspeed ZeRO-{p.zero_stage} offload {p.zero_offload}"
    if mesh.rank == 0:
        family = cfg.family
        what = family.describe()
        print(
            f"[titanloop] {what}: {run.n_params:,} parameters | world {mesh.world_size} "
            f"= dp {mesh.dp_world} x tp {mesh.dims.tp} ({engine}) | {run.param_dtype} params on {mesh.device_type} | "
            f"global batch {t.global_batch_size} x {t.seq_len} tokens, grad accum "
            f"{run.dataloader.grad_accum_at(0)} | objective {cfg.objective.name} | loops "
            f"{cfg.loop_sampler.kind}"
            + (f", backprop through the last {k}" if (k := cfg.loop_sampler.backprop_loops) else ""),
            flush=True,
        )
        for line in family.extra_summary(run):
            print(f"[titanloop] {line}", flush=True)
        print(f"[titanloop] {speed_settings(run)}", flush=True)


def speed_settings(run) -> str:
    """One line with what decides the speed: precision (float8: what was converted and how weights are
    all-gathered), activation checkpointing, sequences per step and the optimizer's implementation; and the
    peak its MFU is quoted against (titanloop.train.mfu)."""
    # (CLI: these load with the trainer, after the config check)
    import torch

    from titanloop.parallel.activation_checkpoint import describe as describe_ac  # (as torch)
    from titanloop.parallel.float8 import float8_summary
    from titanloop.train.mfu import device_name, peak_flops, peak_text

    cfg, mesh, t = run.cfg, run.mesh, run.cfg.training
    ac = describe_ac(cfg.parallelism.activation_checkpoint, cfg.parallelism.ac_kept_loops)
    f8 = cfg.float8.recipe
    precision = float8_summary(run.engine.model, f8) if f8 != "off" else "float8 off (bf16 matmuls)"
    if mesh.device_type != "cuda" and f8 != "off":
        precision += ", emulated on CPU"
    implementation = cfg.optimizer.resolved_implementation(mesh.device_type, mesh.dims.tp)
    name = device_name(mesh.device_type)
    if cfg.parallelism.engine == "deepspeed":
        implementation = "foreach (DeepSpeed)"
    return (
        f"speed: {run.param_dtype} params, {precision} | activation checkpointing "
        f"{ac} | {t.micro_batch_size} sequence(s) of {t.seq_len} per rank per "
        f"micro-batch, {run.dataloader.grad_accum_at(0)} micro-batch(es) per step | compile {cfg.parallelism.compile} "
        f"| optimizer {cfg.optimizer.name} {implementation}"
        + (f" | {torch.get_num_threads()} CPU thread(s)" if mesh.device_type == "cpu" else "")
        + f" | {peak_text(name, peak_flops(name))}"
    )


if __name__ == "__main__":
    from titanloop.train.process_exit import exit_without_teardown

    # Everything is saved, flushed and closed by now (callbacks, checkpointer, data loader, process group).
    exit_without_teardown(main())
