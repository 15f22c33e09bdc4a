#!/usr/bin/env bash
# Single-node launcher: torchrun N processes of `python -m megatron_fp4.train`.
#
#   tools/launchers/train.sh NPROC [megatron_fp4.train args...]
#
# Examples (CPU/gloo or GPU/NCCL: the device comes from `device=auto` in the config):
#   # pp2 × interleaved 2 virtual stages × dp2 on 4 processes
#   tools/launchers/train.sh 4 --set parallel.pp=2 --set parallel.virtual_stages=2 \
#       --set parallel.schedule=interleaved_1f1b
#   # dp4 with ZeRO-2
#   tools/launchers/train.sh 4 --set parallel.zero_stage=2
#
# On CPU every process gets OMP_NUM_THREADS=1 unless you set it (N processes share the cores).
set -euo pipefail
if [[ $# -lt 1 || ! "$1" =~ ^[0-9]+$ ]]; then
  echo "usage: $0 NPROC [--config FILE] [--set section.field=value ...]" >&2
  exit 2
fi
NPROC="$1"; shift
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec torchrun --standalone --nproc-per-node "$NPROC" -m megatron_fp4.train "$@"
