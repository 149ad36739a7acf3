"""The execution path without the CUDA kernels: what serving runs on the CPU, and on a GPU
with ``VLLM_PQ_ALLOW_REFERENCE=1`` (kernels.py). The reference's definitions (reference.py)
applied to vLLM's metadata: a PyTorch function of the same signature for each custom op
(cuda_ops.py), and decode and prefill attention request by request (slow).
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import reference
from .layout import PageLayout
from .plans import FallbackPlan


def store(kv_cache: Tensor, key: Tensor, value: Tensor, slot_mapping: Tensor, k_cb: Tensor,
          v_cb: Tensor, k_grid: Tensor, v_grid: Tensor, layout: PageLayout) -> None:
    """cuda_ops.store by the full search (the grid records only speed the kernel up), and
    the exact store's entries."""
    reference.store(kv_cache, key, value, slot_mapping, k_cb, v_cb, layout)
    reference.exact_update(kv_cache, key, value, slot_mapping, k_cb, v_cb, layout)


def window_write(win_k: Tensor, win_v: Tensor, key: Tensor, value: Tensor, tokens: Tensor,
                 rows: Tensor, slots: Tensor) -> None:
    reference.window_write(win_k, win_v, key, value, tokens, rows, slots)


def dequant_pages(kv_cache: Tensor, block_ids: Tensor, first: Tensor | None, k_cb: Tensor,
                  v_cb: Tensor, extra_pages: int, layout: PageLayout) -> tuple[Tensor, Tensor]:
    """cuda_ops.dequant_pages, every entry written (``first`` only saves the kernel work)."""
    k, v = reference.dequant_pages(kv_cache, block_ids.reshape(-1), k_cb, v_cb, layout)
    extra = k.new_empty((extra_pages, *k.shape[1:]))
    return torch.cat([k, extra]), torch.cat([v, extra])


def own_subpages(k: Tensor, v: Tensor, first: int, keys: Tensor, values: Tensor,
                 at: Tensor) -> None:
    n = at.numel()
    hkv, d = k.shape[-2], k.shape[-1]
    reference.check_index("at", at, -1, keys.shape[0])
    if first < 0 or first + n > k.view(-1, hkv, d).shape[0]:
        raise ValueError(f"vllm_pq_backend: rows {first}..{first + n} are outside k's "
                         f"{k.view(-1, hkv, d).shape[0]} rows")
    live, src = (at >= 0)[:, None, None], at.clamp(min=0)
    for out, rows in ((k, keys), (v, values)):
        out.view(-1, hkv, d)[first : first + n] = torch.where(live, rows[src], 0)


def map_rows(out: list[Tensor], x: list[Tensor], t: list[Tensor]) -> None:
    for o, xi, ti in zip(out, x, t):
        o.copy_(reference.map_rows(ti, xi))


def decode(out, query, key, value, kv_cache, md, st, scale: float) -> None:
    """The step's decodes (rows ``[:md.num_decodes]``, one per request): their rows into
    the window store, then the reference's attention."""
    nd, w = md.num_decodes, st.window
    if w > 0:
        window_write(st.win_k, st.win_v, key, value, torch.arange(nd, device=key.device),
                     md.req_rows[:nd], (md.seq_lens[:nd] - 1) % w)
    res = reference.attention(
        query[:nd], key[:nd], value[:nd], kv_cache, st.k_cb32, st.v_cb32, st.layout,
        md.query_start_loc_cpu[: nd + 1].tolist(), md.seq_lens_cpu[:nd].tolist(),
        md.block_table[:nd], scale, w, st.win_k, st.win_v,
        md.req_rows_cpu[:nd] if w > 0 else None, st.sliding_window, st.sinks,
    )
    out[:nd] = res.to(out.dtype)


def prefill(plan: FallbackPlan, out, q, k, v, kv_cache, st, scale: float) -> None:
    """One group's prefill rows by the reference's attention."""
    res = reference.attention(
        q, k, v, kv_cache, st.k_cb32, st.v_cb32, st.layout, plan.query_start_loc,
        plan.seq_lens, plan.block_table, scale, st.window, st.win_k, st.win_v, plan.rows,
        st.sliding_window, st.sinks,
    )
    out.copy_(res.to(out.dtype))
