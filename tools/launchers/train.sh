#!/usr/bin/env bash
# Single-node launcher: torchrun N processes of `python -m megatron_fp4.train`.
#
#   tools/launchers/train.sh NPROC [TORCHRUN_OPTIONS... --] [megatron_fp4.train args...]
#
# Everything before a `--` goes to torchrun, everything after it to the trainer (without `--`, all
# of it goes to the trainer). Examples (CPU/gloo or GPU/NCCL: the device comes from `device=auto`):
#   # pp2 × interleaved 2 virtual stages × dp2 on 4 processes
#   tools/launchers/train.sh 4 --set parallel.pp=2 --set parallel.virtual_stages=2 \
#       --set parallel.schedule=interleaved_1f1b
#   # dp4 with ZeRO-2; torchrun restarts the workers once if one dies (they resume, see below)
#   tools/launchers/train.sh 4 --max-restarts 1 -- --set parallel.zero_stage=2
#
# Defaults, each overridable:
# - `--set checkpoint.load=auto` comes first, so a restarted or re-run job resumes from the newest
#   complete checkpoint in checkpoint.dir (a finished job run again trains nothing; use a new
#   checkpoint.dir or `--set checkpoint.load=null` to start over).
# - torchrun forwards SIGUSR1 too (PET_SIGNALS_TO_HANDLE, torchrun's --signals-to-handle): SIGTERM or SIGUSR1 make every
#   worker finish its step, save a checkpoint and exit with code 4 (megatron_fp4/training/preemption.py);
#   torchrun waits TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds (here 120, torch's default is 30) for that.
# - `--standalone` (a local rendezvous) unless you pass --nnodes or --rdzv-* options.
# - On CPU every process gets OMP_NUM_THREADS=1 unless you set it (N processes share the cores).
# - TRAIN_MODULE (default megatron_fp4.train) is the module torchrun runs.
set -euo pipefail
if [[ $# -lt 1 || ! "$1" =~ ^[0-9]+$ ]]; then
  echo "usage: $0 NPROC [TORCHRUN_OPTIONS... --] [--config FILE] [--set section.field=value ...]" >&2
  exit 2
fi
NPROC="$1"; shift
TORCHRUN_ARGS=()
if [[ " $* " == *" -- "* ]]; then
  while [[ "$1" != "--" ]]; do TORCHRUN_ARGS+=("$1"); shift; done
  shift
fi
RDZV=(--standalone)
for arg in "${TORCHRUN_ARGS[@]+"${TORCHRUN_ARGS[@]}"}"; do
  [[ "$arg" == --nnodes* || "$arg" == --rdzv* || "$arg" == --standalone ]] && RDZV=()
done
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export PET_SIGNALS_TO_HANDLE="${PET_SIGNALS_TO_HANDLE:-SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1}"
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-120}"
exec torchrun "${RDZV[@]+"${RDZV[@]}"}" --nproc-per-node "$NPROC" "${TORCHRUN_ARGS[@]+"${TORCHRUN_ARGS[@]}"}" \
  -m "${TRAIN_MODULE:-megatron_fp4.train}" --set checkpoint.load=auto "$@"
