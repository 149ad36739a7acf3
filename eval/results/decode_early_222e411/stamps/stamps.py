"""Decode kernel phase stamps. Needs a diagnostic build: one of the stamps_*.patch files of
this folder applied to csrc/pq_decode.cuh of its tree, then `python setup.py build_ext --inplace`.
Per CTA: clock64 at entry / books ready / first item start / each warp's loop end (last item)
/ end; globaltimer at entry and end, written past the split results in ws_o. Prints a
breakdown per case and writes JSON (run from the repository root: python stamps.py OUT.json)."""
import json, math, statistics, sys
import torch
sys.path.insert(0, "eval")
import bench_decode as bd
from vllm_pq_backend import ops
from vllm_pq_backend.layout import PageLayout

D = 128
def case(shape, batch, ctx, ms, gen, window=128):
    hq, hkv = bd.SHAPES[shape]
    lay = PageLayout(bd.PQ_BLOCK, *ms)
    code_bytes = batch * ctx * hkv * lay.state_bytes
    n = bd.copies_for(code_bytes)
    tables, blocks = bd.block_table(batch, ctx, bd.PQ_BLOCK, n, gen)
    cache = torch.randint(0, 256, (blocks, hkv, bd.PQ_BLOCK, lay.state_bytes), dtype=torch.uint8, device="cuda", generator=gen)
    bf16 = dict(device="cuda", generator=gen, dtype=torch.bfloat16)
    cb = [torch.randn(hkv, m, 256, D // m, **bf16) for m in ms]
    books = torch.ops.pq_backend.decode_books(*cb)
    rows = torch.arange(batch, dtype=torch.int32, device="cuda")
    win = [torch.randn(batch, hkv, window, D, **bf16) for _ in range(2)]
    q = torch.randn(batch, hq, D, **bf16)
    new_kv = [torch.randn(batch, hkv, D, **bf16) for _ in range(2)]
    out = torch.empty_like(q)
    seq = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = ops.num_splits_for(batch, ops.ctas_per_split(hq, hkv), sms)
    ctas = ops.num_ctas_for(ops.ctas_per_split(hq, hkv), sms)
    used = batch * hq * splits * D
    ws_o = torch.zeros(used + 2 * 24 * 4096, device="cuda")
    ws_lse = torch.empty(batch * hq * splits, device="cuda")
    def run(i):
        torch.ops.pq_backend.decode(out, q, cache, tables[i], seq, cb[0], cb[1], books, win[0], win[1], rows,
                                    new_kv[0], new_kv[1], window, 0, splits, ops.MIN_SPLIT_TOKENS, ctas, D**-0.5,
                                    False, ws_o, ws_lse, *lay.kernel_args())
    us = bd.timed(run, n)
    torch.cuda.synchronize()
    ngrid = min(ctas, batch * splits) * (hkv * -(-(hq // hkv) // 8))
    st = ws_o[used:used + 2 * 24 * ngrid].view(torch.int64).view(ngrid, 24).cpu().tolist()
    kern, _ = bd.kernel_times(run, n, reps=20), None
    return us, splits, ctas, st, kern

def summarize(st):
    busy = [s for s in st if s[18] > 0]
    g0 = min(s[0] for s in st); gend = max(s[16] for s in st)
    # clocks per ns from the whole CTA span
    rate = statistics.median([(s[15] - s[1]) / max(1, s[16] - s[0]) for s in busy])
    f = lambda c: c / rate / 1e3  # cycles -> us
    out = dict(span_us=(gend - g0) / 1e3, ghz=rate, n_ctas=len(st), n_busy=len(busy))
    def stat(xs): xs = sorted(xs); return dict(min=round(xs[0], 2), med=round(xs[len(xs)//2], 2), max=round(xs[-1], 2))
    out['start_skew_us'] = stat([(s[0] - g0) / 1e3 for s in st])
    out['end_us'] = stat([(s[16] - g0) / 1e3 for s in busy])
    out['books_wait_us'] = stat([f(s[2] - s[1]) for s in busy if s[2]])
    out['first_item_at_us'] = stat([f(s[19] - s[1]) for s in busy if s[19]])
    out['loop_us'] = stat([f(max(s[3:15]) - s[2]) for s in busy if s[2]])
    out['warp_spread_us'] = stat([f(max(s[3:15]) - min(s[3:15])) for s in busy])
    out['tail_us'] = stat([f(s[15] - max(s[3:15])) for s in busy])
    out['items'] = stat([s[18] for s in busy])
    out['pair'] = stat([s[20] for s in st])
    return out

assert ops.kernels_available()
gen = torch.Generator(device="cuda"); gen.manual_seed(0)
res = []
for shape in ("qwen2.5-7b", "llama3-8b"):
    for ctx, batch in ((32768, 8), (32768, 64), (1024, 64), (1024, 8), (8192, 8)):
        for bits, ms in (("4", (64, 64)), ("2", (32, 32))):
            if ctx == 1024 and bits == "2": continue
            us, splits, ctas, st, kern = case(shape, batch, ctx, ms, gen)
            s = summarize(st)
            r = dict(shape=shape, context=ctx, batch=batch, bits=bits, graph_us=round(us, 2), splits=splits, ctas=ctas, kernels=kern, **s)
            res.append(r); print(json.dumps(r), flush=True)
json.dump(dict(device=torch.cuda.get_device_name(), rows=res), open(sys.argv[1], "w"), indent=1)
