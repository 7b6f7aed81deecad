#!/usr/bin/env bash
# usage: bash scripts/demo.sh [--out runs/demo] [--seed 0] [--compose [composition-demo options]] [--section.key value ...]
#
# The README's first command: a looped LM on real text, on a CPU. It builds a character tokenizer and train / held-out
# shards of tinyshakespeare (committed in data/; `python -m data_pipelines.corpora shakespeare_char`), then trains
# three models of nanoGPT's CPU "baby GPT" size for the same 2,000 steps of 12 x 64 characters, one process each
# using every core (`torchrun --nproc_per_node=1 -m titanloop.train`):
#   looped  one shared layer run T = 4 times (train_configs/shakespeare_looped.toml)
#   once    the same layer run once (T = 1): the same parameters, a quarter of the compute
#   dense   4 layers run once (train_configs/nanogpt_shakespeare_char.toml): the looped model's FLOPs, 4x the parameters
# Each scores the whole held-out split (111,540 characters) at T = 1..8 at its last step, the looped model also at
# T = 12, 16, 24 and 32 (far past its trained depth); scripts/demo_text_summary.py prints the table, how much of the
# gap from `once` to `dense` looping closes and how the looped model's loss moves past its trained depth, and
# `python -m titanloop.eval generate` samples text from the looped model. Everything goes to --out (default runs/demo), which starts afresh.
# Other arguments go to every training run (e.g. --training.steps 200 for a quick look). --seed sets the training and
# data seeds. --compose runs the composition demo instead (scripts/demo_compose.sh, with the arguments after it).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="runs/demo"
SEED=0
TRAIN_ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --compose) shift; exec bash scripts/demo_compose.sh "$@" ;;
    --out) OUT="${2:-}"; shift 2 || { echo "error: --out needs a directory, e.g. --out runs/demo" >&2; exit 2; } ;;
    --out=*) OUT="${1#*=}"; shift ;;
    --seed) SEED="${2:-}"; shift 2 || { echo "error: --seed needs a value, e.g. --seed 1" >&2; exit 2; } ;;
    --seed=*) SEED="${1#*=}"; shift ;;
    # this script's own help: the header comment above (before setup, so nothing is installed or removed)
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) TRAIN_ARGS+=("$1"); shift ;;
  esac
done
if ! [[ "$SEED" =~ ^[0-9]+$ ]]; then echo "error: --seed '$SEED' is invalid: expected an integer, e.g. --seed 1" >&2; exit 2; fi
if [ -z "$OUT" ]; then echo "error: --out is empty: give a directory, e.g. --out runs/demo" >&2; exit 2; fi
if [ -d "$OUT" ] && [ ! -f "$OUT/demo_text" ] && [ -n "$(ls -A "$OUT")" ]; then
  echo "error: --out $OUT is a non-empty directory that holds no demo run: give a new or empty directory" >&2; exit 2
fi
bash scripts/setup.sh
PY="${TITANLOOP_VENV:-.venv}/bin/python"
export WANDB_MODE="${WANDB_MODE:-offline}"
start=$(date +%s)
"$PY" -m data_pipelines.corpora shakespeare_char
if [ -f "$OUT/demo_text" ]; then echo "[demo] removing the previous demo run in $OUT"; rm -rf "$OUT"; fi
mkdir -p "$OUT" && touch "$OUT/demo_text"
LOOPED=train_configs/shakespeare_looped.toml
declare -A CONFIG=([looped]=$LOOPED [once]=$LOOPED [dense]=train_configs/nanogpt_shakespeare_char.toml)
# the looped model runs up to 32 loops when scored (max_loops: with per-loop norms, one norm per loop up to it)
declare -A EXTRA=([looped]="--model.max_loops 32" [once]="--loop_sampler.kind fixed --loop_sampler.n_loops 1" [dense]="")
declare -A LOOPS=([looped]="[1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32]" [once]="[1, 2, 3, 4, 5, 6, 7, 8]"
                  [dense]="[1, 2, 3, 4, 5, 6, 7, 8]")
for model in looped once dense; do
  # the held-out loss at every listed loop count, once, at the last step (the whole split: validation.steps = 0)
  args=(--config "${CONFIG[$model]}" --training.run_dir "$OUT/$model" --training.seed "$SEED" --data.seed "$SEED"
        --validation.loops "${LOOPS[$model]}" --validation.freq 1000000 --metrics.log_freq 500)
  read -r -a extra <<< "${EXTRA[$model]}"
  echo "[demo] $model: torchrun --nproc_per_node=1 -m titanloop.train ${args[*]} ${extra[*]} ${TRAIN_ARGS[*]}"
  "$PY" -m torch.distributed.run --standalone --nproc_per_node=1 -m titanloop.train "${args[@]}" "${extra[@]}" \
      "${TRAIN_ARGS[@]}" 2> >(grep -v "initial_load_model_only\|TORCH_NCCL_ASYNC\|exceed total steps" >&2)
done
"$PY" scripts/demo_text_summary.py "$OUT"
echo
echo "[demo] a sample from the looped model: python -m titanloop.eval generate $OUT/looped/checkpoints --prompt 'ROMEO:'" \
     "--max-new-tokens 300 --temperature 0.8 --top-k 20 --seed $SEED"
"$PY" -m titanloop.eval generate "$OUT/looped/checkpoints" --prompt "ROMEO:" --max-new-tokens 300 --temperature 0.8 \
    --top-k 20 --seed "$SEED" 2>/dev/null
echo
echo "[demo] done in $(( $(date +%s) - start )) s; runs, metrics and summary.json in $OUT"
