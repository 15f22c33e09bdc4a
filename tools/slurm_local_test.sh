#!/usr/bin/env bash
# Slurm for real, on one machine: start a single-node cluster on localhost (Debian's slurm-wlm +
# munge), submit tools/launchers/slurm_train.sbatch on CPU and check, on a tiny 8-step job:
#   1. a plain job completes (the reference losses);
#   2. SIGUSR1 to the batch script (what --signal=B:USR1@120 delivers before the time limit): the
#      workers save the step they finish, the script requeues the job, the job resumes and completes;
#   3. scancel (SIGTERM everywhere): the workers save, the job ends; `sbatch` again resumes it;
# and that jobs 2 and 3 end with exactly the losses of job 1 (fp32, same machine: bitwise).
#
#   sudo tools/slurm_local_test.sh [WORKDIR]
#
# Needs root (slurmd, munged). Installs slurm-wlm and munge with apt-get when missing (about 20 s
# on Debian 12; SLURM_NO_INSTALL=1 refuses instead). The daemons use their own config, ports
# (16817/16818) and state under WORKDIR and are stopped on exit; /etc/slurm is not touched.
# Measured on a 2-core machine: cluster start a few seconds, the whole check 2-4 minutes.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
WORK="${1:-$(mktemp -d /tmp/slurm-local.XXXXXX)}"
mkdir -p "$WORK" && WORK="$(cd "$WORK" && pwd)"
log() { echo "slurm_local_test: $*"; }
fail() { log "FAIL: $*"; exit 1; }
[[ "$(id -u)" == 0 ]] || fail "run as root (slurmd and munged need it)"

if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
  [[ "${SLURM_NO_INSTALL:-0}" == 1 ]] && fail "slurm-wlm/munge are not installed (SLURM_NO_INSTALL=1)"
  log "installing slurm-wlm and munge"
  start=$(date +%s)
  DEBIAN_FRONTEND=noninteractive apt-get update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends slurm-wlm munge >/dev/null
  log "installed in $(( $(date +%s) - start )) s"
fi

# -- the cluster ----------------------------------------------------------------------------------
HOST="$(hostname -s)"
mkdir -p "$WORK"/{state,spool,log} /run/munge
export SLURM_CONF="$WORK/slurm.conf"
cat > "$SLURM_CONF" <<CONF
ClusterName=localtest
SlurmctldHost=$HOST
SlurmctldPort=16817
SlurmdPort=16818
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$WORK/state
SlurmdSpoolDir=$WORK/spool
SlurmctldPidFile=$WORK/slurmctld.pid
SlurmdPidFile=$WORK/slurmd.pid
SlurmctldLogFile=$WORK/log/slurmctld.log
SlurmdLogFile=$WORK/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
JobRequeue=1
KillWait=60
MpiDefault=none
NodeName=$HOST CPUs=$(nproc) State=UNKNOWN
PartitionName=local Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
STARTED_MUNGE=""
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  [[ -f /etc/munge/munge.key ]] || mungekey --create
  chown -R munge: /etc/munge /run/munge /var/lib/munge /var/log/munge 2>/dev/null || true
  runuser -u munge -- /usr/sbin/munged
  STARTED_MUNGE=1
fi
cleanup() {
  scancel --quiet --user=root 2>/dev/null || true
  for pidfile in "$WORK/slurmd.pid" "$WORK/slurmctld.pid"; do
    [[ -f "$pidfile" ]] && kill "$(cat "$pidfile")" 2>/dev/null || true
  done
  [[ -n "$STARTED_MUNGE" && -f /run/munge/munged.pid ]] && kill "$(cat /run/munge/munged.pid)" 2>/dev/null || true
}
trap cleanup EXIT
slurmctld -i
slurmd -N "$HOST"
for _ in $(seq 60); do
  [[ "$(sinfo -h -o %T 2>/dev/null)" == idle ]] && break
  sleep 1
done
[[ "$(sinfo -h -o %T)" == idle ]] || fail "the node did not come up: $(sinfo 2>&1); see $WORK/log"
log "cluster up: $(sinfo -h -o '%P %D %c %T')"

# -- the jobs -------------------------------------------------------------------------------------
TINY=(--set model.num_layers=2 --set schedule.seq_len=32 --set schedule.global_batch_size=8
      --set schedule.micro_batch_size=4 --set schedule.train_steps=8 --set schedule.warmup_steps=0
      --set checkpoint.save_interval=2 --set checkpoint.keep_last=0 --set logging.tensorboard_dir=null
      --set parallel.timeout_s=120)
submit() {  # NAME [FAULT]: the launcher with the test entry point (tests/faults/_launch_worker.py)
  (cd "$WORK" && NPROC_PER_NODE=2 PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" TRAIN_MODULE=tests.faults._launch_worker \
     LOSS_LOG="$WORK/$1.losses" FAULT="${2:-}" MASTER_PORT=$((29600 + RANDOM % 1000)) \
     sbatch --parsable --nodes=1 --job-name="$1" --output="$WORK/$1.out" \
     "$REPO/tools/launchers/slurm_train.sbatch" "${TINY[@]}" --set checkpoint.dir="$WORK/$1.ckpt")
}
state() { scontrol show job "$1" 2>/dev/null | sed -n 's/.*JobState=\([A-Z_]*\).*/\1/p'; }
wait_done() {  # JOBID: until the job has left the queue for good (a requeued job comes back)
  for _ in $(seq 600); do
    case "$(state "$1")" in COMPLETED|FAILED|CANCELLED|TIMEOUT|NODE_FAIL|"") return 0;; esac
    sleep 1
  done
  fail "job $1 did not finish; see $WORK"
}
wait_file() { for _ in $(seq 300); do [[ -e "$1" ]] && return 0; sleep 1; done; fail "$1 never appeared; see $WORK"; }

log "job 1: uninterrupted"
ref=$(submit ref); wait_done "$ref"
[[ "$(state "$ref")" == COMPLETED ]] || fail "job $ref ended $(state "$ref"): $(tail -5 "$WORK/ref.out")"

log "job 2: SIGUSR1 to the batch script after step 3 -> save, requeue, resume"
pre=$(submit pre "hold:0:3:$WORK/pre.held"); wait_file "$WORK/pre.held"
scancel --batch --signal=USR1 "$pre"
wait_done "$pre"
[[ "$(state "$pre")" == COMPLETED ]] || fail "job $pre ended $(state "$pre"): $(tail -5 "$WORK/pre.out")"
grep -q "preempted by SIGUSR1: stopped after step 4" "$WORK/pre.out" || fail "job $pre: no preemption save in pre.out"
grep -q "requeueing job $pre" "$WORK/pre.out" || fail "job $pre was not requeued"
grep -q "resumed from .* at step 4" "$WORK/pre.out" || fail "job $pre did not resume at step 4"

log "job 3: scancel after step 3 -> save, end; resubmit -> resume"
can=$(submit can "hold:0:3:$WORK/can.held"); wait_file "$WORK/can.held"
scancel "$can"
wait_done "$can"
[[ -f "$WORK/can.ckpt/step_00000004/meta.json" ]] || fail "scancel: no step 4 checkpoint ($(ls "$WORK/can.ckpt"))"
again=$(submit can); wait_done "$again"
[[ "$(state "$again")" == COMPLETED ]] || fail "resubmitted job $again ended $(state "$again")"
grep -q "resumed from .* at step 4" "$WORK/can.out" || fail "resubmitted job $again did not resume at step 4"

cd "$REPO" && python - "$WORK" <<'PY' || fail "losses differ from the uninterrupted job's"
import sys
from pathlib import Path
from tests.faults._launchers import read_losses
work = Path(sys.argv[1])
ref = read_losses(work / "ref.losses")
assert sorted(ref) == list(range(8)), ref
for name in ("pre", "can"):
    assert read_losses(work / f"{name}.losses") == ref, name
PY
log "PASS: completion, requeue after SIGUSR1 and resubmission after scancel all end with the reference losses"
