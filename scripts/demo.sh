#!/usr/bin/env bash
# The README demo: does looping pay? For each seed (default 0,1,2; `--seeds 0,1,2,3,4` to change), train the same
# small LoopLM twice on in-context multi-hop questions (train_configs/demo.toml, 2 CPU processes each): looped
# T = 4 times, and the same parameters run once (T = 1, the baseline). Then score every run on held-out
# questions at T = 1..8 (python -m titanloop.eval sweep) and print the comparison (scripts/demo_summary.py):
# table on stdout, runs/demo/depth_curve.png and runs/demo/summary.json. Other arguments go to every training
# run (e.g. --training.steps 100). Each run starts the demo afresh in runs/demo/.
set -euo pipefail
cd "$(dirname "$0")/.."
SEEDS="0,1,2"
TRAIN_ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --seeds) SEEDS="${2:-}"; shift 2 || { echo "error: --seeds needs a value, e.g. --seeds 0,1,2" >&2; exit 2; } ;;
    --seeds=*) SEEDS="${1#*=}"; shift ;;
    *) TRAIN_ARGS+=("$1"); shift ;;
  esac
done
if ! [[ "$SEEDS" =~ ^[0-9]+(,[0-9]+)*$ ]]; then
  echo "error: --seeds '$SEEDS' is invalid: expected comma-separated integers, e.g. --seeds 0,1,2" >&2; exit 2
fi
bash scripts/setup.sh
PY="${TITANLOOP_VENV:-.venv}/bin/python"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" WANDB_MODE="${WANDB_MODE:-offline}"

if [ -d runs/demo ]; then echo "[demo] removing the previous demo run in runs/demo"; rm -rf runs/demo; fi
mkdir -p runs/demo/eval
# held-out questions of the training task (never in training: the split is by a hash of the question)
"$PY" -c 'import json, sys, tomllib; d = tomllib.load(open(sys.argv[1], "rb"))["data"]; print(json.dumps({**d, "split": "eval"}))' \
    train_configs/demo.toml > runs/demo/eval_data.json
start=$(date +%s)
for seed in ${SEEDS//,/ }; do
  for variant in looped baseline; do
    run="runs/demo/${variant}_s${seed}"
    loops=(); [ "$variant" = baseline ] && loops=(--model.n_loops 1 --loop_sampler.n_loops 1)
    echo "[demo] seed $seed, $variant: torchrun --nproc_per_node=2 -m titanloop.train --config train_configs/demo.toml" \
         "--training.seed $seed --data.seed $seed --training.run_dir $run ${loops[*]} ${TRAIN_ARGS[*]}"
    "$PY" -m torch.distributed.run --standalone --nproc_per_node=2 -m titanloop.train \
        --config train_configs/demo.toml --training.seed "$seed" --data.seed "$seed" --training.run_dir "$run" \
        "${loops[@]}" "${TRAIN_ARGS[@]}" 2> >(grep -v "initial_load_model_only\|TORCH_NCCL_ASYNC" >&2)
    "$PY" -m titanloop.eval sweep "$run/checkpoints" --data runs/demo/eval_data.json --out "runs/demo/eval/${variant}_s${seed}" \
        --loops 1,2,3,4,6,8 --batch-size 64 --max-batches 8 --no-diagnostics > "runs/demo/eval/${variant}_s${seed}.log"
  done
done
n_seeds=$(echo "$SEEDS" | tr ',' '\n' | wc -l)
echo "[demo] trained and evaluated $n_seeds seeds x 2 models in $(( $(date +%s) - start )) s"
"$PY" scripts/demo_summary.py runs/demo --seeds "$SEEDS"
