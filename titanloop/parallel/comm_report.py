"""Count the collectives of training steps: `torchrun --nproc_per_node=N -m titanloop.parallel.comm_report
--config train_configs/<name>.toml [--section.key value ...]`.

Builds the LoopTrainer exactly as `titanloop.train` does, runs `--steps` (default 2) optimizer steps and
prints, on rank 0, one JSON line per step: {"step": s, "counts": {"all_gather": n, "reduce_scatter": n,
"all_reduce": n, ...}} (counts are per rank). Step 1 includes nothing extra (no lazy init collectives
are issued by FSDP2 beyond those of the step itself); docs/parallelism.md lists the expected numbers.
"""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m titanloop.parallel.comm_report", description=__doc__)
    parser.add_argument("--config", required=True)
    parser.add_argument("--steps", type=int, default=2)
    args, overrides = parser.parse_known_args(argv)

    from titanloop.config_errors import ConfigError
    from titanloop.train.config import load_config

    try:
        cfg = load_config(args.config, overrides + ["--training.steps", str(args.steps)])
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    import torch.distributed as dist

    from titanloop.parallel.comm_count import count_collectives
    from titanloop.train.trainer import LoopTrainer

    trainer = LoopTrainer(cfg)
    data = trainer.batch_generator(trainer.dataloader)
    for _ in range(args.steps):
        trainer.step += 1
        with count_collectives() as counts:
            trainer.train_step(data)
        if trainer.rank == 0:
            print(json.dumps({"step": trainer.step, "counts": dict(sorted(counts.items()))}), flush=True)
    trainer.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
