#!/bin/bash
# Ouro stage 2: continued-training anneal (LR decay, higher-quality mixture).
#   sbatch slurm/stage2_ct_anneal.sh [--section.key value ...]      (from the repo root; see docs/slurm.md)
#SBATCH --job-name=titanloop-stage2_ct_anneal
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
STAGE=stage2_ct_anneal
STAGE_CONFIG=train_configs/stage2_ct_anneal.toml
source "${TITANLOOP_REPO:-${SLURM_SUBMIT_DIR:-.}}/slurm/common.sh"
