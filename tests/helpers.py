"""Drive the backend the way vLLM's model runner does, without a model or a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import numpy as np
import pytest
import torch

from vllm_pq_backend import codebooks
from vllm_pq_backend.layout import NUM_CENTROIDS, window_start


def write_model_config(path, *, head_dim=64, q_heads=4, kv_heads=2, layers=2, vocab=512):
    os.makedirs(path, exist_ok=True)
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": q_heads * head_dim,
        "head_dim": head_dim,
        "intermediate_size": 256,
        "num_attention_heads": q_heads,
        "num_key_value_heads": kv_heads,
        "num_hidden_layers": layers,
        "vocab_size": vocab,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


def hf_config(path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path, local_files_only=True)


def random_codebooks(path, model_dir, m, seed=0, transforms=False, m_v=None):
    """Random centroids (K with ``m`` subspaces, V with ``m_v``, default ``m``; either may
    be a list of each layer's); with ``transforms``, random well-conditioned K and V maps
    (rotation x scales in [0.5, 2]), as calibration writes them."""
    cfg = hf_config(model_dir)
    d = codebooks.head_dim_of(cfg)
    g = torch.Generator().manual_seed(seed)
    m_v = m_v or m
    shape = (cfg.num_hidden_layers, cfg.num_key_value_heads)

    def draw(ms):
        if isinstance(ms, list):
            return [torch.randn(shape[1], x, NUM_CENTROIDS, d // x, generator=g) for x in ms]
        return torch.randn(*shape, ms, NUM_CENTROIDS, d // ms, generator=g)

    k, v = draw(m), draw(m_v)
    maps = {}
    if transforms:
        for name in ("k_transform", "v_transform"):
            q, _ = torch.linalg.qr(torch.randn(*shape[:2], d, d, generator=g))
            scales = 2 ** (torch.rand(*shape[:2], 1, d, generator=g) * 2 - 1)
            maps[name] = q * scales
    codebooks.save_codebooks(path, k, v, cfg, {"model": model_dir}, **maps)
    return path


def check_refusal(reason: str | None, words) -> None:
    """A start-up check's answer: None (served) where ``words`` is None, else one line
    holding every one of ``words``."""
    if words is None:
        assert reason is None, reason
        return
    assert reason is not None
    assert "\n" not in reason  # one line
    missing = [w for w in words if w not in reason]
    assert not missing, (missing, reason)


def vllm_config(model_dir, *, block_size, pq, max_num_seqs=16, max_model_len=2048):
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig

    mc = ModelConfig(
        model=model_dir, dtype="bfloat16", max_model_len=max_model_len,
        skip_tokenizer_init=True,
    )
    vc = VllmConfig(
        model_config=mc,
        cache_config=CacheConfig(block_size=block_size),
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_model_len,
            max_model_len=max_model_len, is_encoder_decoder=False,
        ),
        additional_config={"pq": pq},
    )
    # one worker in the scheduler's process, as a single-GPU engine runs: vLLM's CPU
    # platform (the tests without a GPU) would make it "mp"
    object.__setattr__(vc.parallel_config, "distributed_executor_backend", "uni")
    return vc


class RequestTable:
    """vLLM's model runner V2 request table (gpu/states.py RequestState): slots from a free
    list, ``req_id_to_index`` / ``index_to_req_id``. vLLM pops the list's end and appends
    freed slots (last freed, first reused); ``reuse`` also takes the first freed
    ("first-freed-first") or any ("random"), which the window rows must not depend on.
    ``free``: the free list as serving finds it."""

    def __init__(self, free, reuse="last-freed-first", seed=0):
        self.free = list(free)
        self.reuse = reuse
        self.rng = np.random.default_rng(seed)
        self.req_id_to_index: dict[str, int] = {}
        self.index_to_req_id: dict[int, str] = {}

    def add(self, req_id: str) -> int:
        at = {"last-freed-first": len(self.free) - 1, "first-freed-first": 0,
              "random": int(self.rng.integers(len(self.free)))}[self.reuse]
        slot = self.free.pop(at)
        self.req_id_to_index[req_id] = slot
        self.index_to_req_id[slot] = req_id
        return slot

    def remove(self, req_id: str) -> None:
        slot = self.req_id_to_index.pop(req_id)
        del self.index_to_req_id[slot]
        self.free.append(slot)


class Runner:
    """What the metadata builder reads of vLLM's model runner: its request table, found
    up the stack while the runner builds it (metadata.runner_requests)."""

    def __init__(self, req_states: RequestTable):
        self.req_states = req_states

    def builder(self, spec, vc, device="cpu"):
        from vllm_pq_backend.backend import PQAttentionBackend

        return PQAttentionBackend.get_builder_cls()(spec, ["layer"], vc, torch.device(device))


class Request:
    def __init__(self, rid, slot, blocks):
        self.rid, self.slot, self.blocks = rid, slot, blocks  # slot: vLLM's req_idx
        self.q, self.k, self.v = [], [], []  # every token's rows so far

    @property
    def length(self):
        return sum(x.shape[0] for x in self.k)


class Sim:
    """One attention layer of a model served by vLLM: requests come and go, each step
    builds CommonAttentionMetadata (decodes first), stores K/V, then attends."""

    def __init__(self, vc, *, num_blocks=64, layer_index=0, seed=0, dtype=torch.float32,
                 device="cpu", sliding_window=None, reuse="last-freed-first"):
        """``sliding_window``: the layer's (vLLM's convention, key j > i - sw); blocks wholly
        before every query's window are then handed over as vLLM does once it freed them:
        their block-table entries name the null block or blocks of other requests.
        ``reuse``: the order in which vLLM's request table hands out freed slots."""
        from vllm.config import set_current_vllm_config
        from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

        from vllm_pq_backend.backend import PQAttentionBackend

        self.vc = vc
        mc = vc.model_config
        self.d = mc.get_head_size()
        self.hq = mc.get_num_attention_heads(vc.parallel_config)
        self.hkv = mc.get_num_kv_heads(vc.parallel_config)
        self.B = vc.cache_config.block_size
        self.seed = seed
        self.dtype = dtype
        self.dev = torch.device(device)
        self.sw = sliding_window
        self.stale = np.random.default_rng(seed + 1)
        # vLLM's request slots, in the shuffled order its start-up warm-up leaves them
        # (test_backend._warmed_up): the window rows must not depend on that order
        self.req_states = RequestTable(np.random.default_rng(seed + 1).permutation(
            vc.scheduler_config.max_num_seqs).tolist(), reuse, seed)
        # the name vLLM's model runner asks for the layer's page size under
        # (engine_config.layer_of_caller: codebooks may give layers different bits)
        layer_name = f"model.layers.{layer_index}.self_attn.attn"
        with set_current_vllm_config(vc):
            kw = dict(block_size=self.B, num_kv_heads=self.hkv, head_size=self.d,
                      dtype=torch.bfloat16)
            spec = PQAttentionBackend.customize_spec(
                SlidingWindowSpec(sliding_window=sliding_window, **kw) if sliding_window
                else FullAttentionSpec(**kw)
            )
            self.impl = PQAttentionBackend.get_impl_cls()(
                self.hq, self.d, self.d**-0.5, self.hkv, sliding_window=sliding_window
            )
            self.builder = PQAttentionBackend.get_builder_cls()(
                spec, ["layer"], vc, self.dev
            )
        self.spec = spec
        self.layer = types.SimpleNamespace(layer_name=layer_name)
        self.kv_cache = torch.zeros(
            num_blocks, self.hkv, self.B, spec.state_content_bytes, dtype=torch.uint8,
            device=self.dev,
        )
        self.free_blocks = list(np.random.default_rng(seed).permutation(np.arange(1, num_blocks)))
        self.reqs: dict[int, Request] = {}

    def add(self, rid, shared_blocks=(), max_len=512):
        """A new request; ``shared_blocks`` are full blocks it starts with (prefix hit).
        Its q/k/v rows are drawn up front from (seed, rid), so they do not depend on how
        the request is scheduled."""
        r = Request(rid, self.req_states.add(f"req-{rid}"), list(shared_blocks))
        g = torch.Generator().manual_seed(self.seed * 1000 + rid)
        r.source = [
            torch.randn(max_len, h, self.d, generator=g).to(self.dev, self.dtype)
            for h in (self.hq, self.hkv, self.hkv)
        ]
        self.reqs[rid] = r
        return r

    def finish(self, rid, keep_blocks=0):
        r = self.reqs.pop(rid)
        self.req_states.remove(f"req-{rid}")
        self.free_blocks = r.blocks[keep_blocks:] + self.free_blocks
        return r.blocks[:keep_blocks]

    def reject(self, rid, n, seed):
        """Speculative decoding's rejected drafts: the request's last ``n`` tokens are
        dropped, and the tokens that take their positions are new rows (from ``seed``)."""
        r = self.reqs[rid]
        keep = r.length - n
        for rows in (r.q, r.k, r.v):
            rows[:] = [torch.cat(rows)[:keep]]
        g = torch.Generator().manual_seed(seed)
        for s in r.source:
            s[keep : keep + n] = torch.randn(s[keep : keep + n].shape, generator=g).to(s)

    def step(self, work: list[tuple[int, int]], rows_for=None, pad=0):
        """``work``: (rid, new tokens). Returns {rid: output [n, Hq, d]}. ``pad``: rows of
        junk after the step's tokens, their slots -1, as vLLM pads a step to a CUDA-graph
        size (num_actual_tokens stays the step's own count)."""
        from vllm.v1.attention.backend import CommonAttentionMetadata

        work = sorted(work, key=lambda w: w[1] > 1)  # decodes first, as vLLM reorders
        qsl, seq, slots, req_idx = [0], [], [], []
        q_all, k_all, v_all = [], [], []
        width = max(-(-(self.reqs[r].length + n) // self.B) for r, n in work)
        table = torch.zeros(len(work), width, dtype=torch.int32)
        for i, (rid, n) in enumerate(work):
            r = self.reqs[rid]
            start = r.length
            while len(r.blocks) * self.B < start + n:
                r.blocks.append(int(self.free_blocks.pop(0)))
            table[i, : len(r.blocks)] = torch.tensor(r.blocks, dtype=torch.int32)
            if self.sw:  # freed: before the first key any of this step's queries reads
                freed = max(0, start - self.sw + 1) // self.B
                table[i, :freed] = torch.from_numpy(
                    self.stale.integers(0, self.kv_cache.shape[0], freed).astype(np.int32))
            q, k, v = (x[start : start + n] for x in r.source)
            r.q.append(q), r.k.append(k), r.v.append(v)
            q_all.append(q), k_all.append(k), v_all.append(v)
            pos = np.arange(start, start + n)
            slots += [r.blocks[p // self.B] * self.B + p % self.B for p in pos]
            qsl.append(qsl[-1] + n)
            seq.append(start + n)
            req_idx.append(r.slot)
        qsl_t = torch.tensor(qsl, dtype=torch.int32)
        seq_t = torch.tensor(seq, dtype=torch.int32)
        dev = self.dev
        cam = CommonAttentionMetadata(
            query_start_loc=qsl_t.to(dev), query_start_loc_cpu=qsl_t, seq_lens=seq_t.to(dev),
            num_reqs=len(work), num_actual_tokens=qsl[-1], max_query_len=max(n for _, n in work),
            max_seq_len=max(seq), block_table_tensor=table.to(dev),
            slot_mapping=torch.tensor(slots + [-1] * pad, dtype=torch.int64, device=dev),
            seq_lens_cpu_upper_bound=seq_t, req_idx=np.array(req_idx),
        )
        md = self.builder.build(0, cam)
        # views of one packed row per token, strided as vLLM's qkv split leaves them
        junk = [torch.full((pad, *x[0].shape[1:]), 1e4, dtype=self.dtype, device=dev)
                for x in (q_all, k_all, v_all)]
        parts = [torch.cat(x + [j]) for x, j in zip((q_all, k_all, v_all), junk)]
        packed = torch.cat([x.flatten(1) for x in parts], dim=1)
        query, key, value = (y.view(x.shape) for x, y in zip(
            parts, packed.split([x[0].numel() for x in parts], dim=1)))
        out = torch.full_like(query, float("nan"))  # poisoned: every row must be written
        self.impl.forward(self.layer, query, key, value, self.kv_cache, md, out)
        return {rid: out[qsl[i] : qsl[i + 1]] for i, (rid, _) in enumerate(work)}

    def dense_reference(self, rid, window: int):
        """Independent check: SDPA over quantize-dequantized K/V (full precision inside the
        window), for every token of the request so far. With an exact store, the P
        largest-error tokens of each whole page (ranked in the frame the codes are in) read
        back as decoded plus their residual rounded to 16 bits."""
        from vllm_pq_backend.layout import residual_dtype, window_start
        from vllm_pq_backend.reference import code_errors, decode_codes, encode, map_rows

        st = self.impl._state
        r = self.reqs[rid]
        q, k, v = (torch.cat(x).float() for x in (r.q, r.k, r.v))

        def with_entries(xt, y):
            p, b = st.layout.exact, self.B
            err = code_errors(xt, y)
            out = y.clone()
            for page in range(xt.shape[0] // b if p else 0):
                for h in range(xt.shape[1]):
                    e = err[page * b : (page + 1) * b, h].tolist()
                    for _, i in sorted((-v, i) for i, v in enumerate(e) if v > 0)[:p]:
                        t = page * b + i
                        out[t, h] += (xt[t, h] - y[t, h]).to(residual_dtype(self.dtype)).float()
            return out

        def dequant(x, cb, t):  # codes of x t, read back and mapped by t^-1
            if t is None:
                return with_entries(x, decode_codes(encode(x, cb), cb))
            # the backend encodes the mapped row as stored: rounded to the activation dtype
            # (mapped as the backend maps it, so that the exact store ranks the same bits)
            xt = map_rows(t, x.to(self.dtype)).float()
            y = with_entries(xt, decode_codes(encode(xt, cb), cb))
            return torch.einsum("nhe,hed->nhd", y, torch.linalg.inv(t))

        k_hat = dequant(k, st.k_cb32, st.maps["key"])
        v_hat = dequant(v, st.v_cb32, st.maps["value"])
        n = k.shape[0]
        pos = torch.arange(n, device=k.device)
        ws = window_start(pos, window)
        g = self.hq // self.hkv
        outs = []
        for i in range(n):
            exact = (pos >= ws[i]).view(-1, 1, 1)
            lo = max(0, i - self.sw + 1) if self.sw else 0
            kk = torch.where(exact, k, k_hat)[lo : i + 1].repeat_interleave(g, 1)
            vv = torch.where(exact, v, v_hat)[lo : i + 1].repeat_interleave(g, 1)
            s = torch.einsum("hd,khd->hk", q[i], kk) * self.d**-0.5
            outs.append(torch.einsum("hk,khd->hd", s.softmax(-1), vv))
        return torch.stack(outs)


# The codes kernel runs on CPU tensors only in Triton's interpreter, which conftest.py
# turns on where no GPU is visible; on a GPU machine the kernel tests run it compiled.
INTERPRETED = pytest.mark.skipif(torch.cuda.is_available(),
                                 reason="Triton's interpreter: machines without a GPU")


def use_gpu_paths(monkeypatch, sim, path):
    """The GPU prefill paths on the CPU: FlashAttention and vLLM's Triton attention by
    PyTorch stand-ins (below); "codes": every group that reads codes on the codes kernel
    (in Triton's interpreter), else none."""
    from vllm_pq_backend import codes_attention, ops

    sim.builder.fallback = False
    monkeypatch.setattr(ops, "flash_attn_for", lambda t: (varlen_sdpa, lambda **kw: 3))
    monkeypatch.setattr(ops, "triton_attn_for", lambda t: unified_attention_sdpa)
    monkeypatch.setattr(codes_attention, "BREAK_EVEN_ROWS", 10**9 if path == "codes" else -1)


def unified_attention_sdpa(q, k, v, out, cu_seqlens_q, max_seqlen_q, seqused_k, max_seqlen_k,
                           softmax_scale, causal, window_size, block_table, softcap,
                           q_descale, k_descale, v_descale, sinks=None):
    """vLLM's unified Triton attention (the subset batch-invariant mode uses): paged K/V
    ``[blocks, B, H, d]``, bottom-right causal, optionally a sliding window ``(sw - 1, 0)``
    and attention sinks (``sinks [Hq]``, as FlashAttention's ``s_aux``)."""
    assert causal and window_size[1] in (-1, 0) and softcap == 0 and q_descale is None
    assert k_descale.shape == (len(seqused_k), k.shape[2]) and (k_descale == 1).all()
    varlen_sdpa(q, k, v, cu_seqlens_q, max_seqlen_q, softmax_scale, True, max_seqlen_k,
                seqused_k=seqused_k, block_table=block_table, out=out, window_size=window_size,
                s_aux=sinks)


def varlen_sdpa(q, k, v, cu_seqlens_q, max_seqlen_q, softmax_scale, causal, max_seqlen_k,
                cu_seqlens_k=None, seqused_k=None, block_table=None, out=None,
                return_softmax_lse=False, fa_version=None, num_splits=0, window_size=(-1, -1),
                s_aux=None):
    """FlashAttention's varlen API (the subset the backend uses) in plain PyTorch:
    packed or paged K/V, bottom-right alignment of queries to keys (for causal and for
    ``window_size = (left, right)``, -1 unbounded), LSE ``[H, tokens]``; a row without keys
    gives 0 and LSE -inf, as FlashAttention. ``s_aux [Hq]``: attention sinks as FA3 takes
    them, a logit per query head in each row's softmax with no value, which the LSE counts
    (FA3's Softmax::finalize_aux)."""
    left, right = window_size
    nq, hq, d = q.shape
    g = hq // k.shape[-2]
    o = torch.zeros(nq, hq, d, dtype=torch.float32, device=q.device)
    lse = torch.full((hq, nq), float("-inf"), device=q.device)
    for s in range(len(cu_seqlens_q) - 1):
        a, b = int(cu_seqlens_q[s]), int(cu_seqlens_q[s + 1])
        if block_table is not None:
            n = int(seqused_k[s])
            kk = k[block_table[s].long()].flatten(0, 1)[:n]
            vv = v[block_table[s].long()].flatten(0, 1)[:n]
        else:
            ka, kb = int(cu_seqlens_k[s]), int(cu_seqlens_k[s + 1])
            kk, vv, n = k[ka:kb], v[ka:kb], kb - ka
        if n == 0 or b == a:
            continue
        sc = torch.einsum("qhd,khd->hqk", q[a:b].float(), kk.float().repeat_interleave(g, 1))
        sc = sc * softmax_scale
        qi = torch.arange(b - a, device=sc.device).view(-1, 1) + (n - (b - a))  # aligned
        kj = torch.arange(n, device=sc.device).view(1, -1)
        if causal:
            right = 0
        if right >= 0:
            sc = sc.masked_fill(kj > qi + right, float("-inf"))
        if left >= 0:
            sc = sc.masked_fill(kj < qi - left, float("-inf"))
        if s_aux is not None:  # the sink as one more logit of every row, with no value
            sink = s_aux.float().view(-1, 1, 1).expand(-1, b - a, 1)
            sc = torch.cat([sc, sink], -1)
        lse[:, a:b] = torch.logsumexp(sc, -1)
        p = sc.softmax(-1).nan_to_num(0.0)  # rows without keys: 0
        if s_aux is not None:
            p = p[..., :-1]
        o[a:b] = torch.einsum("hqk,khd->qhd", p, vv.float().repeat_interleave(g, 1))
    if out is not None:
        out.copy_(o)
    return (o, lse) if return_softmax_lse else o


def plan_segments_loops(starts, q_lens, lens, rows, window):
    """The window segments and window writes of plans.py written as plain loops (the
    oracle of plans._segments and plans._window_writes): dicts of the int32 and int64
    arrays, by the names plans.py gives them."""
    n = len(lens)
    total_q = int(starts[-1])
    seg_q, seg_k, fp_src, st_rows, st_slots, code_out = [0], [0], [], [], [], []
    seg_req, seg_col, fp_at, seg_end = [], [], [], []
    win_tok, win_rows, win_slots = [], [], []
    for i in range(n):
        length, first, tok0 = int(lens[i]), int(lens[i] - q_lens[i]), int(starts[i])
        for g0 in range(window_start(first, window), length, window):
            a, e = max(first, g0), min(length, g0 + window)
            seg_q.append(seg_q[-1] + e - a)
            n_store = max(0, first - g0)  # earlier tokens of this segment
            fp_src.extend(range(total_q + len(st_rows), total_q + len(st_rows) + n_store))
            st_rows.extend([rows[i]] * n_store)
            st_slots.extend(range(g0 % window, g0 % window + n_store))
            fp_src.extend(range(tok0 + max(0, g0 - first), tok0 + e - first))
            seg_k.append(seg_k[-1] + e - g0)
            if g0 > 0:
                code_out.extend(range(tok0 + a - first, tok0 + e - first))
            # the segment's own subpage: its keys (numbered as in fp_src), then none
            first_key = seg_k[-2]
            fp_at.extend(range(first_key, first_key + e - g0))
            fp_at.extend([-1] * (g0 + window - e))
            seg_req.append(i)
            seg_col.append(g0 // window)
            seg_end.append(e)
        last = max(first, window_start(length - 1, window))
        win_tok.extend(range(tok0 + last - first, tok0 + length - first))
        win_rows.extend([rows[i]] * (length - last))
        win_slots.extend(p % window for p in range(last, length))
    i32 = dict(seg_cu_q=seg_q, seg_cu_k=seg_k, seg_end=seg_end)
    i64 = dict(fp_src=fp_src, store_rows=st_rows, store_slots=st_slots, win_tokens=win_tok,
               win_rows=win_rows, win_slots=win_slots, code_out=code_out, seg_req=seg_req,
               seg_col=seg_col, fp_at=fp_at)
    return i32, i64


def compile_script(name: str) -> str:
    """Run tests/``name`` (a script compiling Triton kernels for sm_90) in a process of its
    own, without Triton's interpreter and on this checkout's package; its stdout."""
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=os.pathsep.join(
        filter(None, [os.path.dirname(here), os.environ.get("PYTHONPATH")])))
    res = subprocess.run([sys.executable, os.path.join(here, name)], env=env,
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout
