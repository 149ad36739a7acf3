#!/usr/bin/env bash
# Decode-kernel tuning, one variant at a time: a copy of the source tree with the
# constants of csrc/pq_decode.cuh (DecodeCfg::kWarps, kPrefetch) set as below (from
# commit 7cadb8d's 8 warps with prefetch), the kernels built just in time, the GPU kernel
# tests, then the decode bench at a few shapes. Writes eval/results/decode_variants/<name>.json.
#
#     bash eval/decode_variants.sh w8p w12 w16
set -euo pipefail
src=$(cd "$(dirname "$0")/.." && pwd)
for v in "$@"; do
  dst=$(mktemp -d)/tree && cp -r "$src" "$dst" && cd "$dst"
  # an in-place build would win over the variant's just-in-time one (kernels.load)
  rm -rf vllm_pq_backend/_C*.so build
  case $v in
    w8p) sed -i 's/kWarps = .*;/kWarps = 8;/; s/kPrefetch = .*;/kPrefetch = D <= 128;/' csrc/pq_decode.cuh ;;
    w12) sed -i 's/kWarps = .*;/kWarps = 12;/; s/kPrefetch = .*;/kPrefetch = false;/' csrc/pq_decode.cuh ;;
    w16) sed -i 's/kWarps = .*;/kWarps = 16;/; s/kPrefetch = .*;/kPrefetch = false;/' csrc/pq_decode.cuh ;;
    *) echo "unknown variant $v (w8p, w12, w16)" >&2; exit 2 ;;
  esac
  grep -n "kWarps = \|kPrefetch = " csrc/pq_decode.cuh
  export PYTHONPATH=$PWD
  python3 -c "from vllm_pq_backend import kernels; print('kernels:', kernels.load())"
  python3 -m pytest -q -x tests/test_kernels_gpu.py | tail -2
  mkdir -p "$src/eval/results/decode_variants"
  python3 eval/bench_decode.py --contexts 1024 4096 32768 --batches 8 64 --bits 4 2 \
    --no-turboquant --out "$src/eval/results/decode_variants/$v.json"
  cd "$src"
done
