#!/bin/bash
# Ouro stage 3: long-context continued training (longer sequences, larger RoPE base).
#   sbatch slurm/stage3_longct.sh [--section.key value ...]      (from the repo root; see docs/slurm.md)
#SBATCH --job-name=titanloop-stage3_longct
#SBATCH --nodes=16
#SBATCH --ntasks-per-node=1
#SBATCH --gres=gpu:8
#SBATCH --cpus-per-task=96
#SBATCH --mem=0
#SBATCH --time=48:00:00
#SBATCH --signal=B:USR1@900
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=%x-%j.out
STAGE=stage3_longct
STAGE_CONFIG=train_configs/stage3_longct.toml
source "${TITANLOOP_REPO:-${SLURM_SUBMIT_DIR:-.}}/slurm/common.sh"
