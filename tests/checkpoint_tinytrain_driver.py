"""A small real training run that the checkpoint tests drive with torchrun and signals (no tests here).

    torchrun --nproc_per_node 2 tests/checkpoint_tinytrain_driver.py --run-dir RUN --steps 16 --interval 4

LoopLM (debug-tiny) + AdamW + warmup/cosine LambdaLR + titanloop.data synthetic_text loader, data parallel over gloo,
deterministic CPU kernels. Auto-resumes from RUN; on SIGUSR1/SIGTERM saves and exits with code 75; at the end
writes RUN/final.pt (model + optimizer state dicts + loss history) for the tests to compare bitwise.
Progress: RUN/progress holds the last finished step; stdout has one line per step.
"""

from __future__ import annotations

import argparse
import logging
import math
import random
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from titanloop.checkpoint import EXIT_CODE_PREEMPTED, CheckpointConfig, Checkpointer, PreemptionMonitor
from titanloop.data import DataConfig, build_dataloader
from titanloop.model import build_looplm, preset
from titanloop.objectives import LoopSampler, LoopSamplerConfig
from titanloop.train.process_exit import exit_without_teardown


class TrainState:
    def __init__(self):
        self.step, self.tokens, self.losses = 0, 0, []

    def state_dict(self) -> dict:
        return {"step": self.step, "tokens": self.tokens, "losses": list(self.losses)}

    def load_state_dict(self, d: dict) -> None:
        self.step, self.tokens, self.losses = d["step"], d["tokens"], list(d["losses"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--config", help="recorded in the checkpoint's config (slurm/common.sh always passes one)")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--interval", type=int, default=4)
    ap.add_argument("--keep-last", type=int, default=2)
    ap.add_argument("--keep-every", type=int, default=0)
    ap.add_argument("--mode", default="sync", choices=["sync", "async"])
    ap.add_argument("--hidden", type=int, default=64, help="model width (a wider model makes saves slower)")
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--sleep", type=float, default=0.0, help="seconds per step, to give signals time to land")
    args = ap.parse_args()

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(name)s: %(message)s")
    run_dir = Path(args.run_dir)
    torch.manual_seed(1234 + rank)  # per-rank RNG streams; saved and restored per rank by the Checkpointer
    random.seed(1234 + rank)
    np.random.seed(1234 + rank)

    cfg = preset("debug-tiny", hidden_size=args.hidden, ffn_hidden_size=args.hidden * 3, vocab_size=args.vocab)
    model = build_looplm(cfg)  # same init on every rank (seeded in init_weights by the global seed below)
    torch.manual_seed(0)
    model.init_weights()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = 3
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warmup if s < warmup else 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps)))
    )
    loader = build_dataloader(
        DataConfig(kind="synthetic_text", seed=7, prefetch=0),
        seq_len=32,
        micro_batch_size=2,
        global_batch_size=8,
        dp_rank=rank,
        dp_world=world,
        vocab_size=args.vocab,
    )
    sampler = LoopSampler(LoopSamplerConfig(kind="uniform", min_sampled=1, max_sampled=4, seed=3))
    state = TrainState()

    ckpt = Checkpointer(
        CheckpointConfig(
            interval=args.interval, keep_latest_k=args.keep_last, keep_every=args.keep_every, mode=args.mode
        ),
        run_dir,
        states={"model": model, "optimizer": opt, "lr_scheduler": sched, "dataloader": loader, "train_state": state},
        config=vars(args),
        stage="tinytrain",
    )
    monitor = PreemptionMonitor(("SIGUSR1", "SIGTERM"))
    resumed = ckpt.load_latest()
    if rank == 0:
        print(f"start step={state.step} resumed_from={resumed} world={world}", flush=True)

    while state.step < args.steps:
        step = state.step + 1
        n_loops = sampler(step)
        opt.zero_grad(set_to_none=True)
        total = torch.zeros(())
        for _ in range(loader.grad_accum):
            batch = next(loader)
            out = model(batch["input_ids"], n_loops=n_loops, doc_ids=batch["doc_ids"], return_logits="last")
            loss = F.cross_entropy(out.logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
            (loss / loader.grad_accum).backward()
            total += loss.detach() / loader.grad_accum
        for p in model.parameters():  # data parallel: average gradients over ranks (fixed order: deterministic)
            p.grad = torch.zeros_like(p) if p.grad is None else p.grad
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        sched.step()
        dist.all_reduce(total)
        state.step, state.tokens = step, state.tokens + 8 * 32
        state.losses.append(total.item() / world)
        if rank == 0:
            print(f"step {step} loss {state.losses[-1]:.6f} loops {n_loops}", flush=True)
            (run_dir / "progress").write_text(str(step))
        if args.sleep:
            time.sleep(args.sleep)
        ckpt.maybe_save(step)
        if monitor.should_stop(step):
            ckpt.save(step, sync=True)
            ckpt.close()
            if rank == 0:
                print(f"preempted at step {step} ({monitor.reason}); signals seen {len(monitor.received)}", flush=True)
            dist.destroy_process_group()
            return EXIT_CODE_PREEMPTED

    ckpt.save(state.step, sync=True)
    ckpt.close()
    if rank == 0:
        torch.save(
            {
                "model": model.state_dict(),
                "optimizer": ckpt.states["optimizer"].state_dict(),
                "losses": state.losses,
                "lr": sched.get_last_lr(),
            },
            run_dir / "final.pt",
        )
        print("done", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_without_teardown(main())
