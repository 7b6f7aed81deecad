#!/bin/bash
# Ouro stage 4: mid-training on reasoning/instruction-style data.
#   sbatch slurm/stage4_midtrain.sh [--section.key value ...]      (from the repo root; see docs/slurm.md)
#SBATCH --job-name=titanloop-stage4_midtrain
#SBATCH --nodes=16
#SBATCH --ntasks-per-node=1
#SBATCH --gres=gpu:8
#SBATCH --cpus-per-task=96
#SBATCH --mem=0
#SBATCH --time=48:00:00
#SBATCH --signal=B:USR1@600
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=%x-%j.out
STAGE=stage4_midtrain
STAGE_CONFIG=train_configs/stage4_midtrain.toml
source "${TITANLOOP_REPO:-${SLURM_SUBMIT_DIR:-.}}/slurm/common.sh"
