"""The codebooks' map kernel (`pq_backend::map`, csrc/pq_map.cu) at Llama-3-8B's shape
(32 query / 8 KV heads, d=128, bf16, one K and one V map per KV head): the two launches
a layer makes when its codebooks carry maps, for a step of TOKENS rows:

- q/k/v: queries through T_k^-T, keys through T_k, values through T_v, one launch, rows
  strided as vLLM's split of the fused qkv projection gives them;
- output: the attention output through T_v^-1, in place.

Each call replayed from a CUDA graph, timed with CUDA events after warm-up, median of
trials (bench_store.timed). 8 and 256 tokens are decode steps, 1024 and up prompts:

    python eval/bench_map.py --out eval/results/map_kernel.json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from bench_store import timed  # eval/ is the script's directory
from provenance import provenance, write_result

HQ, HKV, D = 32, 8, 128


def run(tokens: int) -> dict:
    from vllm_pq_backend import kernels

    kernels.load()
    dev, gen = "cuda", torch.Generator(device="cuda").manual_seed(tokens)
    qkv = torch.randn(tokens, (HQ + 2 * HKV) * D, device=dev, generator=gen, dtype=torch.bfloat16)
    q = qkv[:, : HQ * D].view(tokens, HQ, D)
    k = qkv[:, HQ * D : (HQ + HKV) * D].view(tokens, HKV, D)
    v = qkv[:, (HQ + HKV) * D :].view(tokens, HKV, D)
    ts = [torch.randn(HKV, D, D, device=dev, generator=gen) / D**0.5 for _ in range(4)]
    ys = [torch.empty(x.shape, dtype=x.dtype, device=dev) for x in (q, k, v)]
    out = torch.randn(tokens, HQ, D, device=dev, generator=gen, dtype=torch.bfloat16)
    qkv_us = timed(lambda: torch.ops.pq_backend.map(ys, [q, k, v], ts[:3]))
    out_us = timed(lambda: torch.ops.pq_backend.map([out], [out], ts[3:]))
    return dict(tokens=tokens, q_heads=HQ, kv_heads=HKV, head_dim=D, dtype="bfloat16",
                qkv_us=round(qkv_us, 2), output_us=round(out_us, 2),
                layer_us=round(qkv_us + out_us, 2))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[8, 256, 1024, 4096, 16384])
    p.add_argument("--out", default="eval/results/map_kernel.json")
    args = p.parse_args()
    stamp = provenance()
    rows = []
    for tokens in args.tokens:
        r = run(tokens)
        print(json.dumps(r), flush=True)
        rows.append(dict(r, **stamp))
    write_result(args.out, {"rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
