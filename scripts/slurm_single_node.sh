#!/bin/bash
# A single-node Slurm cluster on this machine, for testing `python -m echo2.launch --emit slurm`
# (tests/test_emit.py). Root only; Debian's slurm-wlm and munge, installed with apt-get if absent.
#
#   bash scripts/slurm_single_node.sh start STATE_DIR   # install if needed, configure, start; wait until the node is idle
#   bash scripts/slurm_single_node.sh stop STATE_DIR    # stop the daemons this script started (by their pid files)
#
# Everything it writes lives in STATE_DIR (config, spool, logs, pid files) except the munge
# key (/etc/munge/munge.key, made if absent) and /etc/slurm/slurm.conf, which the daemons
# and clients read: an existing slurm.conf is refused rather than overwritten, unless this
# script wrote it (it carries the marker below). Exit 0 when the cluster is up; non-zero,
# with one line on stderr saying why, when it cannot be (the test then skips with that line).
set -euo pipefail

MARKER="# written by echo2 scripts/slurm_single_node.sh"
CONF=/etc/slurm/slurm.conf

die() { echo "slurm_single_node: $*" >&2; exit 1; }

start() {
  local state=$1
  [[ $(id -u) == 0 ]] || die "needs root (installs packages and starts daemons)"
  if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    { apt-get update -qq && apt-get install -y -qq slurm-wlm munge; } >"$state.apt.log" 2>&1 \
      || die "apt-get install slurm-wlm munge failed (see $state.apt.log)"
  fi
  if [[ -e $CONF ]] && ! grep -qF "$MARKER" "$CONF"; then
    die "$CONF exists and was not written by this script: not touching a real cluster's configuration"
  fi
  mkdir -p "$state"/{spool,ctld,log} /etc/slurm /run/munge /var/log/munge /var/lib/munge
  local node cpus memory
  node=$(hostname -s)
  cpus=$(nproc)
  memory=$(($(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 / 2))
  cat >"$CONF" <<EOF
$MARKER
ClusterName=echo2test
SlurmctldHost=$node
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$state/ctld
SlurmdSpoolDir=$state/spool
SlurmctldPidFile=$state/slurmctld.pid
SlurmdPidFile=$state/slurmd.pid
SlurmctldLogFile=$state/log/slurmctld.log
SlurmdLogFile=$state/log/slurmd.log
SlurmctldPort=$((RANDOM % 1000 + 16800))
SlurmdPort=$((RANDOM % 1000 + 17800))
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
SchedulerType=sched/backfill
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=30
NodeName=$node CPUs=$cpus RealMemory=$memory State=UNKNOWN
PartitionName=debug Nodes=$node Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
  [[ -s /etc/munge/munge.key ]] || { dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null; }
  chown -R munge:munge /etc/munge /run/munge /var/log/munge /var/lib/munge 2>/dev/null || true
  chmod 0700 /etc/munge && chmod 0400 /etc/munge/munge.key
  if ! munge -n </dev/null >/dev/null 2>&1; then
    # Its pid file where the munge user may write (it drops root before writing it).
    local munge_pid=/run/munge/echo2-munged.pid
    runuser -u munge -- munged --pid-file="$munge_pid" 2>"$state/log/munged.err" \
      || munged --force --pid-file="$munge_pid" 2>>"$state/log/munged.err" \
      || die "munged did not start (see $state/log/munged.err)"
    echo "$munge_pid" >"$state/started"
  fi
  slurmctld -f "$CONF" || die "slurmctld did not start (see $state/log/slurmctld.log)"
  echo "$state/slurmctld.pid" >>"$state/started"
  slurmd -f "$CONF" || die "slurmd did not start (see $state/log/slurmd.log)"
  echo "$state/slurmd.pid" >>"$state/started"
  for _ in $(seq 120); do  # a bounded wait for the node to register (no event to wait on)
    if sinfo -h -N -o '%T' 2>/dev/null | grep -qx idle; then exit 0; fi
    sleep 0.5
  done
  die "the node did not become idle within 60 s: $(sinfo -h -N -o '%T %E' 2>&1 | head -1)"
}

stop() {
  local state=$1 pidfile pid
  [[ -f $state/started ]] || exit 0
  # Reverse order: slurmd, slurmctld, then munged; only the PIDs this script started.
  for pidfile in $(tac "$state/started"); do
    [[ -f $pidfile ]] || continue
    pid=$(cat "$pidfile")
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  done
  rm -f "$state/started"
  if grep -qF "$MARKER" "$CONF" 2>/dev/null; then rm -f "$CONF"; fi
}

case "${1:-}" in
  start) start "${2:?STATE_DIR}" ;;
  stop) stop "${2:?STATE_DIR}" ;;
  *) die "usage: $0 start|stop STATE_DIR" ;;
esac
