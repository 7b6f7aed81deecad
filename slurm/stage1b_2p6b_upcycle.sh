#!/bin/bash
# Ouro stage 1b, 2.6B branch: 24 -> 48 layers upcycled from stage 1a (layer duplication).
#   sbatch slurm/stage1b_2p6b_upcycle.sh [--section.key value ...]      (from the repo root; see docs/slurm.md)
#SBATCH --job-name=titanloop-stage1b_2p6b_upcycle
#SBATCH --nodes=32
#SBATCH --ntasks-per-node=1
#SBATCH --gres=gpu:8
#SBATCH --cpus-per-task=96
#SBATCH --mem=0
#SBATCH --time=48:00:00
#SBATCH --signal=B:USR1@900
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=%x-%j.out
STAGE=stage1b_2p6b_upcycle
STAGE_CONFIG=train_configs/stage1b_2p6b_upcycle.toml
source "${TITANLOOP_REPO:-${SLURM_SUBMIT_DIR:-.}}/slurm/common.sh"
