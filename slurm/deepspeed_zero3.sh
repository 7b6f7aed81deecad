#!/bin/bash
# The 1.4B Ouro model (stage 1b config) on the DeepSpeed engine: ZeRO-3 with the optimizer state in CPU memory,
# for a few GPUs (docs/engines.md). The same launcher as every stage: srun -> torchrun on each node, not the
# deepspeed launcher.
#   sbatch slurm/deepspeed_zero3.sh [--section.key value ...]           (from the repo root; see docs/slurm.md)
#   sbatch --nodes=2 slurm/deepspeed_zero3.sh --parallelism.zero_offload none
#SBATCH --job-name=titanloop-deepspeed_zero3
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gres=gpu:8
#SBATCH --cpus-per-task=96
#SBATCH --mem=0
#SBATCH --time=48:00:00
#SBATCH --signal=B:USR1@600
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=%x-%j.out
STAGE=deepspeed_zero3
STAGE_CONFIG=train_configs/stage1b_1p4b.toml
# engine settings first: overrides given to sbatch come after them and win. Per-loop AC: the stage 1b config keeps
# every loop's activations, which its memory plan fits compiled under FSDP2; this engine runs eager, unplanned
set -- --parallelism.engine deepspeed --parallelism.zero_stage 3 --parallelism.zero_offload optimizer \
  --parallelism.compile false --parallelism.activation_checkpoint loop "$@"
source "${TITANLOOP_REPO:-${SLURM_SUBMIT_DIR:-.}}/slurm/common.sh"
