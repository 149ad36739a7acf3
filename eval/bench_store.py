"""The KV store side by side at Llama-3-8B's shape (8 KV heads, d=128): CUSTOM's
`pq_backend::store` (nearest centroid of every subspace of K and V, codes into the pages)
vs FLASH_ATTN's `reshape_and_cache_flash` (bf16 rows into the pages), the same tokens and
slots for both. CUSTOM is timed as the backend runs it (grid records for 2-D subspaces,
vllm_pq_backend/nearest.py) and with the full search over all 256 centroids. In prefill the store runs once per layer for every new token, so its time
adds to every uncached prompt (eval/profile_prefill.py shows its share).

Timed with CUDA events after warm-up, each call replayed from a CUDA graph, median of
trials; random data (no zeros). 64 and 256 tokens are decode steps of that many requests:

    python eval/bench_store.py --out eval/results/store.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
from provenance import provenance, write_result  # eval/ is the script's directory

HKV, D, BLOCK = 8, 128, 128


def timed(fn, reps: int = 20, trials: int = 7) -> float:
    """Median microseconds of one call: ``reps`` calls captured in one CUDA graph and
    replayed, so that a decode step's small store times the GPU's work, not Python's
    launch overhead (vLLM runs decode steps from CUDA graphs too)."""
    fn()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / reps)
    return statistics.median(times)


def run(tokens: int, bits: int) -> list[dict]:
    from vllm import _custom_ops as vllm_ops

    from vllm_pq_backend import codebooks, kernels, nearest
    from vllm_pq_backend.layout import PageLayout

    kernels.load()
    dev, gen = "cuda", torch.Generator(device="cuda").manual_seed(tokens + bits)
    m = bits * D // 8
    blocks = tokens // BLOCK + 2
    slots = torch.randperm(blocks * BLOCK, device=dev, generator=gen)[:tokens]
    key = torch.randn(tokens, HKV, D, device=dev, generator=gen, dtype=torch.bfloat16)
    value = torch.randn(tokens, HKV, D, device=dev, generator=gen, dtype=torch.bfloat16)
    lay = PageLayout(BLOCK, m, m)
    cache = torch.zeros(blocks, HKV, BLOCK, lay.state_bytes, dtype=torch.uint8, device=dev)
    k_cb, v_cb = (codebooks.nan_marked(torch.randn(HKV, m, 256, D // m, device=dev, generator=gen))
                  for _ in range(2))
    k_cache = torch.zeros(blocks, BLOCK, HKV, D, dtype=torch.bfloat16, device=dev)
    v_cache = torch.zeros_like(k_cache)
    one = torch.ones(1, dtype=torch.float32, device=dev)
    grids = [nearest.build(cb) for cb in (k_cb, v_cb)]  # what the backend passes (2-D only)
    none = torch.empty(0, dtype=torch.uint8, device=dev)
    custom = timed(lambda: torch.ops.pq_backend.store(cache, key, value, slots, k_cb, v_cb,
                                                      *grids, *lay.kernel_args()))
    full = timed(lambda: torch.ops.pq_backend.store(cache, key, value, slots, k_cb, v_cb,
                                                    none, none, *lay.kernel_args()))
    flash = timed(lambda: vllm_ops.reshape_and_cache_flash(key, value, k_cache, v_cache, slots,
                                                           "auto", one, one))
    row = dict(tokens=tokens, kv_heads=HKV, head_dim=D, bits=bits)
    grid = bool(grids[0].numel())
    return [dict(row, backend=f"CUSTOM {bits} bits", us=round(custom, 1), grid_search=grid,
                 grid_record_bytes=grids[0].shape[-1] if grid else None),
            dict(row, backend=f"CUSTOM {bits} bits, full search", us=round(full, 1)),
            dict(row, backend="FLASH_ATTN", bits=None, us=round(flash, 1))]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[64, 256, 1024, 16384])
    p.add_argument("--bits", type=int, nargs="+", default=[4, 2])
    p.add_argument("--out", default="eval/results/store.json")
    args = p.parse_args()
    stamp = provenance()
    rows = []
    for tokens in args.tokens:
        for bits in args.bits:
            for r in run(tokens, bits):
                r.update(stamp)
                print(json.dumps({k: r[k] for k in ("backend", "tokens", "us")}), flush=True)
                rows.append(r)
    write_result(args.out, {"rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
