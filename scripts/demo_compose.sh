#!/usr/bin/env bash
# usage: bash scripts/demo_compose.sh [--seeds 0,1] [--out runs/demo_compose] [--iso-flop] [--section.key value ...]
#
# The composition demo (`bash scripts/demo.sh --compose` runs it): does looping pay? For each seed (default 0,1;
# `--seeds 0,1,2,3,4` to change), train the same small LoopLM twice on composition questions (train_configs/demo.toml,
# 2 CPU processes each; the default two seeds, all four runs and their evaluations, took 4 min 26 s on 2 idle cores):
# looped T = 4 times, and the same parameters run once (T = 1, the baseline). Then score every run on the held-out
# questions at T = 1..8 (python -m titanloop.eval sweep) and print the comparison (scripts/demo_compose_summary.py):
# table on stdout, <out>/summary.json, <out>/depth_curve.png and the per-loop training-CE curves <out>/loss_curves.png
# (+ .json). `--out DIR` (default runs/demo_compose) is where everything goes; the demo starts afresh there. Other
# arguments go to every training run (e.g. --training.steps 100). `--iso-flop` also trains, per seed, a dense model
# with T x the layers run once (the looped model's FLOPs per token) and reports it beside the others.
set -euo pipefail
cd "$(dirname "$0")/.."
SEEDS="0,1"
OUT="runs/demo_compose"
ISO_FLOP=0
TRAIN_ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --seeds) SEEDS="${2:-}"; shift 2 || { echo "error: --seeds needs a value, e.g. --seeds 0,1,2" >&2; exit 2; } ;;
    --seeds=*) SEEDS="${1#*=}"; shift ;;
    --out) OUT="${2:-}"; shift 2 || { echo "error: --out needs a directory, e.g. --out runs/demo_compose" >&2; exit 2; } ;;
    --out=*) OUT="${1#*=}"; shift ;;
    --iso-flop) ISO_FLOP=1; shift ;;
    # this script's own help: the header comment above (before setup, so nothing is installed or removed)
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) TRAIN_ARGS+=("$1"); shift ;;
  esac
done
if ! [[ "$SEEDS" =~ ^[0-9]+(,[0-9]+)*$ ]]; then
  echo "error: --seeds '$SEEDS' is invalid: expected comma-separated integers, e.g. --seeds 0,1,2" >&2; exit 2
fi
if [ -z "$OUT" ]; then echo "error: --out is empty: give a directory, e.g. --out runs/demo_compose" >&2; exit 2; fi
if [ -d "$OUT" ] && [ ! -f "$OUT/eval_data.json" ] && [ -n "$(ls -A "$OUT")" ]; then
  echo "error: --out $OUT is a non-empty directory that holds no demo run: give a new or empty directory" >&2; exit 2
fi
bash scripts/setup.sh
PY="${TITANLOOP_VENV:-.venv}/bin/python"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" WANDB_MODE="${WANDB_MODE:-offline}"

if [ -f "$OUT/eval_data.json" ]; then echo "[demo] removing the previous demo run in $OUT"; rm -rf "$OUT"; fi
mkdir -p "$OUT/eval"
# held-out questions of the training task (never in training: the split is by a hash of the question)
"$PY" -c 'import json, sys, tomllib; d = tomllib.load(open(sys.argv[1], "rb"))["data"]; print(json.dumps({**d, "split": "eval"}))' \
    train_configs/demo.toml > "$OUT/eval_data.json"
# the iso-FLOP model's depth: the demo's shared layers x its T
if [ "$ISO_FLOP" = 1 ]; then
  ISO_LAYERS=$("$PY" -c 'import sys, tomllib; d = tomllib.load(open(sys.argv[1], "rb")); print(d["model"]["n_layers"] * d["loop_sampler"]["n_loops"])' train_configs/demo.toml)
fi
start=$(date +%s)
for seed in ${SEEDS//,/ }; do
  variants=(looped baseline); [ "$ISO_FLOP" = 1 ] && variants+=(isoflop)
  for variant in "${variants[@]}"; do
    run="$OUT/${variant}_s${seed}"
    loops=()
    [ "$variant" = baseline ] && loops=(--loop_sampler.n_loops 1)
    # iso-FLOP: T x the shared layers, run once (a dense model with the looped model's FLOPs per token)
    [ "$variant" = isoflop ] && loops=(--loop_sampler.n_loops 1 --model.n_layers "$ISO_LAYERS")
    echo "[demo] seed $seed, $variant: torchrun --nproc_per_node=2 -m titanloop.train --config train_configs/demo.toml" \
         "--training.seed $seed --data.seed $seed --training.run_dir $run ${loops[*]} ${TRAIN_ARGS[*]}"
    "$PY" -m torch.distributed.run --standalone --nproc_per_node=2 -m titanloop.train \
        --config train_configs/demo.toml --training.seed "$seed" --data.seed "$seed" --training.run_dir "$run" \
        "${loops[@]}" "${TRAIN_ARGS[@]}" 2> >(grep -v "initial_load_model_only\|TORCH_NCCL_ASYNC" >&2)
    # all 190 held-out depth-4 questions of the task (2 batches of 95), on the CPU in float32 as recorded, also on
    # a machine with a GPU (the eval CLI would otherwise pick CUDA + bfloat16 there)
    "$PY" -m titanloop.eval sweep "$run/checkpoints" --data "$OUT/eval_data.json" --out "$OUT/eval/${variant}_s${seed}" \
        --loops 1,2,3,4,6,8 --batch-size 95 --max-batches 2 --no-diagnostics \
        --device cpu --dtype float32 > "$OUT/eval/${variant}_s${seed}.log"
  done
done
n_seeds=$(echo "$SEEDS" | tr ',' '\n' | wc -l)
echo "[demo] trained and evaluated $n_seeds seeds x $((2 + ISO_FLOP)) models in $(( $(date +%s) - start )) s"
iso=(); [ "$ISO_FLOP" = 1 ] && iso=(--iso-flop)
"$PY" scripts/demo_compose_summary.py "$OUT" --seeds "$SEEDS" "${iso[@]}"
