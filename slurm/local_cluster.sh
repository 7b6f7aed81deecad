#!/usr/bin/env bash
# A real single-node Slurm cluster on this machine, for the Slurm end-to-end tests and CI. Needs root.
#
#   bash slurm/local_cluster.sh install   # apt-get install slurm-wlm munge (Debian/Ubuntu); no-op when present
#   bash slurm/local_cluster.sh start     # write /etc/slurm/slurm.conf, start munged, slurmctld, slurmd; wait idle
#   bash slurm/local_cluster.sh status    # sinfo + squeue
#   bash slurm/local_cluster.sh stop      # stop the three daemons (jobs are killed)
#
# Every command is idempotent. The cluster has one node (this host) and two partitions:
#   batch   (default, PriorityTier=1, PreemptMode=REQUEUE)  -- where training jobs run
#   urgent  (PriorityTier=2)                                 -- a job here preempts (requeues) batch jobs
# Facts this relies on: munged runs as the munge user; ProctrackType=proctrack/linuxproc and
# TaskPlugin=task/none need no cgroups (containers); AuthInfo=cred_expire=10 lets a requeued job restart
# after 10 s instead of the default 120 s.
set -euo pipefail

CONF_DIR=/etc/slurm
STATE_DIR=/var/spool/slurmctld
SPOOL_DIR=/var/spool/slurmd
LOG_DIR=/var/log/slurm
HOST="$(hostname -s)"

log() { echo "[local_cluster] $*"; }
need_root() { [ "$(id -u)" = 0 ] || { echo "error: $0 $1 must run as root (it installs/starts system daemons)" >&2; exit 1; }; }

install() {
  need_root install
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null; then
    log "slurm-wlm and munge are already installed ($(slurmctld -V))"
    return
  fi
  command -v apt-get >/dev/null || { echo "error: apt-get not found: install slurm-wlm and munge by hand" >&2; exit 1; }
  log "installing slurm-wlm munge with apt-get"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null
  log "installed $(slurmctld -V)"
}

write_conf() {
  local cpus mem
  cpus="$(nproc --all)"  # --all: GNU nproc would honour OMP_NUM_THREADS otherwise
  mem="$(( $(awk '/MemTotal/ {print int($2/1024)}' /proc/meminfo) - 1024 ))"
  mkdir -p "$CONF_DIR" "$STATE_DIR" "$SPOOL_DIR" "$LOG_DIR"
  cat > "$CONF_DIR/slurm.conf.new" <<CONF
# Written by titanloop slurm/local_cluster.sh: a single-node test cluster.
ClusterName=titanloop
SlurmctldHost=${HOST}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=cred_expire=10
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SwitchType=switch/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
JobRequeue=1
ReturnToService=2
KillWait=30
MinJobAge=600
SchedulerParameters=defer_batch=0
SlurmctldPort=6817
SlurmdPort=6818
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
StateSaveLocation=$STATE_DIR
SlurmdSpoolDir=$SPOOL_DIR
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd.log
NodeName=${HOST} NodeAddr=127.0.0.1 CPUs=${cpus} RealMemory=${mem} State=UNKNOWN
PartitionName=batch Nodes=${HOST} Default=YES MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=REQUEUE OverSubscribe=NO
PartitionName=urgent Nodes=${HOST} MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF
CONF
  if ! cmp -s "$CONF_DIR/slurm.conf.new" "$CONF_DIR/slurm.conf" 2>/dev/null; then
    mv "$CONF_DIR/slurm.conf.new" "$CONF_DIR/slurm.conf"
    log "wrote $CONF_DIR/slurm.conf (node $HOST, $cpus CPUs, ${mem} MB)"
    return 0
  fi
  rm -f "$CONF_DIR/slurm.conf.new"
  return 1
}

running() { pgrep -x "$1" >/dev/null; }

start_munge() {
  if [ ! -s /etc/munge/munge.key ]; then
    log "creating /etc/munge/munge.key"
    if command -v mungekey >/dev/null; then mungekey --create --force; else
      dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none; fi
  fi
  chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
  mkdir -p /run/munge /var/lib/munge /var/log/munge
  chown munge:munge /run/munge /var/lib/munge /var/log/munge /etc/munge
  chmod 755 /run/munge
  if ! running munged; then
    log "starting munged (as munge)"
    runuser -u munge -- /usr/sbin/munged
  fi
  munge -n | unmunge >/dev/null || { echo "error: munge does not work (see /var/log/munge/munged.log)" >&2; exit 1; }
}

start() {
  need_root start
  command -v slurmctld >/dev/null || { echo "error: Slurm is not installed: run '$0 install' first" >&2; exit 1; }
  local changed=0
  write_conf && changed=1
  start_munge
  if [ "$changed" = 1 ] && { running slurmctld || running slurmd; }; then
    log "configuration changed: restarting the daemons"
    stop
    start_munge
  fi
  running slurmctld || { log "starting slurmctld"; /usr/sbin/slurmctld; }
  running slurmd || { log "starting slurmd"; /usr/sbin/slurmd; }
  for _ in $(seq 1 60); do
    state="$(sinfo -h -n "$HOST" -o %T 2>/dev/null | head -1 || true)"
    case "$state" in
      idle|mixed|allocated) log "node $HOST is $state"; sinfo; return 0 ;;
      down*|drain*) scontrol update nodename="$HOST" state=resume >/dev/null 2>&1 || true ;;
    esac
    sleep 1
  done
  echo "error: node $HOST did not become idle in 60 s; see $LOG_DIR/slurmctld.log and $LOG_DIR/slurmd.log" >&2
  exit 1
}

stop() {
  need_root stop
  for d in slurmd slurmctld; do
    if running "$d"; then
      log "stopping $d"
      pkill -x "$d" || true
      for _ in $(seq 1 20); do running "$d" || break; sleep 0.5; done
    fi
  done
  if running munged; then
    log "stopping munged"
    pkill -x munged || true
    for _ in $(seq 1 20); do running munged || break; sleep 0.5; done
  fi
}

status() {
  for d in munged slurmctld slurmd; do
    if running "$d"; then echo "$d: running"; else echo "$d: stopped"; fi
  done
  if running slurmctld; then sinfo; squeue; fi
}

case "${1:-}" in
  install) install ;;
  start) start ;;
  stop) stop ;;
  status) status ;;
  *) echo "usage: $0 {install|start|stop|status}" >&2; exit 2 ;;
esac
