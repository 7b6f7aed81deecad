#!/bin/bash
# Ouro stage 1b, 1.4B branch: continues stage 1a with T=4.
#   sbatch slurm/stage1b_1p4b.sh [--section.key value ...]      (from the repo root; see docs/slurm.md)
#SBATCH --job-name=titanloop-stage1b_1p4b
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
STAGE=stage1b_1p4b
STAGE_CONFIG=train_configs/stage1b_1p4b.toml
source "${TITANLOOP_REPO:-${SLURM_SUBMIT_DIR:-.}}/slurm/common.sh"
