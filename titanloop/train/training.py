"""The `[training]` section: what one run trains and how (steps, batch sizes, sequence length, precision, clipping,
the non-finite-loss policy, the run directory), read by startup, the loop and its callbacks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from titanloop.config_errors import require, require_choice
from titanloop.recipe.schedules import BatchRamp

DTYPES = ("auto", "float32", "bfloat16")


@dataclass
class TrainingSection:
    run_dir: str = "runs/debug"  # checkpoints, W&B files and the run id live here
    steps: int = 100
    seq_len: int = 128
    micro_batch_size: int = 4  # sequences per rank per forward
    global_batch_size: int = 8  # sequences per optimizer step, over all data-parallel ranks
    max_norm: float = 1.0  # gradient clipping (0 = off)
    seed: int = 0
    dtype: str = "auto"  # auto: bf16 parameters + fp32 reduce on GPU, fp32 on CPU
    doc_masking: bool = True  # attend within each packed document only (no dense mask: flash varlen / flex /
    #                          SDPA per document, see titanloop.model.attention; false: plain causal)
    max_nan_steps: int = 3  # stop after this many non-finite steps in a row (each one is skipped)
    # A non-finite loss (any rank) or gradient norm: skip the step (until max_nan_steps in a row) or stop at once;
    # either way <run_dir>/nonfinite/step-N.rank-R.json records the step (loss, T, non-finite gradients)
    on_nonfinite: str = "skip"  # skip | stop
    # Batch-size ramp (Ouro stage 1: 4M -> 8M tokens): global batch in sequences from batch_ramp_start to
    # global_batch_size over batch_ramp_steps steps, in stairs of batch_ramp_increment (titanloop.recipe.schedules)
    batch_ramp_start: int = 0  # 0 = no ramp
    batch_ramp_steps: int = 0
    batch_ramp_increment: int = 0  # 0 = batch_ramp_start
    # testing aids (titanloop.train.fault_injection wraps the engine only when set): the last rank's loss is NaN at
    # these steps / a NaN gradient on the last rank
    inject_nan_steps: list = field(default_factory=list)
    inject_nan_grad_steps: list = field(default_factory=list)

    def validate(self):
        require(self.steps >= 1, "training.steps", self.steps, "an integer >= 1")
        require(self.seq_len >= 2, "training.seq_len", self.seq_len, "an integer >= 2")
        require(self.micro_batch_size >= 1, "training.micro_batch_size", self.micro_batch_size, "an integer >= 1")
        require(self.global_batch_size >= 1, "training.global_batch_size", self.global_batch_size, "an integer >= 1")
        require(self.max_norm >= 0, "training.max_norm", self.max_norm, "a value >= 0 (0 disables clipping)")
        require_choice(self.dtype, "training.dtype", DTYPES)
        require(self.max_nan_steps >= 1, "training.max_nan_steps", self.max_nan_steps, "an integer >= 1")
        require_choice(self.on_nonfinite, "training.on_nonfinite", ("skip", "stop"))
        self.batch_ramp()  # validates the ramp fields

    def batch_ramp(self):
        """The BatchRamp of this config, or None without a ramp."""
        if self.batch_ramp_start == 0:
            return None

        return BatchRamp(
            start=self.batch_ramp_start,
            end=self.global_batch_size,
            ramp_steps=self.batch_ramp_steps,
            increment=self.batch_ramp_increment or self.batch_ramp_start,
        )
