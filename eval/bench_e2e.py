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
once per backend; eval/report.py makes the tables (each row against FLASH_ATTN's of the
same run, by git commit) and --plot the figure:

    python eval/bench_e2e.py --backend FLASH_ATTN
    python eval/bench_e2e.py --backend CUSTOM --m 64         # 4 bits per element (head_dim 128)
    python eval/bench_e2e.py --backend CUSTOM --m 32         # 2 bits
    python eval/bench_e2e.py --backend CUSTOM --m 64 --maps  # codebooks with K/V maps
    python eval/bench_e2e.py --backend TURBOQUANT
    python eval/bench_e2e.py --plot
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from common import append_rows, engine_backend, make_model_dir, provenance

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # read the engine's KV size

CONTEXTS = (1024, 8192, 32768)


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


def plot(path: str) -> str:
    """Decode tokens/s against context and KV capacity, per backend (its latest run), from
    ``path``'s rows; written next to it as .png (needs matplotlib, in the eval extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = json.load(open(path))["rows"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for name in dict.fromkeys(r["backend"] for r in rows):
        latest = max(r["date"] for r in rows if r["backend"] == name)
        rs = sorted((r for r in rows if r["backend"] == name and r["date"] == latest
                     and r.get("decode_tok_s")), key=lambda r: r["context"])
        a.plot([r["context"] for r in rs], [r["decode_tok_s"] for r in rs], marker="o", label=name)
        b.bar(name, rs[0]["kv_capacity_tokens"] / 1e6)
    devices = sorted({r["device"] for r in rows})
    a.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="decode tokens/s",
          title=f"LLM.generate decode, Llama-3-8B shape, {', '.join(devices)}")
    a.legend(fontsize=8)
    b.set(ylabel="KV cache capacity (million tokens)", title="capacity at gpu_memory_utilization=0.9")
    b.tick_params(axis="x", labelrotation=20, labelsize=8)
    fig.tight_layout()
    out = os.path.splitext(path)[0] + ".png"
    fig.savefig(out, dpi=120)
    return out


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
    p.add_argument("--plot", action="store_true", help="redraw the plot of --out and exit")
    args = p.parse_args()
    if args.plot:
        print("wrote", plot(args.out))
        return 0
    if args.backend is None or len(args.max_batch) != len(args.contexts):
        p.error("--backend is required (or --plot), and one --max-batch per context")
    append_rows(args.out, run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
