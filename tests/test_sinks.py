"""Attention sinks (gpt-oss): each query head's learned logit joins every row's softmax
denominator once, with no value,

    out = sum_j exp(q.k_j scale - m) v_j / (exp(sink_h - m) + sum_j exp(q.k_j scale - m)),

(vLLM's ``sinks``, in the natural-log units of the scaled scores) checked row by row against
that formula over the full-precision keys of the window and the dequantized codes before it:
on the CPU path, on every GPU prefill path with PyTorch stand-ins for FlashAttention and
vLLM's Triton attention (the codes kernel in Triton's interpreter), and on a GPU with the
real kernels. Every check also proves itself able to see the sink counted twice (as it
would be if each of two merged partial results counted it).

The tests give the impl its ``sinks`` after construction, as its constructor does from
vLLM's kwargs, so that one layer can be run with and without them.
"""

import pytest
import torch

from helpers import INTERPRETED, Sim, use_gpu_paths, vllm_config
from test_golden_steps import SCENARIOS

from vllm_pq_backend import reference
from vllm_pq_backend.layout import window_start

D, HQ, HKV = 64, 16, 2  # gpt-oss: head_dim 64, 8 query heads per KV head
TOL = 2e-5  # fp32 rounding, relative to a row's size (check) or to the largest |v|


def sinks_for(hq: int) -> torch.Tensor:
    """Per-head logits from well below to well above a row's score LSE (about 0 to 6
    here), in the model's dtype as vLLM hands them over."""
    return torch.linspace(-2.0, 8.0, hq).to(torch.bfloat16)


def config(model_factory, block, window, hq=HQ, hkv=HKV):
    return vllm_config(model_factory(D, hq, hkv), block_size=block, pq={"window": window, "m": 16})


def make_sim(vc, *, sinks=(), sliding=None, seed=0, dtype=torch.float32, device="cpu", **kw):
    """A layer with ``sinks`` (default sinks_for; None: no sinks) on ``device``."""
    sim = Sim(vc, dtype=dtype, seed=seed, sliding_window=sliding, device=device, **kw)
    hq = sim.hq
    sinks = sinks_for(hq) if isinstance(sinks, tuple) else sinks
    sim.impl.sinks = None if sinks is None else sinks.to(device)
    return sim


def oracle_parts(sim, rid, window, sinks, last=None):
    """The request's last ``last`` rows (default all) by the formula above in float64:
    keys ``j >= window_start(i)`` at full precision, earlier ones as their codes decode.
    Returns ``(num [rows, Hq, d], keys [rows, Hq], sink [rows, Hq])``, the sums over the
    keys and the sink's term, so that a row is ``num / (sink + keys)``."""
    st = sim.impl._state
    r = sim.reqs[rid]
    q, k, v = (torch.cat(x).double() for x in (r.q, r.k, r.v))
    k_hat = reference.decode_codes(reference.encode(k.float(), st.k_cb32), st.k_cb32).double()
    v_hat = reference.decode_codes(reference.encode(v.float(), st.v_cb32), st.v_cb32).double()
    n, g = k.shape[0], sim.hq // sim.hkv
    pos = torch.arange(n, device=k.device)
    ws = window_start(pos, window)
    s_h = (sinks.double() if sinks is not None
           else torch.full((sim.hq,), float("-inf"), dtype=torch.float64, device=k.device))
    num, keys, sink = [], [], []
    for i in range(n - (n if last is None else last), n):
        lo = max(0, i - sim.sw + 1) if sim.sw else 0
        exact = (pos >= ws[i])[lo : i + 1].view(-1, 1, 1)
        kk = torch.where(exact, k[lo : i + 1], k_hat[lo : i + 1]).repeat_interleave(g, 1)
        vv = torch.where(exact, v[lo : i + 1], v_hat[lo : i + 1]).repeat_interleave(g, 1)
        s = torch.einsum("hd,khd->hk", q[i], kk) * sim.d**-0.5
        m = torch.maximum(s.amax(-1), s_h)
        e = torch.exp(s - m[:, None])
        num.append(torch.einsum("hk,khd->hd", e, vv))
        keys.append(e.sum(-1))
        sink.append(torch.exp(s_h - m))
    return torch.stack(num), torch.stack(keys), torch.stack(sink)


def oracle(sim, rid, window, sinks, times=1, last=None):
    """The rows of oracle_parts with the sink ``times`` in the denominator."""
    num, keys, sink = oracle_parts(sim, rid, window, sinks, last)
    return num / (times * sink + keys)[..., None]


def check(sim, outs, window, tol=TOL):
    """Every (row, query head) of each request's output within ``tol`` of the oracle,
    relative to the row's size without the sink (a sink only scales a row down); and the
    oracle with the sink counted twice outside that bound in some row of the step."""
    sinks = sim.impl.sinks
    for rid, out in outs.items():
        num, keys, sink = oracle_parts(sim, rid, window, sinks, last=out.shape[0])
        want = num / (sink + keys)[..., None]
        bound = tol * (num / keys[..., None]).abs().amax(-1)  # [rows, Hq]
        err = (out.double() - want).abs().amax(-1)
        row, head = divmod(int((err / bound).argmax()), err.shape[1])
        assert (err <= bound).all(), (
            f"request {rid}: row {row}, head {head}, error {err[row, head]:.2e} > {bound[row, head]:.2e}")
        if sinks is not None and torch.isfinite(sinks).any():
            twice = num / (2 * sink + keys)[..., None]
            assert ((twice - want).abs().amax(-1) > bound).any(), "the check cannot see a sink counted twice"


def test_window_covering_every_key_is_exact(model_factory):
    """W = 128 and at most 128 tokens: every key at full precision, so the output is the
    formula itself to fp32 rounding, through prefill, a chunk and decodes of two requests."""
    sim = make_sim(config(model_factory, 128, 128))
    sim.add(0), sim.add(1)
    check(sim, sim.step([(0, 70), (1, 9)]), 128)
    check(sim, sim.step([(0, 30), (1, 1)]), 128)
    for _ in range(4):
        check(sim, sim.step([(0, 1), (1, 1)]), 128)
    # the sinks do act: without them the rows differ well beyond the tolerance
    plain = oracle(sim, 0, 128, None)
    assert (plain - oracle(sim, 0, 128, sim.impl.sinks)).abs().max() > 1e3 * TOL


@pytest.mark.parametrize("hq,hkv", [(HQ, HKV), (4, 2)])
def test_with_codes(model_factory, hq, hkv):
    """W = 32 over 150+ tokens: the keys before each row's window are read through their
    codes, and the sink's share of the denominator is exact against those same codes."""
    sim = make_sim(config(model_factory, 64, 32, hq, hkv), seed=1)
    sim.add(0), sim.add(1)
    check(sim, sim.step([(0, 150), (1, 40)]), 32)
    for _ in range(3):
        check(sim, sim.step([(0, 1), (1, 1)]), 32)


@pytest.mark.parametrize("window", [0, 32])
def test_chunks_and_decodes_match_one_pass(model_factory, window):
    """A prompt in one pass, in uneven chunks (segments straddling windows and pages) or
    its last 40 rows token by token, then decodes: the same rows, each equal to the
    formula."""
    vc, outs = config(model_factory, 64, window), {}
    for name, chunks in {"one": [110], "chunks": [37, 64, 1, 8], "tokens": [70] + [1] * 40}.items():
        sim = make_sim(vc, seed=2)
        sim.add(0)
        res = [sim.step([(0, n)])[0] for n in chunks + [1, 1, 1]]
        check(sim, {0: torch.cat(res)}, window)
        outs[name] = torch.cat(res)
    bound = TOL * torch.cat(sim.reqs[0].v).abs().max()
    for other in ("chunks", "tokens"):
        err = (outs[other] - outs["one"]).abs().max()
        assert err <= bound, f"{other} vs one pass: {err:.2e}"


@pytest.mark.parametrize("block,window,sliding", [(64, 32, 80), (32, 0, 48)])
def test_sliding_window(model_factory, block, window, sliding):
    """A sliding-window layer (key j > i - sw, gpt-oss's other half of layers) with sinks:
    the sink counts once whatever the window leaves of the keys, freed pages unread."""
    sim = make_sim(config(model_factory, block, window), sliding=sliding, seed=3)
    sim.add(0), sim.add(1)
    check(sim, sim.step([(0, 150), (1, 5)]), window)
    check(sim, sim.step([(0, 1), (1, 60)]), window)
    for _ in range(sliding // 16 + 2):
        check(sim, sim.step([(0, 1), (1, 1)]), window)


def test_minus_infinity_sinks_are_no_sinks(model_factory):
    """Sinks of -inf change no bit of any output (add_sink's weight is exactly 1)."""
    vc, outs = config(model_factory, 64, 32), []
    for sinks in (torch.full((HQ,), float("-inf"), dtype=torch.bfloat16), None):
        sim = make_sim(vc, sinks=sinks, seed=4)
        sim.add(0), sim.add(1)
        steps = [[(0, 100), (1, 7)], [(0, 1), (1, 50)], [(0, 1), (1, 1)]]
        outs.append([o for w in steps for o in sim.step(w).values()])
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_partials_merged_then_sink_once(model_factory):
    """The shape of the GPU prefill with codes: a codes part (reference.codes_part) and a
    full-precision window part, each sink-free, merged by LSE, then the sink once
    (add_sink) equals the backend's rows; so does the sink folded into one part first,
    provided that part's LSE counts it. Counting it in both parts does not."""
    window = 32
    sim = make_sim(config(model_factory, 64, window), seed=5)
    sim.add(0)
    got = torch.cat([sim.step([(0, n)])[0] for n in (90, 40)])
    st, r = sim.impl._state, sim.reqs[0]
    q, k, v = (torch.cat(x) for x in (r.q, r.k, r.v))
    n, g, scale = q.shape[0], HQ // HKV, D**-0.5
    table = torch.tensor([r.blocks], dtype=torch.int32)
    o_c, lse_c = reference.codes_part(q, list(range(n)), [0] * n, sim.kv_cache, st.k_cb32,
                                      st.v_cb32, st.layout, table, scale, window)
    # the window part: keys window_start(i) .. i at full precision
    pos = torch.arange(n)
    reads = (pos[None, :] <= pos[:, None]) & (pos[None, :] >= window_start(pos, window)[:, None])
    s = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(g, 1)) * scale
    s = s.masked_fill(~reads, float("-inf"))
    o_w = torch.einsum("hqk,khd->qhd", s.softmax(-1), v.repeat_interleave(g, 1))
    lse_w = torch.logsumexp(s, -1)
    sinks = st.sinks
    bound = TOL * v.abs().max()

    def err(x):
        return (x - got).abs().amax(-1).max()

    once = reference.add_sink(reference.merge(o_w, lse_w, o_c, lse_c),
                              torch.logaddexp(lse_w, lse_c), sinks)[0]
    assert err(once) <= bound
    folded = reference.merge(*reference.add_sink(o_w, lse_w, sinks), o_c, lse_c)
    assert err(folded) <= bound
    both = reference.merge(*reference.add_sink(o_w, lse_w, sinks),
                           *reference.add_sink(o_c, lse_c, sinks))
    assert err(both) > bound


# Each GPU prefill path: (stand-in path, window, batch-invariant, the plan its prefills take)
PATHS = {name: s for name, s in SCENARIOS.items() if s[0] != "cpu"}
ON_GPU = pytest.mark.skipif(not torch.cuda.is_available(),
                            reason="needs a CUDA GPU (run on the GPU machine)")


def schedule(sim, long=0):
    """Prefills, a chunk beside a speculative verification, decodes, two prefix-cache hits
    on one request's blocks and a mixed step; yields each step's outputs. ``long``: the
    first prompt's extra tokens (long contexts, so that decode splits its codes)."""
    for rid in range(3):
        sim.add(rid, max_len=1024 + long)
    yield sim.step([(0, 100 + long), (1, 7)])
    yield sim.step([(0, 1), (1, 60), (2, 129)])
    yield sim.step([(2, 70), (0, 2)])
    yield sim.step([(0, 1), (1, 1), (2, 1)])
    a = sim.reqs[2]
    full = min(2, a.length // sim.B)  # its full blocks, cached
    shared = sim.finish(2, keep_blocks=full)
    for rid in (3, 4):
        b = sim.add(rid, shared_blocks=shared, max_len=1024)
        b.q, b.k, b.v = ([torch.cat(x)[: full * sim.B]] for x in (a.q, a.k, a.v))
    yield sim.step([(0, 1), (3, 40), (4, 9)])
    for _ in range(2):
        yield sim.step([(0, 1), (1, 1), (3, 1), (4, 1)])
    yield sim.step([(1, 1), (4, 33), (3, 1), (0, 5)])


def spy_plans(sim):
    """What the steps run: the names of their prefills' plan types, and each decode
    step's split count (``seen["splits"]``)."""
    seen, build = {"splits": []}, sim.builder.build
    plans = seen["plans"] = set()

    def spy(*args, **kwargs):
        md = build(*args, **kwargs)
        plans.update(type(g.plan).__name__ for g in md.prefills)
        if md.decode is not None:
            seen["splits"].append(md.decode.num_splits)
        return md

    sim.builder.build = spy
    return seen


# every path on a full or a sliding-window layer (key j > i - 80), those that merge on both
CPU_CASES = [("pages_w0", 80), ("segments_w32", None), ("segments_w32", 80), ("codes_w0", None),
             ("codes_w32", None), ("codes_w32", 80), ("bi_w0", 80), ("bi_w32", None)]


@pytest.mark.parametrize("name,sliding", [
    pytest.param(n, sw, marks=INTERPRETED) if PATHS[n][0] == "codes" else (n, sw)
    for n, sw in CPU_CASES])
def test_gpu_prefill_paths_on_the_cpu(model_factory, monkeypatch, name, sliding):
    """Every GPU prefill path takes the sinks once per row: FlashAttention's ``s_aux`` over
    pages or window segments, the codes kernel alone (window 0) or merged by LSE with the
    segments' FlashAttention part that counts the sinks (window 32), vLLM's Triton attention
    in batch-invariant mode; full and sliding-window layers. FlashAttention and Triton's
    attention are PyTorch stand-ins that take sinks as those kernels do (helpers.py); the
    codes kernel runs in Triton's interpreter (float16: its products are 16-bit)."""
    path, window, bi, plan = PATHS[name]
    dtype, tol = (torch.float16, 5e-3) if path == "codes" else (torch.float32, TOL)
    sim = make_sim(config(model_factory, 64, window), sliding=sliding, seed=11, dtype=dtype)
    sim.builder.batch_invariant = bi
    use_gpu_paths(monkeypatch, sim, path)
    seen = spy_plans(sim)
    for outs in schedule(sim):
        check(sim, outs, window, tol)
    assert plan in seen["plans"], seen


# gpt-oss: head_dim 64, 64 query heads on 8 KV heads, 128-token sliding-window layers
# alternating with full ones; a sliding layer's PQ window must stay below 128.
GPT_OSS = (64, 8)
GPU_LAYERS = [(None, 0), (None, 128), (128, 0), (128, 64)]  # (sliding window, PQ window)


@ON_GPU
@pytest.mark.parametrize("path", ["flash", "codes", "batch_invariant"])
@pytest.mark.parametrize("sliding,window", GPU_LAYERS)
def test_every_path_on_the_gpu(model_factory, monkeypatch, path, sliding, window):
    """The real kernels at gpt-oss's shape in bfloat16: the decode kernel (contexts long
    enough for several splits), FlashAttention 3 over pages or segments, the codes kernel
    with its LSE merge, vLLM's Triton attention in batch-invariant mode; every row within
    bfloat16's bound of the formula and the sink counted once."""
    from vllm_pq_backend import codes_attention

    hq, hkv = GPT_OSS
    vc = vllm_config(model_factory(D, hq, hkv), block_size=128, pq={"window": window, "m": 32},
                     max_model_len=4096)
    sim = make_sim(vc, sliding=sliding, seed=12, dtype=torch.bfloat16, device="cuda",
                   num_blocks=256)
    sim.builder.batch_invariant = path == "batch_invariant"
    monkeypatch.setattr(codes_attention, "BREAK_EVEN_ROWS", 10**9 if path == "codes" else -1)
    seen = spy_plans(sim)
    for outs in schedule(sim, long=1500):
        assert sim.impl._state.kernels, "the CUDA kernels are not in use"
        check(sim, outs, window, 2e-2)
    want = {"flash": "SegmentsPlan" if window else "PagesPlan", "codes": "CodesPlan",
            "batch_invariant": "BatchInvariantPlan"}[path]
    assert want in seen["plans"], seen
    if not sliding and path != "batch_invariant":  # (there decodes take the prefill path)
        # request 0's 1.6K codes in several splits, merged with the sink once
        assert max(seen["splits"]) > 1, seen
