"""Every index that reaches a kernel is in bounds, or the step stops with an error that
names the tensor: the builder checks lengths against the block table on the host, the
reference path (the CPU's, and the kernels' oracle) checks every index it is given. The
binding's checks (shapes, dtypes, alignment) are in test_kernels_gpu.py."""

import numpy as np
import pytest
import torch

from helpers import RequestTable, Runner, Sim, vllm_config
from vllm_pq_backend import fallback, reference
from vllm_pq_backend.layout import PageLayout

LAYOUT = PageLayout(32, 16, 16)  # head_dim 64 at 2 bits per element


def _builder(model_factory):
    from vllm.config import set_current_vllm_config
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from vllm_pq_backend.backend import PQAttentionBackend

    vc = vllm_config(model_factory(64, 4, 2), block_size=32, pq={"window": 32, "m": 16})
    with set_current_vllm_config(vc):
        spec = PQAttentionBackend.customize_spec(
            FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.bfloat16))
    table = RequestTable(range(16))
    return Runner(table).builder(spec, vc), [table.add(r) for r in ("a", "b")]


def _cam(qsl, seq, table, slots):
    from vllm.v1.attention.backend import CommonAttentionMetadata

    qsl = torch.tensor(qsl, dtype=torch.int32)
    seq = torch.tensor(seq, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq, num_reqs=len(seq),
        num_actual_tokens=int(qsl[-1]), max_query_len=int(torch.diff(qsl).max()),
        max_seq_len=int(seq.max()), block_table_tensor=torch.tensor(table, dtype=torch.int32),
        slot_mapping=torch.arange(int(qsl[-1])), seq_lens_cpu_upper_bound=seq,
        req_idx=np.array(slots))


def test_builder_checks_lengths_against_the_block_table(model_factory):
    """A request longer than its block table row, or with more query rows than tokens,
    would send the kernels past the table (decode reads seq_lens' pages from it) or to
    negative positions: refused with the tensor and the numbers."""
    builder, slots = _builder(model_factory)
    ok = builder.build(0, _cam([0, 1, 41], [33, 64], [[1, 2], [3, 4]], slots))
    assert (ok.num_decodes, ok.num_prefills) == (1, 1)
    with pytest.raises(ValueError, match=r"seq_lens\[1\]=65 needs 3 blocks of 32, but "
                                         r"block_table is \[2, 2\]"):
        builder.build(0, _cam([0, 1, 41], [33, 65], [[1, 2], [3, 4]], slots))
    with pytest.raises(ValueError, match=r"seq_lens\[0\]=70 needs 3 blocks"):  # a decode
        builder.build(0, _cam([0, 1, 41], [70, 64], [[1, 2], [3, 4]], slots))
    with pytest.raises(ValueError, match=r"request 1 of the step has 40 query rows "
                                         r"\(query_start_loc\) but seq_lens\[1\]=30"):
        builder.build(0, _cam([0, 1, 41], [33, 30], [[1, 2], [3, 4]], slots))


def test_the_window_store_rows_a_step_names_exist(model_factory):
    """A step whose rows reach past the window store (its size settled from another
    admission than the builder's) stops before a kernel writes there, naming req_rows."""
    sim = Sim(vllm_config(model_factory(64, 4, 2), block_size=32, pq={"window": 32, "m": 16},
                          max_num_seqs=4))
    sim.add(0)
    sim.step([(0, 5)])  # builds the layer's store: 4 rows and the scratch row
    assert sim.impl._state.win_k.shape[0] == 5
    build = sim.builder.build

    def past_the_store(*args, **kwargs):
        md = build(*args, **kwargs)
        md.req_rows_end = 6
        return md

    sim.builder.build = past_the_store
    with pytest.raises(ValueError, match="req_rows names window store row 5, but the store "
                                         "has 5 rows"):
        sim.step([(0, 1)])


def _cache(blocks=4, heads=2):
    return torch.zeros(blocks, heads, LAYOUT.block_size, LAYOUT.state_bytes, dtype=torch.uint8)


def _books(heads=2, m=16, d=64):
    g = torch.Generator().manual_seed(0)
    return torch.randn(heads, m, 256, d // m, generator=g)


@pytest.mark.parametrize("slot,ok", [(-1, True), (4 * 32 - 1, True), (4 * 32, False),
                                     (-2, False)])
def test_store_checks_the_slot_mapping(slot, ok):
    cache, k_cb, v_cb = _cache(), _books(), _books()
    key = torch.randn(3, 2, 64)
    slots = torch.tensor([0, slot, 5])
    if ok:
        reference.store(cache, key, key, slots, k_cb, v_cb, LAYOUT)
    else:
        with pytest.raises(ValueError, match=f"slot_mapping holds {slot}, outside "
                                             rf"\[-1, 128\)"):
            reference.store(cache, key, key, slots, k_cb, v_cb, LAYOUT)
        assert not cache.any()  # nothing written


@pytest.mark.parametrize("bad_id", [4, -1])
def test_dequant_pages_checks_the_block_ids(bad_id):
    cache, k_cb, v_cb = _cache(), _books(), _books()
    k, _ = fallback.dequant_pages(cache, torch.tensor([0, 3], dtype=torch.int32), None, k_cb,
                                  v_cb, 1, LAYOUT)
    assert k.shape == (3, 32, 2, 64)
    with pytest.raises(ValueError, match=rf"block_ids holds {bad_id}, outside \[0, 4\)"):
        fallback.dequant_pages(cache, torch.tensor([0, bad_id], dtype=torch.int32), None, k_cb,
                               v_cb, 0, LAYOUT)


@pytest.mark.parametrize("name,index,bound", [("tokens", 3, 3), ("tokens", -1, 3),
                                              ("rows", 5, 5), ("slots", 32, 32),
                                              ("slots", -1, 32)])
def test_window_write_checks_its_indices(name, index, bound):
    win_k, win_v = torch.zeros(5, 2, 32, 64), torch.zeros(5, 2, 32, 64)
    key = torch.randn(3, 2, 64)
    args = dict(tokens=torch.tensor([0, 2]), rows=torch.tensor([4, 0]), slots=torch.tensor([31, 0]))
    fallback.window_write(win_k, win_v, key, key, **args)
    args[name] = torch.tensor([0, index])
    with pytest.raises(ValueError, match=rf"{name} holds {index}, outside \[0, {bound}\)"):
        fallback.window_write(win_k, win_v, key, key, **args)


def test_own_subpages_checks_rows_and_sources():
    k, v = torch.zeros(4, 32, 2, 64), torch.zeros(4, 32, 2, 64)
    keys = torch.randn(10, 2, 64)
    at = torch.tensor([0, 9, -1])
    fallback.own_subpages(k, v, 125, keys, keys, at)  # the last three rows of 128
    with pytest.raises(ValueError, match=r"at holds 10, outside \[-1, 10\)"):
        fallback.own_subpages(k, v, 0, keys, keys, torch.tensor([0, 10]))
    with pytest.raises(ValueError, match=r"rows 126\.\.129 are outside k's 128 rows"):
        fallback.own_subpages(k, v, 126, keys, keys, at)


def test_reference_attention_checks_the_block_table_and_rows():
    """The CPU path's attention: a request's pages must be in the table and the cache, its
    window row in the store."""
    cache, k_cb, v_cb = _cache(), _books(), _books()
    q, k = torch.randn(1, 4, 64), torch.randn(1, 2, 64)
    win = torch.zeros(5, 2, 32, 64)

    def attend(seq_len, table, rows=(0,)):
        return reference.attention(q, k, k, cache, k_cb, v_cb, LAYOUT, [0, 1], [seq_len],
                                   torch.tensor(table, dtype=torch.int32), 0.125, 32, win,
                                   win, list(rows))

    assert attend(40, [[1, 2]]).shape == (1, 4, 64)
    with pytest.raises(ValueError, match=r"seq_lens\[0\]=70 needs 3 blocks, but block_table "
                                         r"has 2 columns"):
        attend(70, [[1, 2]])
    with pytest.raises(ValueError, match=r"block_table\[0\] holds 4, outside \[0, 4\)"):
        attend(40, [[1, 4]])
    with pytest.raises(ValueError, match=r"rows\[0\] holds 5, outside \[0, 5\)"):
        attend(40, [[1, 2]], rows=(5,))
