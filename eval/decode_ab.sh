#!/usr/bin/env bash
# Decode kernel A/B on one machine: this checkout's in-place build ("new") against the same
# tree with csrc/pq_decode.cu and csrc/pq_decode.cuh of commit BASE ("base"), built in a copy
# (in the background while the GPU kernel tests run on new). Then eval/bench_decode.py per
# shape, new then base, each timing FA3 beside it in the same run: the two builds' extension
# files are swapped in place between runs (with the package installed from this checkout, a
# copy's `import vllm_pq_backend` would find this one). Writes OUT/{new,base}_<shape>.json.
# BASE: a commit, or a folder holding its pq_decode.cu and pq_decode.cuh (a checkout without
# the history; PQ_BASE_COMMIT then names it in the results).
#
#     bash eval/decode_ab.sh 627bb68 /tmp/ab
set -euo pipefail
cd "$(dirname "$0")/.."
base=$1 out=$2
commit=${PQ_GIT_COMMIT:-$(git rev-parse --short HEAD)}
mkdir -p "$out"
so=$(ls vllm_pq_backend/_C*.so)
cp "$so" "$out/new.so"
tree=$(mktemp -d)
trap 'cp "$out/new.so" "$so"; rm -rf "$tree"' EXIT  # this checkout's build back; no copy left
cp -r csrc vllm_pq_backend setup.py pyproject.toml "$tree/"
if [ -d "$base" ]; then
  cp "$base/pq_decode.cu" "$base/pq_decode.cuh" "$tree/csrc/"
  base=${PQ_BASE_COMMIT:-$base}
else
  git show "$base:csrc/pq_decode.cu" > "$tree/csrc/pq_decode.cu"
  git show "$base:csrc/pq_decode.cuh" > "$tree/csrc/pq_decode.cuh"
fi
rm -f "$tree"/vllm_pq_backend/_C*.so
(cd "$tree" && python3 setup.py build_ext --inplace > "$out/base_build.log" 2>&1 && cp vllm_pq_backend/_C*.so "$out/base.so") &
build=$!
python3 -m pytest -q tests/test_kernels_gpu.py | tail -2
wait $build
for shape in llama3-8b qwen2.5-7b; do
  for v in new base; do
    cp "$out/$v.so" "$so"
    c=$commit; [ $v = base ] && c=$base
    PQ_GIT_COMMIT=$c python3 eval/bench_decode.py --shape $shape --contexts 1024 32768 --batches 8 64 \
      --bits 4 2 --no-turboquant --kernel-times --out "$out/${v}_${shape}.json" > "$out/${v}_${shape}.log" 2>&1
  done
done
