"""Where prefill's (or decode's) time goes: torch.profiler around `LLM.generate` on
Llama-3-8B's shape with dummy weights (bench_e2e.make_model_dir), one backend per process,
the engine in this process. Writes the GPU kernels and the CPU ops of one profiled call,
by total time, so that two backends can be compared op by op:

    python eval/profile_prefill.py --backend FLASH_ATTN --out eval/results/profile_prefill_fa.txt
    python eval/profile_prefill.py --backend CUSTOM --m 64 --out eval/results/profile_prefill_custom.txt

With --decode-tokens N the profiled call is `generate(max_tokens=1 + N)` of prompts the
warm-up call already prefilled (prefix caching: only their last partial block runs
again), so its kernels are N decode steps at --prompt-tokens context and batch --batch.

With --mix N the call is N fresh prompts at most --batch running at once, each with an
output length drawn from 64-192 tokens: as under a serving load of about --batch clients,
most steps decode and every few steps one request's prefill joins them. The mix is timed
once unprofiled (seconds_unprofiled, output_tok_per_s) before the profiled call; with
--time-only that timing is all (the profiler's tables of a mix take minutes to build). The
tables' "Self CUDA time total" against seconds_profiled is how busy the GPU was.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

from bench_e2e import engine_backend, make_model_dir  # eval/: the script's folder
from provenance import provenance

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the profiler sees the engine


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", required=True, choices=["CUSTOM", "FLASH_ATTN"])
    p.add_argument("--m", type=int, default=64, help="CUSTOM: subspaces (64: 4 bits, 32: 2 bits)")
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--decode-tokens", type=int, default=0,
                   help="profile this many decode steps of the warm-up's prompts instead")
    p.add_argument("--mix", type=int, default=0,
                   help="profile this many prompts, --batch at a time, outputs of 64-192 tokens")
    p.add_argument("--time-only", action="store_true", help="--mix: time it, no profile")
    p.add_argument("--rows", type=int, default=40, help="rows of each table")
    p.add_argument("--out", required=True)
    args = p.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    rng = random.Random(0)

    def prompts(n=args.batch):
        return [TokensPrompt(prompt_token_ids=[rng.randrange(1000, 120000)
                                               for _ in range(args.prompt_tokens)])
                for _ in range(n)]

    def mix_params(n):  # the same output lengths for every backend
        lengths = random.Random(1).choices(range(64, 193), k=n)
        return [SamplingParams(max_tokens=t, temperature=0.0, ignore_eos=True,
                               detokenize=False) for t in lengths]

    backend_kw, name = engine_backend(args.backend, args.m)
    max_tokens = 192 if args.mix else args.decode_tokens
    llm = LLM(model=make_model_dir(args.m), load_format="dummy", skip_tokenizer_init=True,
              dtype="bfloat16", max_model_len=args.prompt_tokens + max_tokens + 16,
              max_num_seqs=args.batch if args.mix else max(256, args.batch),
              enable_prefix_caching=True, seed=0, gpu_memory_utilization=0.9, **backend_kw)
    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False)
    warm = prompts()
    llm.generate(warm, sp, use_tqdm=False)  # warm-up: compiles, graphs, autotuning
    torch.cuda.synchronize()
    extra = {}
    if args.mix:
        # warm-up of the mix's step shapes (prefills joining decodes: Triton specializations)
        llm.generate(prompts(2 * args.batch), mix_params(2 * args.batch), use_tqdm=False)
        t0 = time.perf_counter()
        out = llm.generate(prompts(args.mix), mix_params(args.mix), use_tqdm=False)
        torch.cuda.synchronize()
        unprofiled = time.perf_counter() - t0
        tokens = sum(len(o.outputs[0].token_ids) for o in out)
        extra = dict(mix=args.mix, output_tokens=tokens, seconds_unprofiled=round(unprofiled, 4),
                     output_tok_per_s=round(tokens / unprofiled, 1))
        todo, sp = prompts(args.mix), mix_params(args.mix)
        if args.time_only:
            head = dict(provenance(), backend=name, prompt_tokens=args.prompt_tokens,
                        batch=args.batch, **extra)
            with open(args.out, "w") as f:
                f.write(json.dumps(head) + "\n")
            print(f"{name}: {unprofiled:.3f} s, {tokens / unprofiled:.1f} output tok/s; wrote {args.out}")
            return 0
    elif args.decode_tokens:
        todo = warm
        sp = SamplingParams(max_tokens=1 + args.decode_tokens, temperature=0.0,
                            ignore_eos=True, detokenize=False)
    else:
        todo = prompts()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        llm.generate(todo, sp, use_tqdm=False)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
    events = prof.key_averages()
    head = dict(provenance(), backend=name, prompt_tokens=args.prompt_tokens, batch=args.batch,
                decode_tokens=args.decode_tokens, **extra, seconds_profiled=round(seconds, 4))
    with open(args.out, "w") as f:
        f.write(json.dumps(head) + "\n\n")
        f.write("GPU kernels by self device time\n")
        f.write(events.table(sort_by="self_device_time_total", row_limit=args.rows) + "\n")
        f.write("CPU ops by self CPU time\n")
        f.write(events.table(sort_by="self_cpu_time_total", row_limit=args.rows) + "\n")
    print(f"{name}: {seconds:.3f} s profiled; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
