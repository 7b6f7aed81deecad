#!/bin/bash
# Ouroboros retrofit: a pretrained dense checkpoint as Prelude / recurrent layer / Coda, only the controller,
# gate and per-step norms train (docs/retrofit.md). One node is enough (9.2M trainable parameters at 3B).
#   sbatch slurm/ouroboros_retrofit.sh [--section.key value ...]      (from the repo root; see docs/slurm.md)
#SBATCH --job-name=titanloop-ouroboros_retrofit
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gres=gpu:8
#SBATCH --cpus-per-task=96
#SBATCH --mem=0
#SBATCH --time=24:00:00
#SBATCH --signal=B:USR1@300
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=%x-%j.out
STAGE=ouroboros_retrofit
STAGE_CONFIG=train_configs/ouroboros_retrofit.toml
source "${TITANLOOP_REPO:-${SLURM_SUBMIT_DIR:-.}}/slurm/common.sh"
