"""Prefill fidelity end to end: each generated token's log-probability as decoding computed
it, step by step, against the one a single prefill of prompt + generation computes for
the same position (what lm-eval's loglikelihood requests measure). SmolLM2, greedy,
eager engines, prefix caching off so that the prefill recomputes every position; CUSTOM
with window 0 and with --window.

Equal semantics (layout.window_start) make the two agree up to numerics; under
--batch-invariant (VLLM_BATCH_INVARIANT=1) they should agree bit for bit.

    python eval/prefill_fidelity.py --model eval/data/smollm2 \
        --heldout eval/data/text/heldout.jsonl [--batch-invariant] --out OUT.json
"""

from __future__ import annotations

import json
import os
import sys

from provenance import provenance  # eval/ is the script's directory
from vllm_features import engine_arguments, engine_kwargs, in_own_process

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def run(backend, window, args, prompts):
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


def main() -> int:
    p = engine_arguments(__doc__)
    p.add_argument("--prompts", type=int, default=12)
    p.add_argument("--gen-tokens", type=int, default=64)
    p.add_argument("--batch-invariant", action="store_true")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    if args.batch_invariant:
        os.environ["VLLM_BATCH_INVARIANT"] = "1"

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    docs = [json.loads(line)["text"] for line in open(args.heldout)][: args.prompts]
    # 126 + 43 i tokens: generations cross window and block edges (128, 256, 384, 512).
    prompts = [([tok.bos_token_id] + tok(d, add_special_tokens=False)["input_ids"])
               [: 126 + 43 * i] for i, d in enumerate(docs)]
    result = dict(provenance(), batch_invariant=args.batch_invariant, m=args.m,
                  gen_tokens=args.gen_tokens, prompt_lens=[len(x) for x in prompts], rows=[])
    for backend in args.backends:
        for window in sorted({0, args.window}) if backend == "CUSTOM" else [None]:
            pairs = in_own_process(run, backend, window, args, prompts)
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


if __name__ == "__main__":
    sys.exit(main())
