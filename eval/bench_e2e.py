"""End-to-end decode throughput in vLLM: `LLM.generate` on a model of Llama-3-8B's full
shape (32 layers, 32 query / 8 KV heads, head_dim 128) with dummy weights, for one
backend per process (CUSTOM, FLASH_ATTN or TURBOQUANT 4bit_nc), at 1K, 8K and 32K context
with the largest batch the backend's KV cache holds (capped, see --max-batch), same
gpu_memory_utilization for all. Also records each backend's KV capacity in tokens.

Decode is measured apart from prefill, on the same prompts with prefix caching on:
  t_cold = generate(max_tokens=1)      prefill (reported, not used for decode)
  t_1    = generate(max_tokens=1)      cached prefill: the last partial block again
  t_n    = generate(max_tokens=1 + N)  the same, then N decode steps for every request
decode tokens/s = batch * N / (t_n - t_1). Each run appends its rows to --out; run it
once per backend, then the table compares them:

    python eval/bench_e2e.py --backend FLASH_ATTN
    python eval/bench_e2e.py --backend CUSTOM --m 32
    python eval/bench_e2e.py --backend CUSTOM --m 64 --maps  # codebooks with K/V maps
    python eval/bench_e2e.py --backend TURBOQUANT
    python eval/bench_e2e.py --table
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from provenance import provenance  # eval/ is the script's directory

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # read the engine's KV size

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "max_position_embeddings": 131072, "hidden_act": "silu",
    "torch_dtype": "bfloat16", "bos_token_id": 128000, "eos_token_id": 128001,
    "tie_word_embeddings": False,
}
CONTEXTS = (1024, 8192, 32768)


def write_model_dir(d: str, ms, maps: bool = False) -> str:
    """config.json of Llama-3-8B's shape in ``d``, and random codebooks for CUSTOM with
    each M of ``ms`` (speed does not depend on what the centroids are). With ``maps`` the
    codebooks carry K and V maps, as ``calibrate`` writes them by default: random rotations,
    so that the query / key / value / output maps run as with calibrated codebooks while the
    store sees rows distributed as without maps (speed does not depend on the maps' values)."""
    import torch
    from transformers import LlamaConfig

    from vllm_pq_backend.codebooks import save_codebooks
    from vllm_pq_backend.config import default_codebook_path

    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(LLAMA3_8B, f)
    cfg = LlamaConfig(**LLAMA3_8B)
    g = torch.Generator().manual_seed(0)
    for m in ms:
        shape = (cfg.num_hidden_layers, cfg.num_key_value_heads, m, 256, cfg.head_dim // m)
        k, v = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
        rotations = {}
        if maps:
            for name in ("k_transform", "v_transform"):
                rotations[name] = torch.linalg.qr(torch.randn(*shape[:2], cfg.head_dim, cfg.head_dim,
                                                              generator=g))[0].contiguous()
        save_codebooks(default_codebook_path(d, m), k, v, cfg, {"model": "random (benchmark)"},
                       **rotations)
    return d


def make_model_dir(m: int, maps: bool = False) -> str:
    """A temporary Llama-3-8B-shaped model folder with random codebooks of M ``m``."""
    return write_model_dir(tempfile.mkdtemp(prefix="llama3-8b-shape-"), [m], maps)


def engine_backend(backend: str, m: int, maps: bool = False) -> tuple[dict, str]:
    """`LLM` keyword arguments that pick ``backend``, and its rows' name (CUSTOM by bits
    per element: ``m`` subspaces of head_dim 128; ", maps" where its codebooks have them)."""
    from vllm_pq_backend.layout import bits_of

    if backend == "CUSTOM":
        return (dict(attention_backend="CUSTOM", additional_config={"pq": {"m": m}}),
                f"CUSTOM {bits_of(128, m)} bits" + (", maps" if maps else ""))
    if backend == "TURBOQUANT":
        return dict(kv_cache_dtype="turboquant_4bit_nc"), "TURBOQUANT 4bit_nc"
    return dict(attention_backend=backend), backend


def append_rows(path: str, rows: list[dict]) -> None:
    """``rows`` into ``path``'s list in place of any earlier rows of the same backends."""
    old = json.load(open(path))["rows"] if os.path.exists(path) else []
    keep = [r for r in old if r["backend"] not in {x["backend"] for x in rows}]
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump({"rows": keep + rows}, f, indent=1)


def timed_generate(llm, prompts, max_tokens):
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    dt = time.perf_counter() - t0
    assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs)
    return dt


def run(args) -> list[dict]:
    import random

    from vllm import LLM
    from vllm.inputs import TokensPrompt

    model = make_model_dir(args.m, args.maps)
    kw = dict(model=model, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
              max_model_len=max(args.contexts) + args.gen_tokens + 256,
              gpu_memory_utilization=args.gpu_memory_utilization,
              max_num_seqs=args.max_num_seqs, enable_prefix_caching=True, seed=0)
    backend_kw, name = engine_backend(args.backend, args.m, args.maps)
    kw.update(backend_kw)
    t0 = time.time()
    llm = LLM(**kw)
    start_s = time.time() - t0
    cc = llm.llm_engine.vllm_config.cache_config
    capacity = cc.num_gpu_blocks * cc.block_size
    print(f"{name}: KV capacity {capacity} tokens (block {cc.block_size}), "
          f"engine start {start_s:.0f} s", flush=True)
    rng = random.Random(0)
    rows = []
    for ctx, cap in zip(args.contexts, args.max_batch):
        per_seq = -(-(ctx + args.gen_tokens + 1) // cc.block_size) * cc.block_size
        fits = capacity // per_seq
        batch = min(fits, cap, args.max_num_seqs)
        if batch == 0:
            rows.append(dict(backend=name, context=ctx, batch=0, fits=fits, kv_capacity_tokens=capacity))
            continue
        prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(1000, 120000) for _ in range(ctx)])
                   for _ in range(batch)]
        t_cold = timed_generate(llm, prompts, 1)
        t_1 = min(timed_generate(llm, prompts, 1) for _ in range(2))
        t_n = timed_generate(llm, prompts, 1 + args.gen_tokens)
        tps = batch * args.gen_tokens / (t_n - t_1)
        row = dict(backend=name, context=ctx, batch=batch, fits=fits, batch_cap=cap,
                   gen_tokens=args.gen_tokens, prefill_s=round(t_cold, 2),
                   cached_prefill_s=round(t_1, 3), generate_s=round(t_n, 3),
                   decode_tok_s=round(tps, 1), step_ms=round(1e3 * (t_n - t_1) / args.gen_tokens, 2),
                   kv_capacity_tokens=capacity, block_size=cc.block_size)
        print(json.dumps(row), flush=True)
        rows.append(row)
    stamp = dict(provenance(), gpu_memory_utilization=args.gpu_memory_utilization,
                 engine_start_s=round(start_s))
    return [dict(r, **stamp) for r in rows]


def table(path: str) -> str:
    rows = json.load(open(path))["rows"]
    by = {(r["backend"], r["context"]): r for r in rows}
    out = ["| context | backend | KV capacity (tokens) | batch (fits) | decode tok/s | step ms | vs FLASH_ATTN "
           "| prefill tok/s |", "|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["context"], r["backend"])):
        fa = by.get(("FLASH_ATTN", r["context"]))
        rel = f"{r['decode_tok_s'] / fa['decode_tok_s']:.2f}x" if fa and r.get("decode_tok_s") and fa.get("decode_tok_s") else ""
        pf = f"{r['batch'] * r['context'] / r['prefill_s']:.0f}" if r.get("prefill_s") else ""
        out.append(f"| {r['context']} | {r['backend']} | {r['kv_capacity_tokens']:,} | {r['batch']} ({r['fits']}) "
                   f"| {r.get('decode_tok_s', '')} | {r.get('step_ms', '')} | {rel} | {pf} |")
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=["CUSTOM", "FLASH_ATTN", "TURBOQUANT"])
    p.add_argument("--m", type=int, default=32)
    p.add_argument("--maps", action="store_true", help="CUSTOM: codebooks with K and V maps")
    p.add_argument("--contexts", type=int, nargs="+", default=list(CONTEXTS))
    p.add_argument("--max-batch", type=int, nargs="+", default=[256, 128, 64],
                   help="batch cap per context (bounds the prefill time of the benchmark)")
    p.add_argument("--gen-tokens", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--out", default="eval/results/e2e_throughput.json")
    p.add_argument("--table", action="store_true", help="print the table of --out and exit")
    args = p.parse_args()
    if args.table:
        print(table(args.out))
        return 0
    if args.backend is None or len(args.max_batch) != len(args.contexts):
        p.error("--backend is required, and one --max-batch per context")
    append_rows(args.out, run(args))
    print(table(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
