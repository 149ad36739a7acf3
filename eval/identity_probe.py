"""Greedy outputs alone vs under load, in one offline engine: the soak's reference prompts
(eval/soak.py) each generated alone, then again while a stream of random requests of mixed
lengths (sampled, some aborted mid-way) keeps about --inflight requests running, one
engine step at a time. Prints one JSON line: how many reference outputs equal their alone
output token for token (and their sampled tokens' logprobs bit for bit), and where the
first ones part.

    python eval/identity_probe.py --model eval/data/smollm2 --backend CUSTOM \
        --additional-config '{"pq": {"codebooks": "..."}}' [--llm-args '{"enforce_eager": true}']

The serving soak measures the same share through `vllm serve`; this runs in seconds and
each variant (backend, eager, window, ...) in its own process."""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

from provenance import codebook_meta, provenance  # eval/ is the script's directory
from soak import REFERENCE, first_difference, random_prompt

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--backend", default="CUSTOM")
    p.add_argument("--additional-config", default=None, help="JSON, as vllm serve takes it")
    p.add_argument("--llm-args", default="{}", help='JSON of more LLM(...) arguments, e.g. {"enforce_eager": true}')
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-cache-gib", type=float, default=4)
    p.add_argument("--inflight", type=int, default=64)
    p.add_argument("--references", type=int, default=96, help="reference requests under load")
    p.add_argument("--ref-tokens", type=int, default=48)
    p.add_argument("--label", default="")
    args = p.parse_args()

    from vllm import LLM, SamplingParams

    kw = json.loads(args.llm_args)
    if args.additional_config:
        kw["additional_config"] = json.loads(args.additional_config)
    llm = LLM(model=args.model, attention_backend=args.backend, max_model_len=args.max_model_len,
              gpu_memory_utilization=0.5, kv_cache_memory_bytes=int(args.kv_cache_gib * 2**30),
              seed=0, **kw)
    # logprobs: the sampled token's, to see where two runs' numbers part before a token does
    greedy = SamplingParams(temperature=0.0, max_tokens=args.ref_tokens, logprobs=0)

    def tokens_and_logprobs(completion):
        toks = list(completion.token_ids)
        return toks, [lp[t].logprob for t, lp in zip(toks, completion.logprobs)]

    alone = [tokens_and_logprobs(llm.generate([r], greedy, use_tqdm=False)[0].outputs[0])
             for r in REFERENCE]

    engine = llm.llm_engine
    rng = random.Random(0)
    live: dict[str, int | None] = {}  # request id -> reference index (None: random)
    results, next_id, refs_sent, steps = [], 0, 0, 0
    while refs_sent < args.references or live:
        while refs_sent < args.references and len(live) < args.inflight:
            rid = str(next_id)
            next_id += 1
            if rng.random() < 0.2:
                j = rng.randrange(len(REFERENCE))
                engine.add_request(rid, REFERENCE[j], greedy)
                live[rid] = j
                refs_sent += 1
            else:
                prompt = random_prompt(rng, args.max_model_len - 256)
                try:
                    engine.add_request(rid, prompt, SamplingParams(
                        temperature=rng.choice([0.0, 0.8]), max_tokens=rng.randint(1, 48),
                        seed=next_id))
                except ValueError:  # the words came to more tokens than fit
                    continue
                live[rid] = None
            if rng.random() < 0.5:
                break  # arrivals spread over steps
        for out in engine.step():
            if not out.finished:
                continue
            j = live.pop(out.request_id.split("-")[0], None)  # the engine may suffix ids
            if j is not None:
                got, lps = tokens_and_logprobs(out.outputs[0])
                want, want_lps = alone[j]
                at = first_difference(got, want)
                lp_at = next((i for i, (x, y) in enumerate(zip(lps, want_lps)) if x != y), None)
                results.append((j, at, lp_at, None if lp_at is None else abs(lps[lp_at] - want_lps[lp_at])))
        steps += 1
        if steps % 7 == 0:  # a client gives up on a random request
            victims = [r for r, j in live.items() if j is None]
            if victims:
                v = rng.choice(victims)
                engine.abort_request([v])
                live.pop(v)
    same = sum(r[1] is None for r in results)
    same_lp = sum(r[2] is None for r in results)
    books = kw.get("additional_config", {}).get("pq", {}).get("codebooks")
    print(json.dumps(dict(provenance(), codebooks=codebook_meta(books) if books else None,
                          label=args.label, backend=args.backend, llm_args=args.llm_args,
                          additional_config=args.additional_config, references=len(results),
                          identical=same, share=round(same / max(1, len(results)), 4),
                          logprobs_identical=same_lp, steps=steps,
                          first_differences=[dict(prompt=j, token=at, logprob=lp, by=by)
                                             for j, at, lp, by in results if lp is not None][:16])),
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
