"""Test driver (torchrun, 2 ranks): train the debug config's LoopLM 2 steps with titanloop's DeepSpeedEngine,
then write a DeepSpeed-native checkpoint (engine.save_checkpoint, as DeepSpeed-based codebases do) and the
engine's own full fp32 weights (reference.safetensors) for tests/test_interchange_zero_checkpoint.py.

    torchrun --nproc_per_node 2 tests/deepspeed_native_driver.py OUT_DIR ZERO_STAGE
"""

import sys

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from titanloop.model import LoopLM
from titanloop.train.config import load_config
from titanloop.train.engines.deepspeed import DeepSpeedEngine
from titanloop.train.process_exit import exit_without_teardown

out, stage = sys.argv[1], int(sys.argv[2])
dist.init_process_group("gloo")
cfg = load_config("train_configs/debug.toml", world_size=dist.get_world_size())
torch.manual_seed(0)
model = LoopLM(cfg.looplm)
engine = DeepSpeedEngine(
    model,
    torch.optim.AdamW(model.parameters(), lr=1e-2),
    zero_stage=stage,
    offload="none",
    micro_batch_size=2,
    max_norm=1.0,
)
engine.lr_schedulers = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lambda step: 1.0)
gen = torch.Generator().manual_seed(dist.get_rank())


def loss_fn(m, ids):
    return (m(ids, 2).readouts[-1] @ m.lm_head.weight.T).logsumexp(-1).mean()


for _ in range(2):
    ids = torch.randint(0, cfg.looplm.vocab_size, (2, 16), generator=gen)
    engine.backward(engine.forward(loss_fn, ids), last_micro_batch=True)
    engine.step(1.0)
engine.ds.save_checkpoint(out, tag="global_step2")
reference = engine.checkpoint_states()["model"].state_dict()
if dist.get_rank() == 0:
    save_file({k: v.contiguous() for k, v in reference.items()}, f"{out}/reference.safetensors")
dist.destroy_process_group()
exit_without_teardown(0)  # DeepSpeed's native threads can abort the interpreter's teardown
