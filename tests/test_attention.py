"""Store-then-attend equals dense attention over the dequantized K/V (full precision
inside the residual window), for decode, prefill, chunked prefill and mixed batches with
random block tables, GQA, head_dim 64 and 128."""

import pytest
import torch

from helpers import (INTERPRETED, Sim, hf_config, use_gpu_paths, vllm_config,
                     write_model_config)

# cpu: the PyTorch reference path in float32, differences are rounding only.
# cuda: the CUDA store/decode kernels and FlashAttention prefill in bfloat16.
TARGETS = {"cpu": (torch.float32, 2e-5), "cuda": (torch.bfloat16, 2e-2)}


ON_GPU = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the GPU machine)"
)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=ON_GPU)])
def target(request):
    return request.param


def make_sim(vc, target, **kw):
    dtype, tol = TARGETS[target]
    sim = Sim(vc, dtype=dtype, device=target, **kw)
    sim.tol = tol
    return sim


def check(sim, outs, window):
    """Every (token, query head) output row within the tolerance of the dense check."""
    for rid, out in outs.items():
        assert not torch.isnan(out).any(), f"request {rid}: unwritten or NaN output rows"
        ref = sim.dense_reference(rid, window)[-out.shape[0]:]
        err = (out.float() - ref).norm(dim=-1) / ref.norm(dim=-1)  # [tokens, heads]
        tok, head = divmod(int(err.argmax()), err.shape[1])
        assert err.max() < sim.tol, (
            f"request {rid}, token {tok}, head {head}: relative error {err.max():.2e}")


@pytest.mark.parametrize("head_dim,q_heads,kv_heads,transforms,bits", [
    (64, 4, 2, False, (2, 2)), (128, 8, 2, False, (2, 2)), (64, 3, 3, False, (2, 2)),
    (64, 4, 2, True, (2, 2)), (128, 8, 2, True, (2, 2)), (64, 4, 2, True, (4, 2)),
    (128, 8, 2, False, (4, 2)), (64, 3, 3, False, (4, 2))])
@pytest.mark.parametrize("window", [0, 32])
def test_prefill_decode_mixed(model_factory, target, head_dim, q_heads, kv_heads, transforms,
                              bits, window):
    """With ``transforms`` the codebooks carry K/V maps: the check dequantizes in the
    mapped frame and maps back, independently of the backend's q/output maps. ``bits``:
    of K and V per element (K 4 / V 2: different subspace widths in one page)."""
    model = model_factory(head_dim, q_heads, kv_heads, transforms)
    m, m_v = (b * head_dim // 8 for b in bits)
    vc = vllm_config(model, block_size=64, pq={"window": window, "m": m, "m_v": m_v})
    sim = make_sim(vc, target, seed=head_dim + window)
    if transforms:
        # the output map (condition number up to 4) scales the bf16 rounding of the output
        sim.tol *= 2
    for rid in range(4):
        sim.add(rid)
    check(sim, sim.step([(0, 70), (1, 5), (2, 130)]), window)  # prefill only
    check(sim, sim.step([(0, 1), (1, 1), (2, 1)]), window)  # decode only
    check(sim, sim.step([(0, 1), (3, 40), (1, 33), (2, 1)]), window)  # mixed
    for _ in range(3):  # decode across a window and a block boundary
        check(sim, sim.step([(0, 1), (1, 1), (2, 1), (3, 1)]), window)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("bits", [
    ((4, 2), (4, 4), (4, 1)),  # V's bits by layer (calibrate --bits-v-layers, --bits-v-mean)
    ((2, 2), (4, 1), (1, 1)),  # K's and V's (calibrate --bits-mean)
], ids=["v", "kv"])
def test_bits_by_layer(tmp_path, target, head_dim, bits):
    """Codebooks whose layers have other (K, V) bits: each layer's pages hold its own K and
    V codes and every layer attends within the tolerance."""
    from helpers import random_codebooks

    model = write_model_config(str(tmp_path / "m"), head_dim=head_dim, layers=3)
    pairs = [(bk * head_dim // 8, bv * head_dim // 8) for bk, bv in bits]
    path = random_codebooks(str(tmp_path / "mixed.safetensors"), model,
                            [mk for mk, _ in pairs], m_v=[mv for _, mv in pairs], seed=head_dim)
    vc = vllm_config(model, block_size=64, pq={"codebooks": path, "window": 32})
    for layer, (m_k, m_v) in enumerate(pairs):
        sim = make_sim(vc, target, seed=layer, layer_index=layer)
        assert sim.spec.state_content_bytes == m_k + m_v
        for rid in range(3):
            sim.add(rid)
        check(sim, sim.step([(0, 70), (1, 5), (2, 130)]), 32)
        assert (sim.impl._state.layout.m_k, sim.impl._state.layout.m_v) == (m_k, m_v)
        for _ in range(2):
            check(sim, sim.step([(0, 1), (1, 1), (2, 1)]), 32)


@pytest.mark.parametrize("window", [0, 32])
def test_step_padded_to_a_cuda_graph_size(model_factory, target, window):
    """vLLM pads a step's tokens to a CUDA-graph size: q/k/v get junk rows after the
    step's own and the slot mapping -1 entries, num_actual_tokens stays the own count. The
    outputs of the own rows and the whole cache are those of the unpadded step, exactly."""
    model = model_factory(64, 4, 2, False)
    vc = vllm_config(model, block_size=64, pq={"window": window, "m": 32})
    sims = [make_sim(vc, target, seed=7) for _ in range(2)]
    for sim in sims:
        for rid in range(3):
            sim.add(rid)
    for work, pad in (([(0, 70), (1, 5)], 3), ([(0, 1), (1, 1), (2, 40)], 5),
                      ([(0, 1), (1, 1), (2, 1)], 1)):
        plain, padded = sims[0].step(work), sims[1].step(work, pad=pad)
        for rid, out in plain.items():
            assert torch.equal(padded[rid], out), f"request {rid}, pad {pad}"
        assert torch.equal(sims[1].kv_cache, sims[0].kv_cache)


def test_maps_beyond_the_activation_dtype_are_refused(tmp_path):
    """The map kernel splits each map into two parts of the activation dtype (pq_map.cu):
    a map entry beyond float16's range is refused with a one-line error when the layer's
    state is built, not turned into inf."""
    from vllm_pq_backend import codebooks
    from vllm_pq_backend.config import default_codebook_path

    d = str(tmp_path)
    write_model_config(d, head_dim=64)
    cfg = hf_config(d)
    shape = (cfg.num_hidden_layers, cfg.num_key_value_heads, 32, 256, 2)
    eye = torch.eye(64).expand(*shape[:2], 64, 64)
    codebooks.save_codebooks(default_codebook_path(d, 32, 32), torch.randn(shape),
                             torch.randn(shape), cfg, {"model": d},
                             k_transform=1e5 * eye, v_transform=eye.clone())
    sim = Sim(vllm_config(d, block_size=64, pq={"window": 0, "m": 32}), dtype=torch.float16)
    sim.add(0)
    with pytest.raises(ValueError, match="beyond torch.float16's range"):
        sim.step([(0, 4)])


@pytest.mark.parametrize("block,window,sliding", [(32, 0, 48), (32, 32, 48), (64, 32, 80),
                                                  (64, 64, 96), (128, 16, 64)])
def test_sliding_window_layer(model_factory, target, block, window, sliding):
    """A sliding-window layer (key j > i - sw) with the residual window: prefill, chunked
    prefill, mixed batches and decode, with keys just inside and outside both windows at
    every position, and the block-table entries of freed blocks pointing anywhere."""
    model = model_factory(64, 4, 2)
    vc = vllm_config(model, block_size=block, pq={"window": window, "m": 16})
    sim = make_sim(vc, target, seed=block + window + sliding, sliding_window=sliding)
    for rid in range(4):
        sim.add(rid)
    check(sim, sim.step([(0, 150), (1, 5), (2, 70)]), window)
    check(sim, sim.step([(0, 1), (1, 1), (2, 1)]), window)
    check(sim, sim.step([(0, 1), (3, 90), (1, 60), (2, 1)]), window)
    check(sim, sim.step([(3, 45), (2, 33)]), window)
    for _ in range(sliding // 8 + 3):  # decode past window and page boundaries
        check(sim, sim.step([(0, 1), (1, 1), (2, 1), (3, 1)]), window)


def test_sliding_window_must_exceed_residual_window(model_factory):
    model = model_factory(64, 4, 2)
    vc = vllm_config(model, block_size=64, pq={"window": 64, "m": 16})
    sim = make_sim(vc, "cpu", sliding_window=64)
    sim.add(0)
    with pytest.raises(ValueError, match="must be smaller than this model's sliding window 64"):
        sim.step([(0, 3)])


@pytest.mark.parametrize("window,sliding", [(0, None), (32, None), (32, 48)])
def test_non_finite_kv_reaches_exactly_the_queries_that_read_it(model_factory, target, window,
                                                                  sliding):
    """NaN or inf in one token's K or V of one KV head (layout.NAN_CODE once coded): the
    query heads of that KV head that read the token get a non-finite output, as with
    FLASH_ATTN, while it is in the residual window and through its codes after; the other
    heads, the earlier queries and (sliding window) the queries after it left are finite
    and right. Never a plausible number made up from a centroid."""
    model = model_factory(64, 4, 2)
    vc = vllm_config(model, block_size=32, pq={"window": window, "m": 16})
    sim = make_sim(vc, target, seed=11, sliding_window=sliding)
    a, b = sim.add(0), sim.add(1)
    a.source[1][40, 0, 7] = float("nan")  # K of token 40, KV head 0
    b.source[2][41, 1, 60] = float("-inf")  # V of token 41, KV head 1
    sim.step([(0, 40), (1, 41)])
    outs = {0: [], 1: []}
    for _ in range(80):  # decode past the residual window, a page and the sliding window
        for rid, o in sim.step([(0, 1), (1, 1)]).items():
            outs[rid].append(o)
    for rid, first, head in ((0, 40, 0), (1, 41, 1)):
        out = torch.cat(outs[rid]).float()  # positions first .. first + 79
        ref = sim.dense_reference(rid, window)[-out.shape[0]:]
        bad = ~torch.isfinite(out).all(-1)  # [positions, query heads]
        assert torch.equal(bad, ~torch.isfinite(ref).all(-1))
        pos = torch.arange(first, first + 80).view(-1, 1)
        reads = pos < first + (sliding or 10**9)  # the sliding window still holds the token
        heads = torch.arange(4).view(1, -1) // 2 == head
        assert torch.equal(bad.cpu(), reads & heads)
        err = (out - ref).norm(dim=-1)[~bad] / ref.norm(dim=-1)[~bad]
        assert err.max() < sim.tol


@pytest.mark.parametrize("window", [0, 32, 64])
def test_chunked_prefill_matches_token_by_token(model_factory, target, window):
    """One semantics whatever the scheduling: a prompt prefilled in one chunk, in uneven
    chunks, or token by token gives the same outputs (and each equals the dense check)."""
    model = model_factory(64, 4, 2)
    vc = vllm_config(model, block_size=64, pq={"window": window})
    outs = {}
    for name, chunks in {"one": [150], "chunks": [37, 64, 1, 48], "tokens": [1] * 150}.items():
        sim = make_sim(vc, target, seed=7)  # same seed: the same random q/k/v rows
        sim.add(0)
        res = [sim.step([(0, n)])[0] for n in chunks]
        check(sim, {0: res[-1]}, window)
        outs[name] = torch.cat(res)
    for other in ("chunks", "tokens"):
        err = (outs[other].float() - outs["one"].float()).norm() / outs["one"].float().norm()
        assert err < sim.tol / 2, f"{other} vs one-shot prefill: relative difference {err:.2e}"


@pytest.mark.parametrize("transforms,sliding,q_heads", [(False, None, 4), (True, None, 4),
                                                        (False, 80, 4), (False, None, 2)])
def test_exact_store(model_factory, target, transforms, sliding, q_heads):
    """With the exact store: prefill, chunked prefill, mixed batches and decode equal the
    dense check with each whole page's P largest-error keys and values exact, and a prompt
    gives the same outputs in one chunk or in uneven ones. Request 0 decodes past 256
    codes (more than one split on the GPU, whose merge adds the corrections); one query
    head per KV head takes the decode kernel's lookup tables."""
    model = model_factory(64, q_heads, 2, transforms)
    vc = vllm_config(model, block_size=32, pq={"window": 32, "exact": 2})
    sim = make_sim(vc, target, seed=11, sliding_window=sliding)
    if transforms:
        sim.tol *= 2
    for rid in range(4):
        sim.add(rid)
    first = sim.step([(0, 300), (1, 5), (2, 70)])
    check(sim, first, 32)
    check(sim, sim.step([(0, 1), (1, 1), (2, 1)]), 32)
    check(sim, sim.step([(0, 1), (3, 90), (1, 60), (2, 1)]), 32)
    for _ in range(5):  # decode across a page boundary
        check(sim, sim.step([(0, 1), (1, 1), (2, 1), (3, 1)]), 32)
    again = make_sim(vc, target, seed=11, sliding_window=sliding)
    again.add(0)
    chunked = torch.cat([again.step([(0, n)])[0] for n in (37, 40, 1, 72, 150)])
    err = (chunked.float() - first[0].float()).norm() / first[0].float().norm()
    assert err < sim.tol / 2, f"chunked vs one-shot prefill: relative difference {err:.2e}"


def test_exact_store_needs_the_window_to_be_the_block(model_factory):
    model = model_factory(64, 4, 2)
    vc = vllm_config(model, block_size=64, pq={"window": 32, "exact": 2})
    with pytest.raises(ValueError, match="pq exact needs the window to be the block size"):
        make_sim(vc, "cpu")


@ON_GPU
@pytest.mark.parametrize("window", [0, 32, 128])
def test_batch_invariant_mode_is_bitwise_reproducible(model_factory, window):
    """VLLM_BATCH_INVARIANT=1: a request's outputs are bitwise the same whether it is
    prefilled at once, in chunks, or decoded token by token, alone or batched with
    requests of other lengths (what preemption's recompute and chunked prefill need).
    GPU only: the bitwise claim is vLLM's Triton attention's (fixed tiles, no splits);
    the CPU reference makes no such promise. Blocks of 128 tokens as vLLM uses them."""
    model = model_factory(64, 9, 3)
    vc = vllm_config(model, block_size=128, pq={"window": window})
    schedules = {
        "one": [[(0, 300)]],
        "chunks": [[(0, 37), (1, 20)], [(0, 64)], [(0, 1), (1, 1)], [(0, 198), (1, 70)]],
        "tokens": [[(0, 100)]] + [[(0, 1), (1, 2 if i % 3 else 1)] for i in range(200)],
        "mixed": [[(0, 90), (1, 130), (2, 7)], [(0, 1), (1, 1)], [(2, 1), (0, 64)],
                  [(0, 1), (1, 200), (2, 1)], [(0, 144), (2, 33)]],
    }
    outs = {}
    for name, steps in schedules.items():
        sim = make_sim(vc, "cuda", seed=9)
        sim.builder.batch_invariant = True
        for rid in (0, 1, 2):
            sim.add(rid, max_len=640)
        res = [sim.step(work)[0] for work in steps]
        check(sim, {0: res[-1]}, window)
        outs[name] = torch.cat(res)
    for other in ("chunks", "tokens", "mixed"):
        diff = (outs[other].float() - outs["one"].float()).abs().amax(dim=(1, 2))
        rows = torch.nonzero(diff).flatten().tolist()
        assert not rows, (f"{other} vs one-shot: {len(rows)} token rows differ, first "
                          f"{rows[:8]}, max diff {diff.max().item():.2e}")


def test_window_rows_are_per_request(model_factory, target):
    """Requests leaving and new ones taking their window rows and freed blocks."""
    model = model_factory(64, 4, 2)
    vc = vllm_config(model, block_size=32, pq={"window": 32}, max_num_seqs=3)
    sim = make_sim(vc, target, num_blocks=24, seed=3)
    for rid in range(3):
        sim.add(rid)
    check(sim, sim.step([(0, 50), (1, 20), (2, 33)]), 32)
    sim.finish(1)
    sim.add(3)  # reuses request 1's row and blocks
    check(sim, sim.step([(0, 1), (2, 1), (3, 45)]), 32)
    check(sim, sim.step([(0, 1), (2, 1), (3, 1)]), 32)


def test_prefix_hit_reads_shared_blocks_through_codes(model_factory, target):
    """A request starting on another request's full blocks (a prefix-cache hit) sees the
    same attention as one that computed them itself: the window never reaches back into a
    shared block."""
    model = model_factory(64, 4, 2)
    vc = vllm_config(model, block_size=32, pq={"window": 32})
    sim = make_sim(vc, target, seed=5)
    a = sim.add(0)
    sim.step([(0, 64)])
    shared = sim.finish(0, keep_blocks=2)
    b = sim.add(1, shared_blocks=shared)
    b.q, b.k, b.v = list(a.q), list(a.k), list(a.v)  # the cached prefix's rows
    check(sim, sim.step([(1, 10)]), 32)
    check(sim, sim.step([(1, 1)]), 32)


@pytest.mark.parametrize("grouped,batch_invariant,codes", [
    (False, False, False), (True, False, False), (False, True, False), (False, False, True),
    (True, False, True)])
@pytest.mark.parametrize("window,sliding", [(0, None), (32, None), (64, None), (0, 80),
                                            (32, 80), (32, 48)])
def test_flash_attention_prefill_plan(model_factory, monkeypatch, window, sliding, grouped,
                                      batch_invariant, codes):
    """The GPU prefill path (FlashAttention over dequantized pages, window segments merged
    by LSE), run here with a PyTorch stand-in for flash_attn_varlen_func; grouped: a page
    budget of one block puts every prefill request in a group of its own; batch_invariant:
    decodes too, through a stand-in for vLLM's unified Triton attention (each window
    segment a request of its own); sliding: a sliding-window layer, FlashAttention's window
    in aligned positions (padded codes rows), freed blocks pointing anywhere; codes: the
    codes part on codes_attention's Triton kernel. On the GPU where there is one (the
    Triton kernels that dequantize and merge need its tensors); without one in Triton's
    interpreter, float16 with codes (the kernel's products are 16-bit)."""
    from helpers import unified_attention_sdpa, varlen_sdpa

    from vllm_pq_backend import codes_attention, ops

    monkeypatch.setattr(ops, "flash_attn_for", lambda t: (varlen_sdpa, lambda **kw: 3))
    monkeypatch.setattr(ops, "triton_attn_for", lambda t: unified_attention_sdpa)
    model = model_factory(64, 4, 2)
    vc = vllm_config(model, block_size=64, pq={"window": window})
    if torch.cuda.is_available():  # the Triton kernels compiled, next to the CUDA kernels
        sim = Sim(vc, seed=11, sliding_window=sliding, dtype=TARGETS["cuda"][0], device="cuda")
        sim.tol = TARGETS["cuda"][1]
    elif not codes:
        sim = Sim(vc, seed=11, sliding_window=sliding)
        sim.tol = TARGETS["cpu"][1]
    else:
        sim = Sim(vc, seed=11, sliding_window=sliding, dtype=torch.float16)
        sim.tol = 5e-3
    if grouped:
        sim.builder.prefill_page_tokens = 64
    sim.builder.fallback = False  # the GPU's plans, on the CPU too
    sim.builder.batch_invariant = batch_invariant
    # every group that reads codes on the kernel, or none
    monkeypatch.setattr(codes_attention, "BREAK_EVEN_ROWS", 10**9 if codes else -1)
    _prefill_plan_steps(sim, window, codes)


def _segment_keys(plan):
    """The plan's SegmentKeys, or None (no window segments)."""
    from vllm_pq_backend.plans import BatchInvariantPlan, CodesPlan, SegmentsPlan

    if isinstance(plan, BatchInvariantPlan):
        plan = plan.paged
    if isinstance(plan, CodesPlan):
        return None if plan.window is None else plan.window.keys
    return plan.keys if isinstance(plan, SegmentsPlan) else None


def _prefill_plan_steps(sim, window, codes):
    from vllm_pq_backend.plans import CodesPlan

    steps = []
    orig = sim.builder.build

    def build(*a, **kw):
        md = orig(*a, **kw)
        for g in md.prefills:
            # a group on the kernel iff it has rows that read codes: every row without a
            # window, the rows at positions >= W with one
            lens = md.seq_lens_cpu[md.num_decodes + g.req_start : md.num_decodes + g.req_end]
            reads = window == 0 or bool((lens > window).any())
            steps.append(isinstance(g.plan, CodesPlan) == (codes and reads))
            # segment keys without a copy exactly when no earlier step's window entries join them
            keys = _segment_keys(g.plan)
            assert keys is None or keys.in_order == (keys.store_rows.numel() == 0)
        return md

    sim.builder.build = build
    for rid in range(3):
        sim.add(rid)
    check(sim, sim.step([(0, 100), (1, 7)]), window)
    check(sim, sim.step([(0, 1), (1, 60), (2, 129)]), window)  # continuation chunks
    check(sim, sim.step([(2, 70), (0, 2)]), window)
    # two one-page prefills beside a long decode: the group's block ids are a strided
    # column of the block table
    for rid in (5, 6):
        sim.add(rid)
    check(sim, sim.step([(0, 1), (5, 20), (6, 30)]), window)
    # two prefix-cache hits on request 2's first two blocks, prefilled in one step (on
    # FlashAttention their shared pages are dequantized once: PagesPlan.page_first)
    a = sim.reqs[2]
    shared = sim.finish(2, keep_blocks=2)
    for rid in (3, 4):
        b = sim.add(rid, shared_blocks=shared)
        b.q, b.k, b.v = ([torch.cat(x)[: 2 * sim.B]] for x in (a.q, a.k, a.v))
    check(sim, sim.step([(0, 1), (3, 40), (4, 9)]), window)
    assert steps and all(steps)


# (tokens, accepted) per verification step: crossing segment starts (W=32) with drafts
# past them rejected, a decode right after a rejection, a step that starts on a boundary
SPEC_STEPS = [(30, 30), (4, 1), (1, 1), (4, 2), (4, 4), (4, 1), (4, 4), (4, 3), (4, 1),
              (4, 4), (4, 4), (4, 4), (4, 4), (4, 4), (4, 2), (1, 1), (4, 1), (4, 4)]


def _speculative_sim(model_factory, device, dtype, draft_tokens):
    import types

    vc = vllm_config(model_factory(64, 4, 2), block_size=64, pq={"window": 32})
    if draft_tokens:
        spec = types.SimpleNamespace(method="ngram", num_speculative_tokens=draft_tokens,
                                     uses_draft_kv_cache=lambda: False)
        object.__setattr__(vc, "speculative_config", spec)
        vc.scheduler_config.async_scheduling = False  # as vLLM resolves it for ngram
    return Sim(vc, seed=13, dtype=dtype, device=device)


def _run_speculative_steps(sim):
    sim.add(0)
    for i, (n, accepted) in enumerate(SPEC_STEPS):
        check(sim, sim.step([(0, n)]), 32)
        if accepted < n:
            sim.reject(0, n - accepted, seed=100 + i)


@pytest.mark.parametrize("path", ["fallback", "segments",
                                  pytest.param("codes", marks=INTERPRETED)])
def test_rejected_drafts_across_a_window_boundary(model_factory, monkeypatch, path):
    """Speculative decoding (3 draft tokens): verification steps cross into the next window
    segment and their drafts there are rejected, so the next step (a verification or a
    decode) goes back before the boundary: every output equals the dense check of the
    tokens the request holds at that step, read from the window store as they were
    written, never as rejected drafts left them. On the CPU: the reference's path
    ("fallback") and the GPU's prefill plans with PyTorch stand-ins (helpers.use_gpu_paths:
    window segments, or the codes kernel in Triton's interpreter)."""
    dtype = torch.float16 if path == "codes" else torch.float32
    sim = _speculative_sim(model_factory, "cpu", dtype, draft_tokens=3)
    sim.tol = 5e-3 if path == "codes" else TARGETS["cpu"][1]
    assert sim.impl.state(sim.layer, torch.empty(0, dtype=dtype)).win_k.shape[0] == 2 * 17
    if path != "fallback":
        use_gpu_paths(monkeypatch, sim, path)
    _run_speculative_steps(sim)


def test_one_store_row_per_request_reads_rejected_drafts(model_factory):
    """The control for the test above: with one store row per request (how the engine
    runs without speculation), the same steps read keys that rejected drafts wrote."""
    sim = _speculative_sim(model_factory, "cpu", torch.float32, draft_tokens=0)
    sim.tol = TARGETS["cpu"][1]
    with pytest.raises(AssertionError, match="relative error"):
        _run_speculative_steps(sim)


@ON_GPU
def test_rejected_drafts_across_a_window_boundary_on_the_kernels(model_factory):
    """The same steps on the CUDA kernels (the decode kernel writes and reads the store row
    of its position's segment) and FlashAttention prefill."""
    sim = _speculative_sim(model_factory, "cuda", TARGETS["cuda"][0], draft_tokens=3)
    sim.tol = TARGETS["cuda"][1]
    _run_speculative_steps(sim)


def test_a_window_no_longer_than_the_drafts_is_refused(model_factory):
    """A verification step of more than W tokens could span three window segments, two of
    them in one store row: refused with the numbers."""
    import types

    from vllm_pq_backend.engine_config import EngineConfig

    vc = vllm_config(model_factory(64, 4, 2), block_size=64, pq={"window": 32})
    object.__setattr__(vc, "speculative_config",
                       types.SimpleNamespace(method="ngram", num_speculative_tokens=32))
    with pytest.raises(ValueError, match="pq window 32 must exceed the 32 speculative tokens"):
        EngineConfig.of(vc).window
