"""CUSTOM under what vLLM's scheduler does, on SmolLM2-135M, greedy: each variant's
outputs against the same backend's baseline (CUDA graphs, prefix caching, async
scheduling), and FLASH_ATTN under the same variants as the control: vLLM is not
batch-invariant, so a variant that changes GEMM shapes (chunking, eager, preemption's
recompute) moves K/V in their last bits under any backend.

Variants: prefix caching off; chunked prefill with a 64-token budget; preemption forced
with a tiny KV cache; enforce_eager (no CUDA graphs). Prompts share long prefixes (so
prefix caching hits full blocks) and their lengths straddle block and window edges.
For each divergence the baseline's log-probability margin between its token and the
variant's token at the first differing step says whether it was a near-tie (numerics)
or a confident token changed (a bug).

With --batch-invariant the same runs happen under VLLM_BATCH_INVARIANT=1, vLLM's mode
whose GEMMs, reductions and attention backends are meant not to depend on the batch;
the rows record how close each variant then comes to identical outputs.

--fidelity compares instead each generated token's log-probability as decoding computed
it, step by step, with the one a single prefill of prompt + generation computes for the
same position (what lm-eval's loglikelihood requests score): greedy, eager engines,
prefix caching off so that the prefill recomputes every position; CUSTOM with window 0
and with --window. Equal semantics (layout.window_start) make the two agree up to
numerics; under --batch-invariant they agree bit for bit.

    python eval/vllm_features.py --model eval/data/smollm2 --heldout eval/data/text/heldout.jsonl
    python eval/vllm_features.py ... --batch-invariant [--eager]
    python eval/vllm_features.py ... --fidelity [--batch-invariant] --out OUT.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

from common import provenance

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

VARIANTS = {
    "baseline": {},
    "no_prefix_caching": {"enable_prefix_caching": False},
    "chunked_prefill_64": {"max_num_batched_tokens": 64, "enable_chunked_prefill": True},
    "preemption": {"num_gpu_blocks_override": 24},  # blocks of 128 tokens, see run()
    "enforce_eager": {"enforce_eager": True},
}


def prompts_from(path, tokenizer, n_groups, per_group):
    docs = [json.loads(line)["text"] for line in open(path)]
    out = []
    for g in range(n_groups):
        ids = tokenizer(docs[g], add_special_tokens=False)["input_ids"]
        prefix = [tokenizer.bos_token_id] + ids[:300 + 37 * g]
        for j in range(per_group):  # same prefix, different tails
            tail = ids[400 + 50 * j : 400 + 50 * j + 5 + 41 * j]
            out.append(prefix + tail)
    return out


def engine_kwargs(args, backend, window, **kw):
    """LLM(...) arguments every engine here shares, then ``kw``; CUSTOM gets M and
    ``window``."""
    kw = dict(model=args.model, attention_backend=backend, max_model_len=2048,
              gpu_memory_utilization=0.3, seed=0, **kw)
    if backend == "CUSTOM":
        kw["additional_config"] = {"pq": {"m": args.m, "window": window}}
    return kw


def run(backend, name, overrides, args, prompts):
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw = engine_kwargs(args, backend, args.window, max_num_seqs=32, disable_log_stats=False,
                       compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32]})
    if args.eager:
        kw["enforce_eager"] = True
    kw.update(overrides)
    if "num_gpu_blocks_override" in overrides and backend != "CUSTOM":
        # The same 3,072-token KV budget in FLASH_ATTN's 16-token blocks (CUSTOM uses 128).
        kw["num_gpu_blocks_override"] = overrides["num_gpu_blocks_override"] * 128 // 16
    t0 = time.time()
    llm = LLM(**kw)
    vc = llm.llm_engine.vllm_config
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                        SamplingParams(max_tokens=args.gen_tokens, temperature=0.0, logprobs=5),
                        use_tqdm=False)
    metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    info = dict(
        variant=name, overrides=overrides, seconds=round(time.time() - t0, 1),
        cudagraph_mode=str(vc.compilation_config.cudagraph_mode),
        async_scheduling=bool(vc.scheduler_config.async_scheduling),
        prefix_caching=bool(vc.cache_config.enable_prefix_caching),
        block_size=vc.cache_config.block_size, kv_blocks=vc.cache_config.num_gpu_blocks,
        preemptions=metrics.get("vllm:num_preemptions"),
        prefix_cache_hits=metrics.get("vllm:prefix_cache_hits"),
    )
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [[{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs]
                for o in outs]
    return info, tokens, logprobs


def in_own_process(fn, *args):
    """Each engine in a fresh process: a second engine in one process can trip vLLM's
    start-up memory profiling while the first one's memory is still being freed."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as ex:
        return ex.submit(fn, *args).result()


def fidelity_run(backend, window, args, prompts):
    """[(decode logprobs, prefill logprobs)] of every prompt's generated tokens."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(**engine_kwargs(args, backend, window, enforce_eager=True,
                              enable_prefix_caching=False))
    gen = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                       SamplingParams(max_tokens=args.gen_tokens, temperature=0.0, logprobs=0),
                       use_tqdm=False)
    full = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, gen)]
    pre = llm.generate([TokensPrompt(prompt_token_ids=f) for f in full],
                       SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0),
                       use_tqdm=False)
    pairs = []
    for p, g, o in zip(prompts, gen, pre):
        toks = g.outputs[0].token_ids
        dec = [step[t].logprob for t, step in zip(toks, g.outputs[0].logprobs)]
        pf = [o.prompt_logprobs[len(p) + j][t].logprob for j, t in enumerate(toks)]
        pairs.append((dec, pf))
    return pairs


def fidelity(args, tok) -> int:
    """Decode against one prefill, per backend (and CUSTOM window), into --out."""
    docs = [json.loads(line)["text"] for line in open(args.heldout)][:12]
    # 126 + 43 i tokens: generations cross window and block edges (128, 256, 384, 512).
    prompts = [([tok.bos_token_id] + tok(d, add_special_tokens=False)["input_ids"])
               [: 126 + 43 * i] for i, d in enumerate(docs)]
    result = dict(provenance(), batch_invariant=args.batch_invariant, m=args.m,
                  gen_tokens=args.gen_tokens, prompt_lens=[len(x) for x in prompts], rows=[])
    for backend in args.backends:
        for window in sorted({0, args.window}) if backend == "CUSTOM" else [None]:
            pairs = in_own_process(fidelity_run, backend, window, args, prompts)
            diffs = [abs(a - b) for dec, pf in pairs for a, b in zip(dec, pf)]
            row = dict(backend=backend, window=window, tokens=len(diffs),
                       bitwise_equal=sum(d == 0 for d in diffs),
                       max_abs_diff=max(diffs), mean_abs_diff=sum(diffs) / len(diffs))
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
            os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
            with open(args.out, "w") as f:  # after each row: a cut-short run keeps its rows
                json.dump(result, f, indent=1)
    return 0


def compare(tokens, base, base_lp):
    """Identical outputs, and for each divergence its step and the baseline's margin
    logp(baseline token) - logp(variant token) there (None: not in the baseline's top 5)."""
    same = sum(a == b for a, b in zip(tokens, base))
    divs = []
    for a, b, lp in zip(tokens, base, base_lp):
        i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if i is None:
            continue
        alt = lp[i].get(a[i])
        divs.append(dict(step=i, margin=None if alt is None else round(lp[i][b[i]] - alt, 4)))
    return f"{same}/{len(base)}", divs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--heldout", required=True)
    p.add_argument("--backends", nargs="+", default=["CUSTOM", "FLASH_ATTN"])
    p.add_argument("--m", type=int, default=32)
    p.add_argument("--window", type=int, default=128)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--gen-tokens", type=int, help="tokens generated per prompt (48; 64 with --fidelity)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="run under VLLM_BATCH_INVARIANT=1 (default --out: "
                   "eval/results/vllm_features_batch_invariant.json)")
    p.add_argument("--eager", action="store_true",
                   help="every engine, the baseline too, with enforce_eager (no torch.compile, "
                   "no CUDA graphs): separates compiled-kernel numerics from scheduling")
    p.add_argument("--fidelity", action="store_true",
                   help="decode against one prefill instead of the variants (needs --out)")
    p.add_argument("--out")
    args = p.parse_args()
    if args.fidelity and not args.out:
        p.error("--fidelity needs --out")
    args.gen_tokens = args.gen_tokens or (64 if args.fidelity else 48)
    if args.variants[0] != "baseline":
        p.error("--variants must start with baseline: every variant is compared with it")
    if args.batch_invariant:
        os.environ["VLLM_BATCH_INVARIANT"] = "1"  # read when vLLM is imported, below
    args.out = args.out or "eval/results/vllm_features{}.json".format(
        "_batch_invariant" if args.batch_invariant else "")

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    if args.fidelity:
        return fidelity(args, tok)
    prompts = prompts_from(args.heldout, tok, 8, 3)
    rows = []
    for backend in args.backends:
        base = base_lp = None
        for name in args.variants:
            info, tokens, lp = in_own_process(run, backend, name, VARIANTS[name], args, prompts)
            if base is None:
                base, base_lp = tokens, lp
            info["backend"] = backend
            info["identical_to_baseline"], info["divergences"] = compare(tokens, base, base_lp)
            rows.append(info)
            print(json.dumps(info), flush=True)
            write(args, prompts, rows)  # after each variant: a cut-short run keeps its rows
    return 0


def write(args, prompts, rows):
    result = dict(
        provenance(), batch_invariant=args.batch_invariant, eager=args.eager,
        m=args.m, window=args.window, gen_tokens=args.gen_tokens,
        prompts=len(prompts), prompt_lens=[len(x) for x in prompts], rows=rows,
    )
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
