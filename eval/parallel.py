"""Tensor, pipeline and data parallelism against one GPU on a real model: perplexity on
text domains and greedy outputs, CUSTOM beside FLASH_ATTN, each layout against the same
backend on one GPU. Writes eval/results/parallel.json (a section per model).

    python eval/parallel.py --model eval/data/gemma3 --model-name Gemma-3-270M \\
        --codebooks eval/data/gemma3/pq/codebooks_m128.safetensors --layouts tp2 pp2 dp2 \\
        --eval kernel=eval/data/text/kernel.jsonl fortunes=eval/data/text/fortunes.jsonl \\
               python=eval/data/text/heldout.jsonl

Every engine runs in its own process(es), in vLLM's batch-invariant eager mode
(VLLM_BATCH_INVARIANT=1, enforce_eager), so that one GPU gives the same bits whatever the
batch. TP=k splits the row-parallel matmuls into k partial sums added across GPUs, so no
backend gives one GPU's bits there: CUSTOM's difference is read next to FLASH_ATTN's, and
a rank attending with another KV head's codebooks would be far off both. PP=k gives each
GPU its own layers (and their codebooks) and changes no arithmetic. DP=k runs k engines,
each scoring every k-th document and prompt (vLLM's offline data-parallel launch: one
process per rank, VLLM_DP_* in its environment; rank r takes the r-th GPU of the visible
ones).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import subprocess
import sys
import time

from common import codebook_meta, load_docs, prompt_perplexity, provenance

BACKENDS = ("FLASH_ATTN", "CUSTOM")


def layout_sizes(layout: str) -> tuple[int, int, int]:
    """(tp, pp, dp) of ``one``, ``tpK``, ``ppK`` or ``dpK``."""
    if layout == "one":
        return 1, 1, 1
    kind, k = layout[:2], int(layout[2:])
    return (k, 1, 1) if kind == "tp" else (1, k, 1) if kind == "pp" else (1, 1, k)


def one(args) -> None:
    """Child process: one engine (or one DP rank's), its documents' NLL and greedy outputs."""
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    import vllm_pq_backend  # noqa: F401

    tp, pp, dp = layout_sizes(args.layout)
    rank = int(os.environ.get("VLLM_DP_RANK", 0))
    tok = AutoTokenizer.from_pretrained(args.model)
    domains, prompts = inputs(args, tok)
    kw = dict(additional_config={"pq": {"codebooks": args.codebooks}}) if args.backend == "CUSTOM" else {}
    llm = LLM(model=args.model, attention_backend=args.backend, tensor_parallel_size=tp,
              pipeline_parallel_size=pp, enforce_eager=True, max_model_len=args.max_len + 128,
              seed=0, gpu_memory_utilization=args.gpu_memory_utilization, max_num_seqs=32, **kw)
    mine = lambda xs: xs[rank::dp]  # noqa: E731  (DP: every dp-th document from this rank's)
    res = dict(ppl={}, greedy={})
    for name, docs in domains.items():
        ppl, count = prompt_perplexity(llm, mine(docs))
        res["ppl"][name] = [math.log(ppl) * count, count]
    idx = list(range(len(prompts)))[rank::dp]
    outs = llm.generate([TokensPrompt(prompt_token_ids=prompts[i]) for i in idx],
                        SamplingParams(max_tokens=args.gen_tokens, temperature=0, ignore_eos=True),
                        use_tqdm=False)
    res["greedy"] = {i: list(o.outputs[0].token_ids) for i, o in zip(idx, outs)}
    with open(args.json, "w") as f:
        json.dump(res, f)


def inputs(args, tok):
    paths = dict(spec.split("=", 1) for spec in args.eval)
    domains = {n: load_docs(f, tok, args.max_len, args.docs) for n, f in paths.items()}
    first = next(iter(domains.values()))
    return domains, [d[: args.prompt_len] for d in first[: args.prompts]]


def run(args, backend: str, layout: str, path: str) -> dict:
    """The layout's engine(s) in child processes; their results merged (DP ranks' halves)."""
    dp = layout_sizes(layout)[2]
    base = [sys.executable, os.path.abspath(__file__), "--one", "--backend", backend,
            "--layout", layout, "--model", args.model, "--codebooks", args.codebooks or "",
            "--max-len", str(args.max_len), "--docs", str(args.docs), "--prompts", str(args.prompts),
            "--prompt-len", str(args.prompt_len), "--gen-tokens", str(args.gen_tokens),
            "--gpu-memory-utilization", str(args.gpu_memory_utilization), "--eval", *args.eval]
    env = dict(os.environ, VLLM_BATCH_INVARIANT="1")
    procs = []
    with socket.socket() as s:  # a free port for the DP ranks to meet on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for r in range(dp):
        e = dict(env)
        if dp > 1:
            e.update(VLLM_DP_RANK=str(r), VLLM_DP_RANK_LOCAL=str(r), VLLM_DP_SIZE=str(dp),
                     VLLM_DP_MASTER_IP="127.0.0.1", VLLM_DP_MASTER_PORT=str(port))
        procs.append(subprocess.Popen(base + ["--json", f"{path}.{r}"], env=e, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    logs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        return dict(error="\n".join(log[-3000:] for log in logs))
    merged = dict(ppl={}, greedy={})
    for r in range(dp):
        part = json.load(open(f"{path}.{r}"))
        for name, (nll, count) in part["ppl"].items():
            a, b = merged["ppl"].get(name, (0.0, 0))
            merged["ppl"][name] = (a + nll, b + count)
        merged["greedy"].update(part["greedy"])
    return merged


def agreement(a: dict, b: dict) -> dict:
    keys = sorted(a, key=int)
    same = sum(a[k] == b[k] for k in keys)
    tokens = sum(sum(p == q for p, q in zip(a[k], b[k])) for k in keys)
    first = [next((i for i, (p, q) in enumerate(zip(a[k], b[k])) if p != q), len(a[k])) for k in keys]
    return dict(identical_sequences=f"{same}/{len(keys)}",
                identical_tokens=round(tokens / sum(len(a[k]) for k in keys), 4),
                mean_tokens_before_first_difference=round(sum(first) / len(first), 1))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--model-name", required=True, help="the model's section in --out")
    p.add_argument("--codebooks", help="CUSTOM's codebook file")
    p.add_argument("--layouts", nargs="+", default=["tp2", "pp2", "dp2"],
                   help="tpK, ppK, dpK: each compared with one GPU")
    p.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    p.add_argument("--eval", required=True, nargs="+", help="NAME=FILE.jsonl text domains")
    p.add_argument("--max-len", type=int, default=2048, help="tokens per scored document")
    p.add_argument("--docs", type=int, default=32, help="documents per domain")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--gen-tokens", type=int, default=64)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.4)
    p.add_argument("--work", default="/tmp/parallel", help="the engines' raw results")
    p.add_argument("--out", default="eval/results/parallel.json")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--backend", help=argparse.SUPPRESS)
    p.add_argument("--layout", help=argparse.SUPPRESS)
    p.add_argument("--json", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        one(args)
        return 0
    if "CUSTOM" in args.backends and not args.codebooks:
        p.error("CUSTOM needs --codebooks")
    os.makedirs(args.work, exist_ok=True)
    section = dict(provenance(), model=args.model, layouts=args.layouts, docs_per_domain=args.docs,
                   max_len=args.max_len, mode="batch-invariant eager",
                   greedy=f"{args.prompts} prompts x {args.gen_tokens} tokens", rows=[])
    if args.codebooks:
        section["codebooks"] = {k: v for k, v in codebook_meta(args.codebooks).items()}
    for backend in args.backends:
        results = {}
        for layout in ["one", *args.layouts]:
            t0 = time.time()
            res = run(args, backend, layout, os.path.join(args.work, f"{args.model_name}_{backend}_{layout}"))
            if "error" in res:
                print(f"{backend} {layout}: FAILED\n{res['error']}", flush=True)
                section["rows"].append(dict(backend=backend, layout=layout, error=res["error"]))
                continue
            results[layout] = res
            if layout == "one":
                continue
            ref = results.get("one")
            if ref is None:
                continue
            row = dict(backend=backend, layout=layout, against="one GPU",
                       seconds=round(time.time() - t0, 1), **agreement(ref["greedy"], res["greedy"]))
            for name, (nll, count) in res["ppl"].items():
                nll1, count1 = ref["ppl"][name]
                assert count == count1, (name, count, count1)
                row[f"ppl_{name}"] = round(math.exp(nll / count), 4)
                row[f"ppl_one_{name}"] = round(math.exp(nll1 / count1), 4)
                row[f"delta_pct_{name}"] = round(100 * (math.exp((nll - nll1) / count) - 1), 4)
            section["rows"].append(row)
            print(json.dumps(row), flush=True)
    data = json.load(open(args.out)) if os.path.exists(args.out) else {}
    data.setdefault("models", {})[args.model_name] = section
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(data, f, indent=1)
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
