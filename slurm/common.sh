# Shared body of the titanloop sbatch scripts; sourced by slurm/<stage>.sh after it sets STAGE and
# STAGE_CONFIG. Arguments of `sbatch slurm/<stage>.sh ARGS...` are config overrides passed to the trainer
# (e.g. --training.steps 100). See docs/slurm.md.
#
# Environment (all optional):
#   TITANLOOP_REPO     checkout to run from (default: the sbatch submit dir, i.e. run sbatch from the repo)
#   TITANLOOP_CONFIG   config path (default: train_configs/$STAGE.toml from the stage script)
#   TITANLOOP_RUN_DIR  run dir override (--training.run_dir); the same run dir resumes automatically
#   TITANLOOP_PYTHON   python with titanloop installed (default: $TITANLOOP_REPO/.venv/bin/python)
#   TITANLOOP_TRAIN    what torchrun starts (default "-m titanloop.train"; a script path also works)
#   NPROC              processes per node (default: GPUs on the node, 8; with CPU=1: 2)
#   CPU=1              gloo on CPU, e.g. `CPU=1 sbatch --gres=none slurm/stage1a.sh` with a tiny config
#   MASTER_PORT        rendezvous port on the first node (default: 29500 + job id % 1000)
#
# Preemption protocol (docs/checkpointing.md):
#   Slurm sends SIGUSR1 to this batch shell (--signal=B:USR1@<margin>, or `scancel -s USR1 -b`); the trap
#   forwards it to every process of the training step (`scancel -s USR1 <job>`: with proctrack linuxproc or
#   cgroup that reaches the trainer ranks; launch_node.sh makes the launchers ignore it) and repeats it
#   every TITANLOOP_RESIGNAL_S seconds in case the trainer had not installed its handler yet. The ranks agree
#   at the next step boundary, save synchronously and exit 75. This script then requeues the job itself
#   (`scontrol requeue`): Slurm does not requeue a job on its own after a time-limit signal or a manual
#   signal, whatever the exit code. The requeued job (same run dir) resumes from the latest checkpoint.
#   On real preemption (PreemptMode=REQUEUE) Slurm sends SIGTERM to all processes, requeues by itself; the
#   ranks save on SIGTERM too (torchrun gives them 30 s, KillWait must be longer).

set -euo pipefail

REPO="${TITANLOOP_REPO:-${SLURM_SUBMIT_DIR:-$PWD}}"
CONFIG="${TITANLOOP_CONFIG:-$REPO/$STAGE_CONFIG}"
PYTHON="${TITANLOOP_PYTHON:-$REPO/.venv/bin/python}"
read -r -a TRAIN <<< "${TITANLOOP_TRAIN:--m titanloop.train}"
CPU="${CPU:-0}"
if [ "$CPU" = 1 ]; then NPROC="${NPROC:-2}"; else NPROC="${NPROC:-${SLURM_GPUS_ON_NODE:-8}}"; fi
RESIGNAL_S="${TITANLOOP_RESIGNAL_S:-20}"
: "${SLURM_JOB_ID:?run this script with sbatch (or set SLURM_JOB_ID / SLURM_JOB_NODELIST by hand)}"

ARGS=(--config "$CONFIG")
[ -n "${TITANLOOP_RUN_DIR:-}" ] && ARGS+=(--training.run_dir "$TITANLOOP_RUN_DIR")
ARGS+=("$@")

NODES=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))
export TITANLOOP_STAGE="$STAGE"  # recorded in the checkpoint manifest
export MASTER_ADDR="${MASTER_ADDR:-${NODES[0]}}"
export MASTER_PORT="${MASTER_PORT:-$((29500 + SLURM_JOB_ID % 1000))}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1
if [ "$CPU" = 1 ]; then export CUDA_VISIBLE_DEVICES=""; fi

echo "[slurm] $(date -u +%FT%TZ) job $SLURM_JOB_ID stage $STAGE restart ${SLURM_RESTART_COUNT:-0}:" \
     "${#NODES[@]} node(s) x $NPROC procs, rendezvous $MASTER_ADDR:$MASTER_PORT, config $CONFIG ${*:-}"

preempted=0
on_usr1() {
  preempted=1
  echo "[slurm] $(date -u +%FT%TZ) SIGUSR1: asking the trainer to save and stop"
  scancel --signal=USR1 "$SLURM_JOB_ID" || true
}
trap on_usr1 USR1
trap 'echo "[slurm] $(date -u +%FT%TZ) SIGTERM: the trainer ranks save on their own SIGTERM"' TERM

cd "$REPO"
srun --kill-on-bad-exit=1 --nodes="${#NODES[@]}" --ntasks-per-node=1 \
  bash "$REPO/slurm/launch_node.sh" "$NPROC" "${#NODES[@]}" "$PYTHON" "${TRAIN[@]}" "${ARGS[@]}" &
step_pid=$!

# `wait` returns early whenever a trapped signal arrives: loop until the step is really gone, re-sending
# the stop signal while it runs (a rank that was still starting up may have missed the first one).
last_signal=0
while kill -0 "$step_pid" 2>/dev/null; do
  wait "$step_pid" && rc=0 || rc=$?
  if [ "$preempted" = 1 ] && kill -0 "$step_pid" 2>/dev/null; then
    now=$(date +%s)
    if [ "$last_signal" = 0 ]; then last_signal=$now
    elif (( now - last_signal >= RESIGNAL_S )); then last_signal=$now; scancel --signal=USR1 "$SLURM_JOB_ID" || true; fi
    sleep 1
  fi
done
wait "$step_pid" 2>/dev/null && rc=0 || rc=${rc:-$?}

if [ "$preempted" = 1 ] && [ "$rc" != 0 ]; then  # (rc 0: the run finished before the signal took effect)
  echo "[slurm] $(date -u +%FT%TZ) trainer stopped (exit $rc) after SIGUSR1: requeueing job $SLURM_JOB_ID"
  scontrol requeue "$SLURM_JOB_ID"
  exit 0
fi
echo "[slurm] $(date -u +%FT%TZ) trainer exited with $rc"
exit "$rc"
