"""Prefill in vLLM: `LLM.generate(max_tokens=1)` on Llama-3-8B's shape with dummy weights
(common.make_model_dir), one backend per process, same engine settings for all:

  uncached   fresh random prompts of 1K..32K tokens, --batch-tokens tokens per call
             (prompt tokens/s)
  long       one prompt of --long tokens, prefilled in vLLM's chunks (seconds)
  prefix-hit --hits requests of --suffix new tokens each after a cached prefix of
             --prefix tokens (seconds for all; the prefix is cached by a first request)

Every timed call comes after an untimed one of the same shape (warm-up, CUDA graphs,
Triton compiles) with other tokens. Rows are appended to --out per backend;
eval/report.py compares them with FLASH_ATTN's of the same run (by git commit):

    python eval/bench_prefill.py --backend FLASH_ATTN
    python eval/bench_prefill.py --backend CUSTOM --m 64      # 4 bits (head_dim 128)
    python eval/bench_prefill.py --backend CUSTOM --m 64 --maps  # codebooks with K/V maps
    # tuning the prefill plan: prefix hits only, each path forced, in one engine
    python eval/bench_prefill.py --backend CUSTOM --lengths --long 0 --suffix 8 16 32 \
        --codes-rows 0 1000000000 --out X.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

from common import append_rows, engine_backend, make_model_dir, provenance

from vllm_pq_backend.layout import bits_of

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
LENGTHS = (1024, 4096, 16384, 32768)


def timed(llm, prompts) -> float:
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False)
    t0 = time.perf_counter()
    llm.generate(prompts, sp, use_tqdm=False)
    return time.perf_counter() - t0


def run(args) -> list[dict]:
    from vllm import LLM
    from vllm.inputs import TokensPrompt

    rng = random.Random(0)

    def prompt(n, prefix=()):
        return TokensPrompt(prompt_token_ids=list(prefix) + [rng.randrange(1000, 120000) for _ in range(n)])

    from vllm_pq_backend import codes_attention

    model = make_model_dir(args.m, args.maps)
    longest = max([args.long, *args.lengths, max(args.prefix, default=0) + max(args.suffix)])
    kw = dict(model=model, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
              max_model_len=longest + 16, gpu_memory_utilization=args.gpu_memory_utilization,
              enable_prefix_caching=True, seed=0)
    backend_kw, name = engine_backend(args.backend, args.m, args.maps)
    llm = LLM(**kw, **backend_kw)
    sched = llm.llm_engine.vllm_config.scheduler_config
    rows = []

    custom = args.backend == "CUSTOM"

    def emit(**row):  # with the threshold in force
        row = dict(backend=name, max_num_batched_tokens=sched.max_num_batched_tokens,
                   codes_rows=codes_attention.BREAK_EVEN_ROWS if custom else None, **row)
        print(json.dumps(row), flush=True)
        rows.append(row)

    default_rows = codes_attention.BREAK_EVEN_ROWS
    for codes_rows in args.codes_rows or [default_rows]:
        # the engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0): the plan reads
        # the threshold at every step, so one engine can time each setting
        codes_attention.BREAK_EVEN_ROWS = codes_rows
        for n in args.lengths:
            batch = max(1, args.batch_tokens // n)
            timed(llm, [prompt(n) for _ in range(batch)])  # warm-up, other tokens
            dt = timed(llm, [prompt(n) for _ in range(batch)])
            emit(case="uncached", prompt_tokens=n, batch=batch, seconds=round(dt, 3),
                 prompt_tok_s=round(batch * n / dt))
        if args.long:
            timed(llm, [prompt(args.long)])
            dt = timed(llm, [prompt(args.long)])
            emit(case="long", prompt_tokens=args.long, batch=1, seconds=round(dt, 3),
                 prompt_tok_s=round(args.long / dt))
        for suffix in args.suffix:
            for prefix_len in args.prefix:
                for _ in range(2):  # the first round warms up
                    prefix = [rng.randrange(1000, 120000) for _ in range(prefix_len)]
                    timed(llm, [prompt(suffix, prefix)])  # caches the prefix
                    dt = timed(llm, [prompt(suffix, prefix) for _ in range(args.hits)])
                emit(case="prefix-hit", prefix_tokens=prefix_len, suffix_tokens=suffix,
                     batch=args.hits, seconds=round(dt, 4),
                     prompt_tok_s=round(args.hits * suffix / dt))
    codes_attention.BREAK_EVEN_ROWS = default_rows
    stamp = dict(provenance(), bits=bits_of(128, args.m) if custom else None,
                 gpu_memory_utilization=args.gpu_memory_utilization)
    return [dict(r, **stamp) for r in rows]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=["CUSTOM", "FLASH_ATTN", "TURBOQUANT"], required=True)
    p.add_argument("--m", type=int, default=64, help="CUSTOM: subspaces (64: 4 bits, 32: 2 bits)")
    p.add_argument("--maps", action="store_true", help="CUSTOM: codebooks with K and V maps")
    p.add_argument("--lengths", type=int, nargs="*", default=list(LENGTHS))
    p.add_argument("--batch-tokens", type=int, default=65536)
    p.add_argument("--long", type=int, default=131072 - 16, help="0: no long prompt")
    p.add_argument("--prefix", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--suffix", type=int, nargs="+", default=[128])
    p.add_argument("--hits", type=int, default=16)
    p.add_argument("--codes-rows", type=int, nargs="+", default=None,
                   help="CUSTOM: the prefill plan's threshold (codes_attention.BREAK_EVEN_ROWS), "
                        "each value in turn: 0 never reads codes directly, a huge value always does")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--out", default="eval/results/prefill.json")
    args = p.parse_args()
    append_rows(args.out, run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
