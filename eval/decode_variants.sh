#!/usr/bin/env bash
# Decode-kernel tuning, one variant at a time: the constants of csrc/pq_decode.cuh
# (DecodeCfg::kWarps, kPrefetch) set as below in this checkout, the kernels rebuilt in place,
# the GPU decode tests, then the decode bench at a few shapes (FA3 timed beside it). Writes
# eval/results/decode_variants/<name>_<commit>.json; csrc/pq_decode.cuh and the build are
# restored at the end. (In place, not in a copy of the tree: with the package installed
# from this checkout, a copy's `import vllm_pq_backend` still finds this one.)
#
#     bash eval/decode_variants.sh w8p w12 w16
set -euo pipefail
cd "$(dirname "$0")/.."
commit=${PQ_GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
saved=$(mktemp)
cp csrc/pq_decode.cuh "$saved"
build() { python3 setup.py build_ext --inplace > build/variant-build.log 2>&1; }
restore() { cp "$saved" csrc/pq_decode.cuh && build; }
trap restore EXIT
mkdir -p build eval/results/decode_variants
for v in "$@"; do
  cp "$saved" csrc/pq_decode.cuh
  case $v in
    w8p) sed -i 's/kWarps = .*;/kWarps = 8;/; s/kPrefetch = .*;/kPrefetch = D <= 128;/' csrc/pq_decode.cuh ;;
    w12) sed -i 's/kWarps = .*;/kWarps = D <= 128 ? 12 : 8;/; s/kPrefetch = .*;/kPrefetch = false;/' csrc/pq_decode.cuh ;;
    w16) sed -i 's/kWarps = .*;/kWarps = D <= 128 ? 16 : 8;/; s/kPrefetch = .*;/kPrefetch = false;/' csrc/pq_decode.cuh ;;
    *) echo "unknown variant $v (w8p, w12, w16)" >&2; exit 2 ;;
  esac
  grep -n "kWarps = \|kPrefetch = " csrc/pq_decode.cuh
  build
  python3 -c "from vllm_pq_backend import kernels; print('kernels:', kernels.load())"
  python3 -m pytest -q -x tests/test_kernels_gpu.py -k decode | tail -2
  PQ_GIT_COMMIT=$commit python3 eval/bench_decode.py --contexts 1024 32768 --batches 8 64 --bits 4 2 \
    --no-turboquant --out "eval/results/decode_variants/${v}_${commit}.json"
done
