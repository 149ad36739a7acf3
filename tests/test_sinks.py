"""Attention sinks (gpt-oss) on the CPU path: each query head's learned logit joins every
row's softmax denominator once, with no value,

    out = sum_j exp(q.k_j scale - m) v_j / (exp(sink_h - m) + sum_j exp(q.k_j scale - m)),

checked row by row against that formula over the full-precision keys of the window and
the dequantized codes before it. Every check also proves itself able to see the sink
counted twice (as it would be if each of two merged partial results counted it).

The impl refuses sinks while the CUDA kernels do not take them, so the tests give the
impl its ``sinks`` after construction, as its constructor would from vLLM's kwargs.
"""

import pytest
import torch

from helpers import Sim, vllm_config

from vllm_pq_backend import reference
from vllm_pq_backend.layout import window_start

D, HQ, HKV = 64, 16, 2  # gpt-oss: head_dim 64, 8 query heads per KV head
TOL = 2e-5  # fp32 rounding, relative to the largest |v|


def sinks_for(hq: int) -> torch.Tensor:
    """Per-head logits from well below to well above a row's score LSE (about 0 to 6
    here), in the model's dtype as vLLM hands them over."""
    return torch.linspace(-2.0, 8.0, hq).to(torch.bfloat16)


def config(model_factory, block, window, hq=HQ, hkv=HKV):
    return vllm_config(model_factory(D, hq, hkv), block_size=block, pq={"window": window, "m": 16})


def make_sim(vc, *, sinks=(), sliding=None, seed=0):
    """A layer on the CPU path with ``sinks`` (default sinks_for; None: no sinks)."""
    sim = Sim(vc, dtype=torch.float32, seed=seed, sliding_window=sliding)
    hq = sim.hq
    sim.impl.sinks = sinks_for(hq) if isinstance(sinks, tuple) else sinks
    return sim


def oracle(sim, rid, window, sinks, times=1):
    """Every row of the request so far by the formula above in float64: keys
    ``j >= window_start(i)`` at full precision, earlier ones as their codes decode;
    ``times``: how often the sink enters the denominator."""
    st = sim.impl._state
    r = sim.reqs[rid]
    q, k, v = (torch.cat(x).double() for x in (r.q, r.k, r.v))
    k_hat = reference.decode_codes(reference.encode(k.float(), st.k_cb32), st.k_cb32).double()
    v_hat = reference.decode_codes(reference.encode(v.float(), st.v_cb32), st.v_cb32).double()
    n, g = k.shape[0], sim.hq // sim.hkv
    pos = torch.arange(n)
    ws = window_start(pos, window)
    s_h = sinks.double() if sinks is not None else torch.full((sim.hq,), float("-inf"),
                                                                 dtype=torch.float64)
    rows = []
    for i in range(n):
        lo = max(0, i - sim.sw + 1) if sim.sw else 0
        exact = (pos >= ws[i])[lo : i + 1].view(-1, 1, 1)
        kk = torch.where(exact, k[lo : i + 1], k_hat[lo : i + 1]).repeat_interleave(g, 1)
        vv = torch.where(exact, v[lo : i + 1], v_hat[lo : i + 1]).repeat_interleave(g, 1)
        s = torch.einsum("hd,khd->hk", q[i], kk) * sim.d**-0.5
        m = torch.maximum(s.amax(-1), s_h)
        e = torch.exp(s - m[:, None])
        den = times * torch.exp(s_h - m) + e.sum(-1)
        rows.append(torch.einsum("hk,khd->hd", e, vv) / den[:, None])
    return torch.stack(rows)


def check(sim, outs, window):
    """Every (row, query head) of each request's output within TOL of the oracle, and the
    oracle with the sink counted twice outside TOL in some row of the step."""
    sinks = sim.impl.sinks
    for rid, out in outs.items():
        want = oracle(sim, rid, window, sinks)[-out.shape[0]:]
        bound = TOL * torch.cat(sim.reqs[rid].v).abs().max()
        err = (out.double() - want).abs().amax(-1)  # [rows, Hq]
        row, head = divmod(int(err.argmax()), err.shape[1])
        assert err.max() <= bound, f"request {rid}: row {row}, head {head}, error {err.max():.2e}"
        if sinks is not None and torch.isfinite(sinks).any():
            twice = oracle(sim, rid, window, sinks, times=2)[-out.shape[0]:]
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
