"""Tensor parallelism: each rank stores and attends with its own KV heads' codebooks.

vLLM splits the query heads evenly between the tensor-parallel ranks and the KV heads too
when there are at least as many as ranks; with fewer, each KV head is replicated on
tp / kv_heads ranks (QKVParallelLinear). Which global heads a rank holds is taken here
from vLLM's own weight loader, not restated. A rank runs as one GPU would on those heads
alone: its outputs must equal, row by row, the one-GPU outputs of the same global query
heads; with another head's codebooks they must not.
"""

import pytest
import torch

from helpers import Sim, vllm_config
from vllm_pq_backend import codebooks
from vllm_pq_backend import impl as impl_module
from vllm_pq_backend.impl import PQAttentionImpl

HEAD_DIM, M = 64, 32  # 4 bits per element (K and V)
BLOCK, WINDOW = 32, 16  # most of each request is read through codes, not the window

# (query heads, KV heads, tensor-parallel size): split, SmolLM2's shape (9/3) at TP=3,
# Gemma 3 270M's (4/1) replicated on 2 and 4 ranks, and 2 KV heads replicated on 4 ranks
SHAPES = [(4, 2, 2), (8, 4, 2), (9, 3, 3), (4, 1, 2), (4, 1, 4), (4, 2, 4)]
IDS = [f"{q}q-{kv}kv-tp{tp}" for q, kv, tp in SHAPES]

# per (token, query head) row, relative to the one-GPU row: a rank computes the same
# float32 sums over fewer heads, so only batching can change the rounding
SAME = 1e-5
# the median row with another head's codebooks (and K/V maps) is off by far more
WRONG = 0.05


def vllm_heads(monkeypatch, q_heads, kv_heads, tp, rank):
    """The global (query heads, KV heads) whose weights vLLM's QKVParallelLinear loads on
    ``rank`` of ``tp``: every head's rows of the full weight hold its index."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor import parameter
    from vllm.model_executor.layers import linear

    for mod in (linear, parameter):
        monkeypatch.setattr(mod, "get_tensor_model_parallel_rank", lambda: rank)
        monkeypatch.setattr(mod, "get_tensor_model_parallel_world_size", lambda: tp)
    d = 2
    with set_current_vllm_config(VllmConfig()):
        qkv = linear.QKVParallelLinear(q_heads * d, d, q_heads, kv_heads, bias=False,
                                       params_dtype=torch.float32)
    heads = {}
    for shard, total, start, n in (("q", q_heads, 0, qkv.num_heads),
                                   ("k", kv_heads, qkv.num_heads, qkv.num_kv_heads)):
        full = torch.arange(total).repeat_interleave(d).float()[:, None].expand(-1, q_heads * d)
        qkv.weight_loader(qkv.weight, full.contiguous(), shard)
        heads[shard] = qkv.weight[start * d:(start + n) * d, 0].view(n, d)[:, 0].long().tolist()
    return heads["q"], heads["k"]


def rank_sim(monkeypatch, model, tp, rank, offset=None):
    """One attention layer as rank ``rank`` of ``tp`` builds it: vLLM's per-rank head
    counts (ModelConfig.get_num_*_heads) and the rank the impl reads; ``offset``, when
    given, replaces the impl's choice of its first global KV head."""
    vc = vllm_config(model, block_size=BLOCK, pq={"window": WINDOW, "m": M})
    vc.parallel_config.tensor_parallel_size = tp
    monkeypatch.setattr(impl_module, "_tp_rank_size", lambda: (rank, tp))
    if offset is not None:
        monkeypatch.setattr(PQAttentionImpl, "kv_head_offset", lambda self, total: offset)
    return Sim(vc, seed=3)


STEPS = [[(0, 70), (1, 40)], [(0, 1), (1, 1), (2, 50)], [(0, 1), (1, 1), (2, 1)],
         [(1, 1), (2, 1)], [(0, 33), (2, 1)]]


def run(sim, source_of=None):
    """The requests' outputs over STEPS (prefill, chunked prefill, decode, mixed), token
    by token: ``[tokens, heads, d]`` per request. ``source_of(rid)``: the request's q/k/v
    rows, else Sim's own."""
    for rid in range(3):
        r = sim.add(rid, max_len=128)
        if source_of is not None:
            r.source = source_of(rid)
    outs = {rid: [] for rid in range(3)}
    for work in STEPS:
        for rid, out in sim.step(work).items():
            outs[rid].append(out.clone())
    return {rid: torch.cat(o) for rid, o in outs.items()}


def row_errors(got, want):
    """Relative error of every (token, head) row, over all requests."""
    return torch.cat([((got[r] - want[r]).norm(dim=-1) / want[r].norm(dim=-1)).flatten()
                      for r in want])


@pytest.fixture(scope="module")
def one_gpu(model_factory):
    """Per shape: the model folder, the one-GPU sim and its outputs (every head)."""
    made = {}

    def get(q_heads, kv_heads):
        if (q_heads, kv_heads) not in made:
            model = model_factory(HEAD_DIM, q_heads, kv_heads, transforms=True)
            sim = Sim(vllm_config(model, block_size=BLOCK, pq={"window": WINDOW, "m": M}),
                      seed=3)
            made[q_heads, kv_heads] = model, sim, run(sim)
        return made[q_heads, kv_heads]

    return get


def sliced(full, q, kv):
    """A rank's q/k/v rows of one request: the one-GPU rows of its global heads."""
    return lambda rid: [x[:, h] for x, h in zip(full.reqs[rid].source, (q, kv, kv))]


@pytest.mark.parametrize("q_heads,kv_heads,tp", SHAPES, ids=IDS)
def test_rank_attends_as_one_gpu_on_its_heads(monkeypatch, one_gpu, q_heads, kv_heads, tp):
    """Each rank holds the KV heads vLLM loads on it, with those heads' centroids and K/V
    maps from the file, and its outputs equal the one-GPU outputs of its query heads."""
    model, full, want = one_gpu(q_heads, kv_heads)
    info = full.impl.cfg.codebooks
    k_all, v_all = codebooks.load_layer(info, 0, slice(None))
    tk_all, tv_all = codebooks.load_transforms(info, 0, slice(None))
    covered = set()
    for rank in range(tp):
        q, kv = vllm_heads(monkeypatch, q_heads, kv_heads, tp, rank)
        sim = rank_sim(monkeypatch, model, tp, rank)
        impl = sim.impl
        assert (impl.num_heads, impl.num_kv_heads) == (len(q), len(kv))
        start = impl.kv_head_offset(kv_heads)
        assert list(range(start, start + impl.num_kv_heads)) == kv, (rank, start, kv)
        got = run(sim, sliced(full, q, kv))
        err = row_errors(got, {r: o[:, q] for r, o in want.items()})
        assert err.max() < SAME, f"rank {rank} of {tp}: row error {err.max():.2e}"
        st = impl._state
        for have, want_ in ((st.k_cb32, codebooks.nan_marked(k_all[kv])),
                            (st.v_cb32, codebooks.nan_marked(v_all[kv])),
                            (st.maps["key"], tk_all[kv]), (st.maps["value"], tv_all[kv])):
            torch.testing.assert_close(have, want_, rtol=0, atol=0, equal_nan=True)
        covered.update(q)
    assert covered == set(range(q_heads))  # the ranks together cover every query head


@pytest.mark.parametrize("q_heads,kv_heads,tp",
                         [s for s in SHAPES if s[1] > 1], ids=[i for i, s in zip(IDS, SHAPES) if s[1] > 1])
def test_another_heads_codebooks_are_caught(monkeypatch, one_gpu, q_heads, kv_heads, tp):
    """The check above can fail: a rank that reads the codebooks (and maps) of the next KV
    head, with its own heads' q/k/v, is far from the one-GPU rows on every rank."""
    model, full, want = one_gpu(q_heads, kv_heads)
    for rank in range(tp):
        q, kv = vllm_heads(monkeypatch, q_heads, kv_heads, tp, rank)
        wrong = (kv[0] + 1) % (kv_heads - len(kv) + 1)  # the next head's, or the first
        sim = rank_sim(monkeypatch, model, tp, rank, offset=wrong)
        got = run(sim, sliced(full, q, kv))
        err = row_errors(got, {r: o[:, q] for r, o in want.items()})
        assert err.median() > WRONG, f"rank {rank} of {tp}: median row error {err.median():.2e}"
