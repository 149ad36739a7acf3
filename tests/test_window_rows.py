"""Window store rows: requests that run together never share one, whatever vLLM does with
its request slots, and a request that gets none is said so."""

import logging

import numpy as np
import pytest
import torch

from helpers import RequestTable, Runner, vllm_config

ROWS = 8  # the scheduler's admission (max_num_active_seqs)
SLOTS = 64  # vLLM's request slots (max_num_seqs)


def _builder(model_factory, req_states, **pq):
    from vllm.config import set_current_vllm_config
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from vllm_pq_backend.backend import PQAttentionBackend

    vc = vllm_config(model_factory(64, 4, 2), block_size=32,
                     pq={"window": 32, "m": 16, **pq}, max_num_seqs=SLOTS)
    vc.scheduler_config.max_num_active_seqs = ROWS
    with set_current_vllm_config(vc):
        spec = PQAttentionBackend.customize_spec(
            FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.bfloat16))
    return Runner(req_states).builder(spec, vc), spec, vc


def _decode_step(builder, slots, seq_lens):
    """The rows the builder gives a step of one-token decodes of requests in ``slots``."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    n = len(slots)
    qsl = torch.arange(n + 1, dtype=torch.int32)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    cam = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq, num_reqs=n,
        num_actual_tokens=n, max_query_len=1, max_seq_len=int(seq.max()),
        block_table_tensor=torch.ones(n, 4, dtype=torch.int32),
        slot_mapping=torch.arange(n), seq_lens_cpu_upper_bound=seq, req_idx=np.array(slots))
    md = builder.build(0, cam)
    assert md.req_rows.tolist() == md.req_rows_cpu
    return md.req_rows_cpu


@pytest.mark.parametrize("reuse", ["last-freed-first", "first-freed-first", "random"])
def test_running_requests_never_share_a_row(model_factory, reuse):
    """At most ROWS requests run at once (the scheduler's admission); every one of them
    holds a row of its own from its first step to its last, whichever freed slot vLLM hands
    out next, and when steps leave running requests out (a token budget spent on a long
    prefill). Serving starts after vLLM's warm-up ran 40 requests at once and freed them by
    name, so the free slots are shuffled."""
    table = RequestTable(range(SLOTS), reuse, seed=1)
    builder, _, _ = _builder(model_factory, table)
    warm = [f"_warmup_{i}_" for i in range(40)]
    rows = _decode_step(builder, [table.add(r) for r in warm], [5] * 40)
    assert sorted(rows) == list(range(ROWS)) + [ROWS] * 32  # beyond admission: the scratch row
    for rid in sorted(warm):
        table.remove(rid)

    rng = np.random.default_rng(0)
    live, row_of, next_id, steps, skipped = [], {}, 0, 0, 0
    while steps < 5000:
        done = [r for r in live if rng.random() < 0.15]
        for r in sorted(done):
            table.remove(r)
        live = [r for r in live if r not in done]
        while len(live) < ROWS and rng.random() < 0.7:
            live.append(f"req-{next_id}")
            table.add(live[-1])
            next_id += 1
        run = [r for r in live if rng.random() < 0.6] or live[:1]
        if not run:
            continue
        skipped += len(run) < len(live)
        got = _decode_step(builder, [table.req_id_to_index[r] for r in run], [7] * len(run))
        for r, row in zip(run, got):
            assert row_of.setdefault(r, row) == row, (r, row_of[r], row)  # kept for life
        held = [row_of[r] for r in live if r in row_of]
        assert max(held) < ROWS and len(set(held)) == len(held), (live, held)
        steps += 1
    assert next_id > 1500 and skipped > 3000


def test_a_request_beyond_the_rows_is_logged_and_stays_on_the_scratch_row(
        model_factory, caplog):
    """More live requests than rows (admission broken): the request that finds no row is
    logged with the numbers and keeps the scratch row; slots no request holds (padding,
    dummy runs) get the scratch row silently; a freed row goes to the next request."""
    table = RequestTable(range(SLOTS))
    builder, _, _ = _builder(model_factory, table)
    first = [table.add(f"r{i}") for i in range(ROWS)]
    assert _decode_step(builder, first, [3] * ROWS) == list(range(ROWS))
    extra = table.add("r-extra")
    free_slot = table.free[0]  # held by no request: a dummy run's
    with caplog.at_level(logging.WARNING, logger="vllm"):
        rows = _decode_step(builder, [extra, free_slot, first[3]], [3, 3, 4])
    assert rows == [ROWS, ROWS, 3]
    (msg,) = [r.getMessage() for r in caplog.records if "scratch row" in r.getMessage()]
    assert f"{ROWS} running requests hold all {ROWS} rows" in msg and "r-extra" in msg
    assert f"--max-num-active-seqs {ROWS}" in msg
    caplog.clear()
    table.remove("r3")
    with caplog.at_level(logging.WARNING, logger="vllm"):
        assert _decode_step(builder, [extra], [4]) == [ROWS]  # no row mid-life
        assert _decode_step(builder, [table.add("r-next")], [1]) == [3]  # r3's row
    assert not caplog.records


def test_builders_of_one_engine_share_the_rows(model_factory):
    """Every metadata builder of an engine (one per KV cache group) gives
    a request the same row: the layers of each read one window store per request."""
    table = RequestTable(range(SLOTS))
    builder, spec, vc = _builder(model_factory, table)
    other = Runner(table).builder(spec, vc)
    a, b = table.add("a"), table.add("b")
    assert _decode_step(builder, [a], [3]) == [0]
    assert _decode_step(other, [b, a], [3, 4]) == [1, 0]
    assert other.window_rows is builder.window_rows


def test_a_window_needs_the_runners_request_table(model_factory):
    """Without vLLM's model runner V2 request table the rows cannot follow requests: a
    step with a window is refused with the fix, not served on guessed rows."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from vllm_pq_backend.backend import PQAttentionBackend

    vc = vllm_config(model_factory(64, 4, 2), block_size=32, pq={"window": 32, "m": 16})
    with set_current_vllm_config(vc):
        spec = PQAttentionBackend.customize_spec(
            FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.bfloat16))
        builder = PQAttentionBackend.get_builder_cls()(spec, ["l0"], vc, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="model runner V2.*window.*0"):
        _decode_step(builder, [0], [3])
