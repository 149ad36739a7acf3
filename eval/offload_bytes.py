"""Bytes of KV cache that leave the GPU: host memory per cached token and per 32K-token
conversation (FLASH_ATTN bf16 against CUSTOM pages), and what a prefill instance hands a
decode instance for one prompt. docs/offload.md quotes this script's output.

Page sizes come from the package's own layout (``layout.PageLayout``, ``layout.subspaces``,
the default block size and window in ``config``), so the numbers follow the page layout
the backend serves. No GPU, no vLLM import.

    python eval/offload_bytes.py [--host-gib 64] [--tokens 32768]
"""

from __future__ import annotations

import argparse
import math
import sys

from vllm_pq_backend.config import DEFAULT_BLOCK_SIZE, DEFAULT_WINDOW
from vllm_pq_backend.layout import PageLayout, subspaces

# (name, layers, KV heads, head_dim)
MODELS = (("Llama-3-8B", 32, 8, 128), ("SmolLM2-135M", 30, 3, 64))
# (label, bits per element of K, of V); None: FLASH_ATTN's dense bf16 page
RATES = (("FLASH_ATTN bf16", None, None), ("CUSTOM 4 bits", 4, 4),
         ("CUSTOM 3 bits (K4/V2)", 4, 2), ("CUSTOM 2 bits", 2, 2))
BF16 = 2  # bytes
HOST_PAGE = 4096  # vLLM's CPUOffloadingSpec rounds each host chunk up to the OS page size
GIB, MIB = 2**30, 2**20


def block_bytes(layers, heads, head_dim, bits_k, bits_v, block=DEFAULT_BLOCK_SIZE) -> int:
    """One vLLM block of every layer: what an offloading connector copies per block."""
    if bits_k is None:
        per_head = block * 2 * head_dim * BF16  # K and V, head_dim elements each
    else:
        per_head = PageLayout(block, subspaces(head_dim, bits_k),
                              subspaces(head_dim, bits_v)).head_bytes
    return layers * heads * per_head


def window_row_bytes(layers, heads, head_dim) -> int:
    """One token's full-precision K and V in the window store, every layer (bf16)."""
    return layers * heads * 2 * head_dim * BF16


def fmt(n: float) -> str:
    return f"{n / GIB:.3f} GiB" if n >= GIB else f"{n / MIB:.1f} MiB"


def host_table(host_gib: float, tokens: int) -> list[str]:
    b = DEFAULT_BLOCK_SIZE
    blocks = math.ceil(tokens / b)
    out = [f"Host memory (block {b} tokens; a {tokens}-token conversation is {blocks} "
           f"blocks; {host_gib:g} GiB of host memory)", "",
           "| model | KV cache | bytes per token | per conversation | conversations |",
           "|---|---|---:|---:|---:|"]
    for name, layers, heads, d in MODELS:
        for label, bk, bv in RATES:
            per_block = block_bytes(layers, heads, d, bk, bv)
            chunk = -(-per_block // HOST_PAGE) * HOST_PAGE
            pad = "" if chunk == per_block else f" (+{chunk - per_block} B host padding)"
            fit = int(host_gib * GIB) // chunk // blocks
            out.append(f"| {name} | {label} | {per_block // b:,}{pad} | "
                       f"{fmt(blocks * chunk)} | {fit:,} |")
    return out


def handoff_table(tokens_list: list[int]) -> list[str]:
    """Prefill -> decode for one prompt on Llama-3-8B: whole blocks as a connector moves
    them (the last, partial one included), plus the window rows of the last segment; or
    only the blocks before the last segment, the decode instance recomputing the rest."""
    name, layers, heads, d = MODELS[0]
    b, w = DEFAULT_BLOCK_SIZE, DEFAULT_WINDOW
    out = [f"Prefill to decode, one prompt on {name} (block {b}, window {w})", "",
           "| prompt tokens | KV cache | what crosses | bytes | vs bf16 |",
           "|---:|---|---|---:|---:|"]
    for n in tokens_list:
        blocks = math.ceil(n / b)
        seg = (n - 1) // w * w  # the last segment's start (layout.window_start)
        full = (n - 1) // b  # blocks before the block holding the last token
        dense = blocks * block_bytes(layers, heads, d, None, None)
        out.append(f"| {n:,} | FLASH_ATTN bf16 | {blocks} blocks | {fmt(dense)} | 1.000 |")
        for label, bk, bv in RATES[1:]:
            per_block = block_bytes(layers, heads, d, bk, bv)
            rows = (n - seg) * window_row_bytes(layers, heads, d)
            with_rows = blocks * per_block + rows
            out.append(f"| {n:,} | {label} | {blocks} blocks + {n - seg} window rows "
                       f"({fmt(rows)}) | {fmt(with_rows)} | {with_rows / dense:.3f} |")
            recompute = full * per_block
            out.append(f"| {n:,} | {label} | {full} blocks; decode recomputes the last "
                       f"{n - full * b} tokens | {fmt(recompute)} | "
                       f"{recompute / dense:.3f} |")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host-gib", type=float, default=64.0, help="host memory for the cache")
    p.add_argument("--tokens", type=int, default=32768, help="tokens per conversation")
    p.add_argument("--prompts", type=int, nargs="+", default=[32768, 32700],
                   help="prompt lengths for the prefill-to-decode table")
    a = p.parse_args(argv)
    print("\n".join(host_table(a.host_gib, a.tokens) + [""] + handoff_table(a.prompts)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
