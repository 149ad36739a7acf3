#!/usr/bin/env bash
# Nsight Compute on one launch of the decode kernel at Llama-3-8B's shape (eval/bench_decode.py's
# inputs, called without CUDA graphs): the details page, and the per-instruction source
# counters summarised by eval/ncu_summary.py (instruction mix per 32-token chunk, stalls).
#
#     bash eval/ncu_decode.sh CONTEXT BATCH M OUT_PREFIX    # e.g. 32768 8 64 /tmp/ncu_32k_b8
set -euo pipefail
ctx=$1 batch=$2 m=$3 out=$4
ncu=${NCU:-ncu}
metrics=l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum,smsp__inst_executed_op_shared_ld.sum,l1tex__data_pipe_lsu_wavefronts.sum,smsp__inst_executed.sum,sm__cycles_elapsed.avg
"$ncu" --kernel-name regex:decode_kernel --launch-skip 1 --launch-count 1 --set full --metrics "$metrics" \
  --import-source yes -o "$out" -f python3 - "$ctx" "$batch" "$m" <<'PY'
import sys
import torch
sys.path.insert(0, "eval")
import bench_decode as b
b.timed = lambda fn, n, reps=10, trials=7: [fn(i % n) for i in range(4)] and 0.0  # eager, no graph
ctx, batch, m = map(int, sys.argv[1:4])
b.bench_pq(batch, ctx, (m, m), torch.Generator("cuda").manual_seed(0))
torch.cuda.synchronize()
PY
"$ncu" --import "$out.ncu-rep" --page details > "$out.txt"
"$ncu" --import "$out.ncu-rep" --page source --csv --print-source sass > "$out.csv"
python3 eval/ncu_summary.py "$out.csv" --chunks $((ctx * batch * 8 / 32)) > "$out.summary.txt"
