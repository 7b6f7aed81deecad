"""Distributed training of LoopLMs on torchtitan: `torchrun -m titanloop.train --config <file.toml>`.

Modules: config (TOML schema + CLI overrides), cpu_shim (torchtitan on CPU), model_spec (torchtitan
ModelSpec + Ouro HF state-dict adapter), objective (per-loop objective and statistics), metrics (stdout +
W&B), trainer (LoopTrainer, a torchtitan Trainer). Importing this package does not import torchtitan's
trainer; `titanloop.train.trainer` does. See docs/training.md.
"""
from titanloop.train.config import TrainConfig, load_config

__all__ = ["TrainConfig", "load_config"]
