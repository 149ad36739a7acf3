"""The CUDA kernels' custom ops (``torch.ops.pq_backend.*``, csrc/pq_binding.cpp): one typed
wrapper each, next to its fake (the output shapes torch.compile and meta tensors see), and
the exact store's Triton kernels (exact.py) where the ops' results need them.
fallback.py has a PyTorch function of the same signature for each op the backend can run
without the kernels."""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from . import exact, kernels
from .layout import PageLayout

_FAKES = {}


def _fake(name: str):
    def register(fn):
        _FAKES[name] = fn
        return fn

    return register


@functools.cache
def available() -> bool:
    """The kernels are loaded (kernels.load: built in place or just in time; an error, not
    a silent fallback, on a GPU without them unless the reference path is asked for)."""
    if kernels.load() is None:
        return False
    for name, fn in _FAKES.items():
        torch.library.register_fake(f"pq_backend::{name}")(fn)
    return True


def check_page(kv_cache: Tensor, layout: PageLayout) -> None:
    """The pages hold ``layout``'s bytes per token: the ops check the codes' offsets and
    that the codes fit, not the exact store's bytes after them (layout.py)."""
    if kv_cache.shape[-1] != layout.state_bytes:
        raise ValueError(f"vllm_pq_backend: kv_cache has {kv_cache.shape[-1]} bytes per token, "
                         f"its layout {layout.state_bytes}")


def store(kv_cache: Tensor, key: Tensor, value: Tensor, slot_mapping: Tensor, k_cb: Tensor,
          v_cb: Tensor, k_grid: Tensor, v_grid: Tensor, layout: PageLayout) -> None:
    """Codes of ``key`` / ``value [n, Hkv, D]`` (nearest of the fp32 centroids ``k_cb`` /
    ``v_cb``; the grid records (nearest.py) where not empty) into the pages at
    ``slot_mapping`` (int64, -1 skipped), then the exact store's entries."""
    check_page(kv_cache, layout)
    torch.ops.pq_backend.store(kv_cache, key, value, slot_mapping, k_cb, v_cb, k_grid, v_grid,
                               *layout.kernel_args())
    exact.update(kv_cache, key, value, slot_mapping, k_cb, v_cb, layout)


@_fake("store")
def _(*args) -> None:
    return None


def window_write(win_k: Tensor, win_v: Tensor, key: Tensor, value: Tensor, tokens: Tensor,
                 rows: Tensor, slots: Tensor) -> None:
    """``win_k[rows[i], :, slots[i]] = key[tokens[i]]``, and V alike (int64 indices)."""
    torch.ops.pq_backend.window_write(win_k, win_v, key, value, tokens, rows, slots)


@_fake("window_write")
def _(*args) -> None:
    return None


def dequant_pages(kv_cache: Tensor, block_ids: Tensor, first: Tensor | None, k_cb: Tensor,
                  v_cb: Tensor, extra_pages: int, layout: PageLayout) -> tuple[Tensor, Tensor]:
    """``(k, v)``: the pages ``block_ids`` dequantized to ``k_cb``'s dtype in FlashAttention's
    paged layout ``[pages + extra_pages, B, Hkv, D]``, in one pass over the codes and one
    write of the result. With ``first`` (plans.first_occurrence of the block ids) only the
    first entry of each block id is written (requests sharing a cached prefix); the
    ``extra_pages`` after them are left unwritten. Launched from C++: about 38 us of host
    time a layer, where a Triton launch took 116 us. The exact store's residuals are
    added after (exact.add_to_pages)."""
    check_page(kv_cache, layout)
    ids = block_ids.reshape(-1)
    k, v = torch.ops.pq_backend.dequant_pages(kv_cache, ids, first, k_cb, v_cb, extra_pages,
                                              *layout.kernel_args())
    exact.add_to_pages(k, v, kv_cache, ids, first, layout)
    return k, v


@_fake("dequant_pages")
def _(kv_cache, block_ids, first, k_cb, v_cb, extra_pages, *layout):
    k = k_cb.new_empty((block_ids.shape[0] + extra_pages, kv_cache.shape[2], k_cb.shape[0],
                        k_cb.shape[1] * k_cb.shape[3]))
    return k, torch.empty_like(k)


def own_subpages(k: Tensor, v: Tensor, first: int, keys: Tensor, values: Tensor,
                 at: Tensor) -> None:
    """Rows ``first + i`` of ``k`` / ``v`` (contiguous ``[*, Hkv, D]``): row ``at[i]`` of
    ``keys`` / ``values`` (``[n, Hkv, D]``, any row stride), zeros where ``at[i] < 0``."""
    hkv, d = k.shape[-2], k.shape[-1]
    torch.ops.pq_backend.own_subpages(k.view(-1, hkv, d), v.view(-1, hkv, d), first, keys,
                                      values, at)


@_fake("own_subpages")
def _(*args) -> None:
    return None


def decode_books(k_cb: Tensor, v_cb: Tensor) -> Tensor:
    """The decode kernel's shared-memory image of a layer's codebooks (csrc/pq_decode.cuh),
    ``[Hkv, bytes]`` uint8, empty at head_dim 256 (whose decode reads the codebooks)."""
    return torch.ops.pq_backend.decode_books(k_cb, v_cb)


@_fake("decode_books")
def _(k_cb, v_cb):
    ctx = torch.library.get_ctx()  # the image's size is the kernel's choice
    return k_cb.new_empty((ctx.new_dynamic_size(), ctx.new_dynamic_size()), dtype=torch.uint8)


def decode(out: Tensor, q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor,
           order: Tensor, k_cb: Tensor, v_cb: Tensor, books: Tensor, win_k: Tensor,
           win_v: Tensor, rows: Tensor, new_k: Tensor, new_v: Tensor, *, window: int,
           sliding_window: int, num_splits: int, min_split: int, num_ctas: int, scale: float,
           sinks: Tensor, lut: bool, ws_o: Tensor, ws_lse: Tensor, corr: Tensor, corr_slots: int,
           layout: PageLayout) -> None:
    """Attention of one query row per request (``q [requests, Hq, D]``) over its context:
    the codes in its pages, and with ``window > 0`` the window store's row ``rows[r]``,
    into which ``new_k`` / ``new_v`` (the step's rows) are written first. The requests are
    taken in ``order``, their codes in ``num_splits`` splits of at least ``min_split``
    tokens by ``num_ctas`` CTAs per KV head group (plans.DecodePlan), the split results in
    ``ws_o`` / ``ws_lse``; ``lut``: scores by lookup tables (ops.lut_scores). ``sinks``
    ``[Hq]`` (float32 or ``q``'s dtype; empty: none): each head's attention sink, which
    joins every query's softmax denominator once (reference.add_sink). ``corr`` ``[R, Hq,
    corr_slots, D + 2]`` (empty: none): the exact store's corrections
    (exact.decode_corrections), added in the merge."""
    check_page(kv_cache, layout)
    torch.ops.pq_backend.decode(
        out, q, kv_cache, block_table, seq_lens, order, k_cb, v_cb, books, win_k, win_v, rows,
        new_k, new_v, window, sliding_window, num_splits, min_split, num_ctas, scale, sinks,
        lut, ws_o, ws_lse, corr, corr_slots, *layout.kernel_args())


@_fake("decode")
def _(*args) -> None:
    return None


def map_rows(out: list[Tensor], x: list[Tensor], t: list[Tensor]) -> None:
    """``out[i] = x[i]`` through the maps ``t[i] [maps, D, D]`` (fp32; head ``h`` uses map
    ``h // (heads // maps)``), in one launch; ``out[i]`` may be ``x[i]``. Each row's fp32
    sums run in a fixed order: a row's result does not depend on the batch."""
    torch.ops.pq_backend.map(out, x, t)


@_fake("map")
def _(*args) -> None:
    return None
