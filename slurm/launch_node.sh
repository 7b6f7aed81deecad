# One node's launcher, started by srun (one task per node) from slurm/common.sh:
#   launch_node.sh NPROC NNODES PYTHON TRAINER_ARGS...
# torchrun with a c10d rendezvous on the first node ($MASTER_ADDR:$MASTER_PORT). SIGUSR1 sent to the job step
# must reach only the trainer ranks: this shell and torchrun ignore it (an ignored signal stays ignored
# across exec; the ranks install their own handler, titanloop.checkpoint.PreemptionMonitor). Without this,
# torchrun would die on SIGUSR1 (default action) and take the ranks down before they could save.
set -euo pipefail
trap '' USR1
nproc="$1" nnodes="$2" python="$3"
shift 3
exec "$python" -m torch.distributed.run \
  --nnodes="$nnodes" --nproc_per_node="$nproc" \
  --rdzv_backend=c10d --rdzv_endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv_id="$SLURM_JOB_ID" \
  --max_restarts=0 "$@"
