#!/usr/bin/env bash
# The README demo: set up .venv (if needed), train a small LoopLM on 3-hop relation questions with 2 CPU
# processes (train_configs/demo.toml, per-loop loss printed as it trains), then sweep its depth T = 1..8 and
# the early-exit rules on the 120 held-out questions (python -m titanloop.eval sweep): table on stdout, plots
# and report.json in runs/demo/eval/. Each run starts the demo afresh in runs/demo/.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY="${TITANLOOP_VENV:-.venv}/bin/python"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" WANDB_MODE="${WANDB_MODE:-offline}"

if [ -d runs/demo ]; then echo "[demo] removing the previous demo run in runs/demo"; rm -rf runs/demo; fi
mkdir -p runs/demo
echo "[demo] training: torchrun --nproc_per_node=2 -m titanloop.train --config train_configs/demo.toml"
"$PY" -m torch.distributed.run --standalone --nproc_per_node=2 -m titanloop.train \
    --config train_configs/demo.toml "$@" 2> >(grep -v "initial_load_model_only\|TORCH_NCCL_ASYNC" >&2)

cat > runs/demo/eval_data.json <<'JSON'
{"kind": "synthetic_task", "task": "multihop", "split": "eval",
 "task_options": {"n_layers": 4, "layer_size": 12, "n_relations": 3, "n_eval": 120}}
JSON
echo "[demo] evaluating: python -m titanloop.eval sweep runs/demo/checkpoints --data runs/demo/eval_data.json"
"$PY" -m titanloop.eval sweep runs/demo/checkpoints --data runs/demo/eval_data.json --out runs/demo/eval \
    --loops 1,2,3,4,6,8 --batch-size 8 --max-batches 15 --no-diagnostics
echo "[demo] done: plots and report in runs/demo/eval/ (depth_curve.png, pareto.png, report.json)"
