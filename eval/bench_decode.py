"""Decode attention side by side at Llama-3-8B shapes (32 query heads, 8 KV heads, d=128;
``--shape qwen2.5-7b``: 28 query heads, 4 KV heads; ``--shape gpt-oss``: 64 query heads, 8
KV heads, d=64, with --no-turboquant):
CUSTOM (PQ CUDA kernels, window 128 or --window) vs FA3 paged decode (vllm_flash_attn, bf16 K/V,
pages of 16 and 128 tokens, the faster reported) vs TURBOQUANT 4bit_nc decode (Triton),
with a device-to-device copy measured in the same run as the bandwidth ceiling.

Each kernel is captured in a CUDA graph (as vLLM serves decode) and timed with CUDA
events after warm-up; inputs rotate across copies so that small cases are not served
from L2. Random data everywhere (no zeros).

    python eval/bench_decode.py --out eval/results/decode_kernel.json

--mix LO HI gives each request its own context, drawn uniformly from LO..HI tokens (the
same lengths for every backend), as a serving batch has; CUSTOM is then also timed with its
requests dealt to the CTAs in the batch's order instead of longest first (custom_batch_order_us):

    python eval/bench_decode.py --mix 4096 13824 --batches 16 32 64 128 256 --out eval/results/decode_mix.json

--g-sweep instead compares the two ways of scoring keys, tensor-core MMA over K
dequantized from the codebook vs Q.centroid lookup tables (LUT, built for g = 1 only),
at g = 1, 4, 8 query heads per KV head (8 KV heads), with FA3 at the same shapes:

    python eval/bench_decode.py --g-sweep --out eval/results/decode_g_sweep.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from typing import NamedTuple

import numpy as np
import torch
from common import provenance, write_result

HQ, HKV, D = 32, 8, 128
SHAPES = {"llama3-8b": (32, 8, 128), "qwen2.5-7b": (28, 4, 128), "gpt-oss": (64, 8, 64),  # (Hq, Hkv, d)
          # Qwen3 applies QK-norm inside the model, before attention: the kernel sees plain
          # keys of Llama-3-8B's shape
          "qwen3-8b": (32, 8, 128)}
WINDOW, PQ_BLOCK = 128, 128
L2_FLUSH = 256 << 20  # rotate inputs until they span this many bytes


def timed(fn_for_copy, n_copies: int, reps: int = 10, trials: int = 7) -> float:
    """Median microseconds of one call; calls cycle over the input copies."""
    return timed_together([fn_for_copy], n_copies, reps, trials)[0]


def timed_together(fns, n_copies: int, reps: int = 10, trials: int = 7) -> list[float]:
    """Median microseconds of one call of each of ``fns`` (each called with an input copy's
    index), their graphs replayed in turn within each trial, the order rotated from trial
    to trial: variants compared on the same inputs and the same clocks, so that a few
    percent between them is theirs and not the machine's drift."""
    graphs = []
    for fn in fns:
        fn(0)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(reps):
                fn(i % n_copies)
        graph.replay()
        graphs.append(graph)
    torch.cuda.synchronize()
    times = [[] for _ in fns]
    for t in range(trials):
        for k in range(len(fns)):
            j = (k + t) % len(fns)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graphs[j].replay()
            b.record()
            b.synchronize()
            times[j].append(a.elapsed_time(b) * 1e3 / reps)
    return [statistics.median(x) for x in times]


def copy_bandwidth() -> float:
    src = torch.randn(1 << 29, device="cuda")  # 2 GiB
    dst = torch.empty_like(src)
    us = timed(lambda i: dst.copy_(src), 1, reps=5)
    return 2 * src.numel() * 4 / (us * 1e-6) / 1e9  # bytes read + written


def block_table(batch, ctx, block, n_copies, gen):
    torch.cuda.empty_cache()  # the previous case's buffers are gone: give their memory back
    per = math.ceil(ctx / block)
    total = batch * per * n_copies + 1
    perm = torch.randperm(total - 1, generator=gen, device="cuda").int() + 1
    return perm.view(n_copies, batch, per), total


def copies_for(nbytes: int) -> int:
    return max(1, min(8, math.ceil(L2_FLUSH / max(nbytes, 1))))


SINKS_TIMING = ("with and without sinks on the same inputs, their CUDA graphs replayed in turn, "
                "median of 15 trials each")
EXACT_TIMING = ("with and without the exact store's corrections on the same pages, their CUDA "
                "graphs replayed in turn, median of 15 trials each")


class PQTime(NamedTuple):
    us: float
    must_read: int  # bytes
    splits: int
    kernels: dict  # kernel_times, when asked
    sinks_us: float  # with an attention sink per query head, when asked
    exact_us: float = math.nan  # with the exact store's corrections, when asked


def bench_pq(batch, ctx, ms, gen, hq=HQ, hkv=HKV, lut=False, per_item=False, min_split=None, kernels=False,
             window=WINDOW, lens=None, order=True, sinks=False, d=D, exact=0):
    """``ms``: (Mk, Mv), K and V subspaces per head; ``per_item``: a CTA per (request,
    split) item instead of the backend's CTAs that take items in turn; ``min_split``: the
    kernel's shortest split (default the backend's, 0: even splits); ``kernels``: also each
    kernel's own device time (kernel_times); ``lens``: each request's context (default
    ``ctx`` for all); ``order``: requests dealt to the CTAs longest first, as the backend
    does (False: in the batch's order); ``sinks``: also with an attention sink per query
    head (gpt-oss), timed together with the run without on the same inputs (PQTime.sinks_us);
    ``exact``: also with an exact store of that many entries per page and KV head, every
    entry live, its corrections computed and merged (PQTime.exact_us), timed together with
    the run without on the same pages."""
    from vllm_pq_backend import cuda_ops, plans, reference
    from vllm_pq_backend import exact as exact_store
    from vllm_pq_backend.layout import PageLayout

    assert cuda_ops.available(), "build the CUDA kernels first"
    lay = PageLayout(PQ_BLOCK, *ms, d, exact)
    lens = [ctx] * batch if lens is None else lens
    code_bytes = sum(lens) * hkv * lay.state_bytes
    n = copies_for(code_bytes)
    tables, blocks = block_table(batch, ctx, PQ_BLOCK, n, gen)
    cache = torch.randint(0, 256, (blocks, hkv, PQ_BLOCK, lay.state_bytes), dtype=torch.uint8,
                          device="cuda", generator=gen)
    bf16 = dict(device="cuda", generator=gen, dtype=torch.bfloat16)
    cb = [torch.randn(hkv, m, 256, d // m, **bf16) for m in ms]
    books = torch.ops.pq_backend.decode_books(*cb)  # the kernel's shared-memory image, once
    rows = torch.arange(batch, dtype=torch.int32, device="cuda")
    win = [torch.randn(batch, hkv, max(window, 1), d, **bf16) for _ in range(2)]
    q = torch.randn(batch, hq, d, **bf16)
    new_kv = [torch.randn(batch, hkv, d, **bf16) for _ in range(2)]  # the kernel writes them
    out = torch.empty_like(q)
    seq = torch.tensor(lens, dtype=torch.int32, device="cuda")
    order_t = (torch.from_numpy(plans.decode_order(np.array(lens))).cuda() if order
               else seq.new_empty(0))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = plans.num_splits_for(batch, plans.ctas_per_split(hq, hkv), sms)
    min_split = plans.MIN_SPLIT_TOKENS if min_split is None else min_split
    ctas = 0 if per_item else plans.num_ctas_for(plans.ctas_per_split(hq, hkv), sms)
    ws_o = torch.empty(batch * hq * splits * d, device="cuda")
    ws_lse = torch.empty(batch * hq * splits, device="cuda")
    def run(i, sink=q.new_empty(0), corr=q.new_empty(0)):
        torch.ops.pq_backend.decode(out, q, cache, tables[i], seq, order_t, cb[0], cb[1], books, win[0], win[1],
                                    rows, new_kv[0], new_kv[1], window, 0, splits, min_split, ctas,
                                    d**-0.5, sink, lut, ws_o, ws_lse, corr, splits if corr.numel() else 0,
                                    *lay.kernel_args())

    exact_us = math.nan
    if sinks:
        sink = torch.randn(hq, **bf16)
        us, sinks_us = timed_together([run, lambda i: run(i, sink)], n, trials=15)  # SINKS_TIMING
    elif exact:
        for which in (0, 1):  # every entry live: distinct in-page indices, some error
            res, err, idx = reference.exact_entries(cache, lay, which, torch.bfloat16)
            res.copy_(0.05 * torch.randn(res.shape, **bf16))
            err.fill_(1.0)
            idx.copy_(torch.arange(exact, device="cuda") * (PQ_BLOCK // exact))
        corr = torch.empty(batch * hq * splits * exact_store.corr_floats(d), device="cuda")

        def run_exact(i):
            exact_store.decode_corrections(corr, q, cache, tables[i], seq, cb[0], cb[1],
                                           window=window, sliding_window=0, scale=d**-0.5,
                                           slots=splits, layout=lay)
            run(i, corr=corr)

        us, exact_us = timed_together([run, run_exact], n, trials=15)  # EXACT_TIMING
        sinks_us = math.nan
    else:
        us, sinks_us = timed(run, n), math.nan
    must_read = code_bytes + 2 * hkv * 256 * d * 2  # codes + codebooks once
    return PQTime(us, must_read, splits, kernel_times(run, n) if kernels else {}, sinks_us, exact_us)


def kernel_times(fn_for_copy, n_copies: int, reps: int = 20) -> dict:
    """Device microseconds per call of each CUDA kernel ``fn_for_copy`` launches, by kernel
    (torch.profiler, eager launches after the graph-timed run: the kernels' own durations;
    the graph's time less their sum is what launching and the gaps between them cost)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(reps):
            fn_for_copy(i % n_copies)
        torch.cuda.synchronize()
    times = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            name = e.name.split("<")[0].split("::")[-1].removeprefix("void ")
            times[name] = times.get(name, 0.0) + e.time_range.elapsed_us() / reps
    return {k: round(v, 2) for k, v in times.items()}


def bench_fa3(batch, ctx, block, gen, hq=HQ, hkv=HKV, lens=None, d=D, sinks=False):
    from vllm.v1.attention.backends.fa_utils import flash_attn_varlen_func

    lens = [ctx] * batch if lens is None else lens
    kv_bytes = sum(lens) * hkv * d * 2 * 2
    n = copies_for(kv_bytes)
    tables, blocks = block_table(batch, ctx, block, n, gen)
    bf16 = dict(device="cuda", generator=gen, dtype=torch.bfloat16)
    k = torch.randn(blocks, block, hkv, d, **bf16)
    v = torch.randn(blocks, block, hkv, d, **bf16)
    q = torch.randn(batch, hq, d, **bf16)
    out = torch.empty_like(q)
    cu_q = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    seq = torch.tensor(lens, dtype=torch.int32, device="cuda")
    extra = dict(s_aux=torch.randn(hq, **bf16)) if sinks else {}  # FA3 takes bfloat16 sinks

    def run(i):
        flash_attn_varlen_func(q=q, k=k, v=v, out=out, cu_seqlens_q=cu_q, max_seqlen_q=1,
                               seqused_k=seq, max_seqlen_k=ctx, softmax_scale=d**-0.5,
                               causal=True, block_table=tables[i], fa_version=3, **extra)

    return timed(run, n), kv_bytes


def bench_turboquant(batch, ctx, gen, hq=HQ, hkv=HKV):
    from vllm.model_executor.layers.quantization.turboquant.centroids import get_centroids
    from vllm.model_executor.layers.quantization.turboquant.config import TurboQuantConfig
    from vllm.v1.attention.backends.turboquant_attn import _build_hadamard
    from vllm.v1.attention.ops.triton_turboquant_decode import triton_turboquant_decode_attention

    cfg = TurboQuantConfig.from_cache_dtype("turboquant_4bit_nc", D)
    block = 16
    slot = cfg.slot_size_aligned
    n = copies_for(batch * ctx * hkv * slot)
    tables, blocks = block_table(batch, ctx, block, n, gen)
    cache = torch.randint(0, 256, (blocks, block, hkv, slot), dtype=torch.uint8, device="cuda",
                          generator=gen)
    pi = _build_hadamard(D, "cuda")
    cents = get_centroids(D, cfg.centroid_bits).to("cuda", torch.float32)
    q = torch.randn(batch, hq, D, device="cuda", generator=gen, dtype=torch.bfloat16)
    seq = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")

    def run(i):
        triton_turboquant_decode_attention(
            query=q, kv_cache=cache, block_table=tables[i], seq_lens=seq, Pi=pi,
            centroids=cents, scale=D**-0.5, mse_bits=cfg.key_mse_bits,
            key_packed_size=cfg.key_packed_size, value_quant_bits=cfg.effective_value_quant_bits,
            key_fp8=cfg.key_fp8, norm_correction=cfg.norm_correction, PiT=pi.T.contiguous(),
        )

    us = timed(run, n)
    return us, batch * ctx * hkv * slot


def g_sweep(args, gen) -> list[dict]:
    """MMA vs LUT scores at g = 1, 4, 8 (8 KV heads), FA3 alongside."""
    rows = []
    print("g context batch bits | mma_us  lut_us  fa3_us | lut/mma  x_fa3(best)")
    for g in (1, 4, 8):
        for ctx in args.contexts:
            for batch in args.batches:
                fa = min(bench_fa3(batch, ctx, blk, gen, hq=8 * g, hkv=8)[0] for blk in (16, 128))
                for bits, ms in args.settings:
                    mma, _, splits, *_ = bench_pq(batch, ctx, ms, gen, hq=8 * g, hkv=8, lut=False)
                    lut = bench_pq(batch, ctx, ms, gen, hq=8 * g, hkv=8, lut=True)[0] if g == 1 else None
                    best = min(mma, lut or mma)
                    rows.append(dict(g=g, context=ctx, batch=batch, bits=bits, M_k=ms[0], M_v=ms[1],
                                     mma_us=round(mma, 2),
                                     lut_us=lut and round(lut, 2), fa3_us=round(fa, 2),
                                     speedup_vs_fa3=round(fa / best, 3), splits=splits))
                    print(f"{g} {ctx:7d} {batch:5d} {bits:>4} | {mma:7.1f} {lut or float('nan'):7.1f} {fa:7.1f} | "
                          f"{(lut or float('nan')) / mma:6.3f} {fa / best:6.2f}", flush=True)
    return rows


def _num(x: float, digits: int):
    return None if math.isnan(x) else round(x, digits)  # None: not measured (--no-turboquant)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", type=int, nargs="+")
    p.add_argument("--batches", type=int, nargs="+")
    p.add_argument("--bits", nargs="+", default=["4", "2"],
                   help="CUSTOM settings, bits per element: 4, 2, or K/V as 4/2")
    p.add_argument("--shape", choices=SHAPES, default="llama3-8b")
    p.add_argument("--no-turboquant", action="store_true", help="CUSTOM and FA3 only")
    p.add_argument("--g-sweep", action="store_true", help="MMA vs LUT scores at g = 1, 4, 8")
    p.add_argument("--per-item", action="store_true",
                   help="also time CUSTOM with a CTA per (request, split) item (custom_per_item_us)")
    p.add_argument("--min-split", type=int, default=None,
                   help="the kernel's shortest split in tokens (default the backend's; 0: even splits)")
    p.add_argument("--window", type=int, default=WINDOW,
                   help="CUSTOM's full-precision window in tokens (0: every key from the codes)")
    p.add_argument("--kernel-times", action="store_true",
                   help="also each CUDA kernel's own device time per call (custom_kernel_us, torch.profiler)")
    p.add_argument("--mix", type=int, nargs=2, metavar=("LO", "HI"),
                   help="each request's context drawn uniformly from LO..HI tokens (seeded; in place of "
                        "--contexts); CUSTOM also timed with its requests in the batch's order")
    p.add_argument("--sinks", action="store_true",
                   help="also time CUSTOM with an attention sink per query head, as gpt-oss has "
                        "(custom_sinks_us), on custom_us's inputs, the two runs alternating")
    p.add_argument("--batch-order", action="store_true",
                   help="also time CUSTOM with its requests dealt in the batch's order (custom_batch_order_us; "
                        "always with --mix)")
    p.add_argument("--exact", type=int, default=0,
                   help="also time CUSTOM with an exact store of this many entries per page and "
                        "KV head (its corrections merged), beside the run without")
    p.add_argument("--out", default="eval/results/decode_kernel.json")
    args = p.parse_args()
    from vllm_pq_backend import plans
    from vllm_pq_backend.layout import subspaces

    hq, hkv, d = SHAPES[args.shape]
    if d != D and not (args.no_turboquant or args.g_sweep):
        p.error(f"--shape {args.shape} (head_dim {d}) times CUSTOM and FA3 only: add --no-turboquant")
    args.settings = []
    for b in args.bits:  # "4/2" -> K 4 bits, V 2 bits
        bk, _, bv = b.partition("/")
        args.settings.append((b, (subspaces(d, int(bk)), subspaces(d, int(bv or bk)))))
    if args.contexts is None:
        args.contexts = [4096, 32768] if args.g_sweep else [1024, 4096, 16384, 32768, 65536, 131072]
    if args.batches is None:
        args.batches = [1, 8, 32] if args.g_sweep else [1, 8, 32, 64]
    gen = torch.Generator(device="cuda").manual_seed(0)
    stamp = provenance()
    if args.g_sweep:
        rows = g_sweep(args, gen)
        write_result(args.out, dict(stamp, head_dim=D, kv_heads=8, pq_block=PQ_BLOCK, window=WINDOW, rows=rows))
        return 0
    copy_gbs = copy_bandwidth()
    nan = float("nan")
    rows = []
    print(f"device {torch.cuda.get_device_name()}, copy {copy_gbs:.0f} GB/s (read+write)", flush=True)
    print("context batch bits | custom_us  fa3_us(b16/b128)  tq_us | x_fa3 x_tq | custom GB/s (% copy)")
    if args.mix:
        if not args.no_turboquant:
            p.error("--mix times CUSTOM and FA3 only: add --no-turboquant")
        lo, hi = args.mix
        draw = np.random.default_rng(0)
        cases = [(round((lo + hi) / 2), b, draw.integers(lo, hi + 1, b).tolist()) for b in args.batches]
    else:
        cases = [(ctx, b, None) for ctx in args.contexts for b in args.batches]
    for ctx, batch, lens in cases:
        top = ctx if lens is None else max(lens)
        fa16, fa_bytes = bench_fa3(batch, top, 16, gen, hq, hkv, lens, d=d)
        fa128, _ = bench_fa3(batch, top, 128, gen, hq, hkv, lens, d=d)
        fa_sinks = (min(bench_fa3(batch, top, b, gen, hq, hkv, lens, d=d, sinks=True)[0]
                        for b in (16, 128)) if args.sinks else nan)
        tq, tq_bytes = (nan, 0) if args.no_turboquant else bench_turboquant(batch, ctx, gen, hq, hkv)
        for bits, ms in args.settings:
            us, must, splits, ktimes, with_sinks, with_exact = bench_pq(
                batch, top, ms, gen, hq, hkv, min_split=args.min_split, kernels=args.kernel_times,
                window=args.window, lens=lens, sinks=args.sinks, d=d, exact=args.exact)
            per_item = (bench_pq(batch, top, ms, gen, hq, hkv, per_item=True, min_split=args.min_split,
                                 window=args.window, lens=lens, d=d)[0]
                        if args.per_item else nan)
            batch_order = (bench_pq(batch, top, ms, gen, hq, hkv, min_split=args.min_split,
                                    window=args.window, lens=lens, order=False, d=d)[0]
                           if lens is not None or args.batch_order else nan)
            fa = min(fa16, fa128)
            gbs = must / (us * 1e-6) / 1e9
            rows.append(dict(
                context=ctx, batch=batch, bits=bits, M_k=ms[0], M_v=ms[1], custom_us=round(us, 2), fa3_us=round(fa, 2),
                fa3_block16_us=round(fa16, 2), fa3_block128_us=round(fa128, 2),
                turboquant_us=_num(tq, 2), speedup_vs_fa3=round(fa / us, 3),
                speedup_vs_turboquant=_num(tq / us, 3), custom_gbs=round(gbs, 1),
                custom_bytes=must, fa3_gbs=round(fa_bytes / (fa * 1e-6) / 1e9, 1),
                turboquant_gbs=_num(tq_bytes / (tq * 1e-6) / 1e9, 1), copy_gbs=round(copy_gbs, 1),
                custom_pct_copy=round(100 * gbs / copy_gbs, 1), splits=splits,
                min_split=plans.MIN_SPLIT_TOKENS if args.min_split is None else args.min_split,
                custom_per_item_us=_num(per_item, 2), custom_batch_order_us=_num(batch_order, 2),
                custom_sinks_us=_num(with_sinks, 2), fa3_sinks_us=_num(fa_sinks, 2),
                sinks_speedup_vs_fa3=_num(fa_sinks / with_sinks, 3),
                **(dict(exact=args.exact, custom_exact_us=round(with_exact, 2),
                        exact_speedup_vs_fa3=round(fa / with_exact, 3)) if args.exact else {}),
                **(dict(lens=lens, mix=args.mix) if lens is not None else {}),
                **(dict(custom_kernel_us=ktimes) if args.kernel_times else {}),
            ))
            print(f"{ctx:7d} {batch:5d} {bits:>4} | {us:9.1f} {fa16:8.1f}/{fa128:<8.1f} {tq:8.1f} | "
                  f"{fa / us:5.2f} {tq / us:5.2f} | {gbs:7.0f} ({100 * gbs / copy_gbs:4.1f}%)"
                  + (f" | batch order {batch_order:.1f}" if not math.isnan(batch_order) else "")
                  + (f" | sinks {with_sinks:.1f} (fa3 {fa_sinks:.1f})" if not math.isnan(with_sinks)
                     else "")
                  + (f" | exact {args.exact}: {with_exact:.1f}" if args.exact else ""), flush=True)
        result = dict(stamp, shapes=dict(model=args.shape, q_heads=hq, kv_heads=hkv, head_dim=d, pq_block=PQ_BLOCK,
                      window=args.window), copy_gbs=round(copy_gbs, 1), rows=rows,
                      **(dict(sinks_timing=SINKS_TIMING) if args.sinks else {}),
                      **(dict(exact_timing=EXACT_TIMING) if args.exact else {}))
        with open(args.out, "w") as f:  # after each case: a cut-short run keeps its rows
            json.dump(result, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
