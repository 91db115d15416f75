#!/usr/bin/env bash
# Two GPUs, one command: what a user gets with the defaults, and does the one-GPU rehearsal hold?
#
#   benchmarks/check_2gpu.sh 8b        # then: benchmarks/check_2gpu.sh 70b
#
# 1. The split benchmark (benchmarks/bench_split.py) for the given Llama dims (8b or 70b; default
#    8b): default (torch.compile + NCCL), autotune (backend="tokenweave" with the defaults: the
#    measured choice at compile time, sites fused only where they win on these GPUs), nocomm, and
#    fused/<design> + split/<design> for each design in $DESIGNS (default p2p,ce,reference), at
#    T = $TOKENS (default 1024..16384), $LAYERS layers (default 2), CUDA graphs. Writes
#    benchmarks/results/split_2gpu_<dims>.csv and .png and prints each T's ratios (autotune over
#    default is the number users get). A design that cannot run there (its sites fall back) is
#    skipped and listed (exit status 1), the others are still measured. Compare the split rows
#    with split_rehearsal_<dims>.csv as docs/rehearsal.md says.
# 2. A Hugging Face Llama at the same dims (random weights, its own tp_plan; examples/hf_tp.py):
#    plain torch.compile against backend="tokenweave" with the defaults (autotune), prefill at
#    $HF_TOKENS (default 1024 4096) and decode at batch 1 8 64 256 after 1024 cached tokens.
#    Writes benchmarks/results/hf_2gpu_<dims>.csv (prefill) and hf_decode_llama_<dims>.csv/.png,
#    and prints the explain report with the measured table of each graph.
# 3. The fp8 epilogue (benchmarks/bench_fp8.py --real) at the same dims on the two GPUs' NCCL group:
#    one site with a per-row fp8 quant, plain Inductor against the op with the quant outside and
#    the op with its epilogue (the gather moving fp8 codes and row scales), at $FP8_TOKENS (default
#    16..16384). Writes benchmarks/results/fp8_2gpu.csv and .png.
#
# Expected time on 2x H200: ~7 min for step 1 (9 variants x 5 T, each point a compile of a few
# seconds), ~4 min for step 2, 1-2 min for step 3 (not yet run on two GPUs). Each step is cut at
# its own limit ($TIMEOUT_S, default 570 s; $HF_TIMEOUT_S, default 420 s; $FP8_TIMEOUT_S, default
# 300 s) and keeps every point measured by then. NVLink multicast stays off:
# both steps run with the variables exported below (benchmarks/common.py sets them too). Exit
# status: the first failing step's.
set -uo pipefail
cd "$(dirname "$0")/.."
DIMS_ARG=${1:-8b}
shift || true
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1

timeout --signal=INT --kill-after=20 "${TIMEOUT_S:-570}" \
    torchrun --nproc-per-node 2 benchmarks/bench_split.py --dims "$DIMS_ARG" --layers "${LAYERS:-2}" \
    --tokens "${TOKENS:-1024,2048,4096,8192,16384}" --designs "${DESIGNS:-p2p,ce,reference}" \
    --keep-going --csv-name "split_2gpu_$DIMS_ARG" --out benchmarks/results "$@"
split_status=$?

rm -f "benchmarks/results/hf_2gpu_$DIMS_ARG.csv"  # --csv appends: one current file per run
# shellcheck disable=SC2086  # HF_TOKENS is a list of numbers
timeout --signal=INT --kill-after=20 "${HF_TIMEOUT_S:-420}" \
    torchrun --nproc-per-node 2 examples/hf_tp.py --arch llama --size "$DIMS_ARG" \
    --variants default tokenweave --tokens ${HF_TOKENS:-1024 4096} --decode \
    --csv "benchmarks/results/hf_2gpu_$DIMS_ARG.csv" --decode-out benchmarks/results
hf_status=$?

timeout --signal=INT --kill-after=20 "${FP8_TIMEOUT_S:-300}" \
    torchrun --nproc-per-node 2 benchmarks/bench_fp8.py --real --dims "$DIMS_ARG" \
    --tokens "${FP8_TOKENS:-16,128,1024,4096,16384}" --out benchmarks/results
fp8_status=$?

[ "$split_status" -ne 0 ] && exit "$split_status"
[ "$hf_status" -ne 0 ] && exit "$hf_status"
exit "$fp8_status"
