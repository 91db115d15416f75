#!/usr/bin/env bash
# The split benchmark across two GPUs with each design: does the one-GPU rehearsal hold?
#
#   benchmarks/check_2gpu.sh 8b        # then: benchmarks/check_2gpu.sh 70b
#
# For the given Llama dims (8b or 70b; default 8b): default (torch.compile + NCCL), nocomm, and
# fused/<design> + split/<design> for each design in $DESIGNS (default p2p,ce,reference), at
# T = $TOKENS (default 1024..16384), $LAYERS layers (default 2), CUDA graphs. Writes
# benchmarks/results/split_2gpu_<dims>.csv and .png and prints each T's ratios. A design that
# cannot run there (its sites fall back) is skipped and listed (exit status 1), the others are
# still measured. Expected time on 2x H200: ~6 min per dims (8 variants x 5 T, each point a
# compile of a few seconds); the whole run is cut at $TIMEOUT_S (default 570 s) and keeps every
# point measured by then (the CSV is written after each one). NVLink multicast stays off
# (benchmarks/common.py). Compare with split_rehearsal_<dims>.csv as docs/rehearsal.md says.
set -euo pipefail
cd "$(dirname "$0")/.."
DIMS_ARG=${1:-8b}
shift || true
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
exec timeout --signal=INT --kill-after=20 "${TIMEOUT_S:-570}" \
    torchrun --nproc-per-node 2 benchmarks/bench_split.py --dims "$DIMS_ARG" --layers "${LAYERS:-2}" \
    --tokens "${TOKENS:-1024,2048,4096,8192,16384}" --designs "${DESIGNS:-p2p,ce,reference}" \
    --keep-going --csv-name "split_2gpu_$DIMS_ARG" --out benchmarks/results "$@"
