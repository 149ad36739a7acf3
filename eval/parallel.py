"""Tensor, pipeline and data parallelism against one GPU on a real model: perplexity on
text domains and greedy outputs, CUSTOM beside FLASH_ATTN, each layout against the same
backend on one GPU. Writes eval/results/parallel.json (a section per model).

    python eval/parallel.py --model eval/data/gemma3 --model-name Gemma-3-270M \\
        --codebooks eval/data/gemma3/pq/g4.safetensors --layouts tp2 pp2 dp2 \\
        --eval kernel=eval/data/text/kernel.jsonl fortunes=eval/data/text/fortunes.jsonl \\
               python=eval/data/text/heldout.jsonl

Every engine runs in its own process(es), in vLLM's batch-invariant eager mode
(VLLM_BATCH_INVARIANT=1, enforce_eager), so that one GPU gives the same bits whatever the
batch. TP=k splits the row-parallel matmuls into k partial sums added across GPUs, so no
backend gives one GPU's bits there: CUSTOM's difference is read next to FLASH_ATTN's, and
a rank attending with another KV head's codebooks would be far off both. PP=k gives each
GPU its own layers (and their codebooks) and changes no arithmetic. DP=k runs k engines,
each scoring every k-th document and prompt on a GPU of its own, with its worker in a
process of its own (the "mp" executor): what vLLM makes of each data-parallel rank of a
dense model (independent engines of DP=1; its offline data-parallel launch refuses dense
models), so their merged results must equal one GPU's.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time

from common import codebook_meta, load_docs, prompt_perplexity, provenance, save_section

BACKENDS = ("FLASH_ATTN", "CUSTOM")
LAYOUT_FORMS = "one, tpK, ppK or dpK with K >= 1 (e.g. tp2)"


def layout_sizes(layout: str) -> tuple[int, int, int]:
    """(tp, pp, dp) of ``one``, ``tpK``, ``ppK`` or ``dpK``."""
    if layout == "one":
        return 1, 1, 1
    m = re.fullmatch(r"(tp|pp|dp)([1-9][0-9]*)", layout)
    if m is None:
        raise ValueError(f"layout {layout!r}: expected {LAYOUT_FORMS}")
    k = int(m[2])
    return {"tp": (k, 1, 1), "pp": (1, k, 1), "dp": (1, 1, k)}[m[1]]


def layout(text: str) -> str:
    """argparse type of a layout: checked when the options are read."""
    try:
        layout_sizes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def parser() -> argparse.ArgumentParser:
    """The options of the whole run and of each engine's process (the same parser reads
    both, so an engine gets every setting the run was given)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--model-name", required=True, help="the model's section in --out")
    p.add_argument("--codebooks", help="CUSTOM's codebook file")
    p.add_argument("--layouts", nargs="+", type=layout, default=["tp2", "pp2", "dp2"],
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
    # one engine's process (or one DP rank's): set by child_argv
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--backend", choices=BACKENDS, help=argparse.SUPPRESS)
    p.add_argument("--layout", type=layout, help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--json", help=argparse.SUPPRESS)
    return p


def child_argv(args, backend: str, layout: str, json_path: str, rank: int = 0) -> list[str]:
    """The options of the process that runs ``backend`` in ``layout`` (DP rank ``rank``)
    and writes its results to ``json_path``: every setting of ``args``, and its own."""
    argv = ["--model", args.model, "--model-name", args.model_name,
            "--layouts", *args.layouts, "--backends", *args.backends, "--eval", *args.eval,
            "--max-len", str(args.max_len), "--docs", str(args.docs),
            "--prompts", str(args.prompts), "--prompt-len", str(args.prompt_len),
            "--gen-tokens", str(args.gen_tokens),
            "--gpu-memory-utilization", str(args.gpu_memory_utilization),
            "--work", args.work, "--out", args.out,
            "--one", "--backend", backend, "--layout", layout, "--rank", str(rank),
            "--json", json_path]
    if args.codebooks:
        argv += ["--codebooks", args.codebooks]
    return argv


def visible_gpus() -> int:
    import torch  # torch counts what CUDA_VISIBLE_DEVICES leaves visible

    return torch.cuda.device_count()


def one(args) -> None:
    """Child process: one engine (or one DP rank's), its documents' NLL and greedy outputs."""
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    import vllm_pq_backend  # noqa: F401

    tp, pp, dp = layout_sizes(args.layout)
    tok = AutoTokenizer.from_pretrained(args.model)
    domains, prompts = inputs(args, tok)
    kw = dict(additional_config={"pq": {"codebooks": args.codebooks}}) if args.backend == "CUSTOM" else {}
    if dp > 1:
        kw["distributed_executor_backend"] = "mp"
    llm = LLM(model=args.model, attention_backend=args.backend, tensor_parallel_size=tp,
              pipeline_parallel_size=pp, enforce_eager=True, max_model_len=args.max_len + 128,
              seed=0, gpu_memory_utilization=args.gpu_memory_utilization, max_num_seqs=32, **kw)
    mine = lambda xs: xs[args.rank::dp]  # noqa: E731  (DP: every dp-th document from this rank's)
    res = dict(ppl={}, greedy={})
    for name, docs in domains.items():
        ppl, count = prompt_perplexity(llm, mine(docs))
        res["ppl"][name] = [math.log(ppl) * count, count]
    idx = mine(list(range(len(prompts))))
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


def merge(parts: list[dict]) -> dict:
    """DP ranks' results as one run's: NLL and scored tokens summed per domain, greedy
    outputs united (each prompt is one rank's)."""
    merged = dict(ppl={}, greedy={})
    for part in parts:
        for name, (nll, count) in part["ppl"].items():
            a, b = merged["ppl"].get(name, (0.0, 0))
            merged["ppl"][name] = (a + nll, b + count)
        twice = merged["greedy"].keys() & part["greedy"].keys()
        if twice:
            raise ValueError(f"prompts {sorted(twice)} were generated by two DP ranks")
        merged["greedy"].update(part["greedy"])
    return merged


def run(args, backend: str, layout: str, path: str) -> dict:
    """The layout's engine(s) in child processes; their results merged (DP ranks' shares).
    DP rank r sees only the r-th visible GPU."""
    tp, pp, dp = layout_sizes(layout)
    print(f"start {backend} {layout} (tp {tp}, pp {pp}, dp {dp})", flush=True)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = visible.split(",") if visible else [str(i) for i in range(dp)]
    procs = []
    for r in range(dp):
        env = dict(os.environ, VLLM_BATCH_INVARIANT="1")
        if dp > 1:
            env["CUDA_VISIBLE_DEVICES"] = gpus[r]
        cmd = [sys.executable, os.path.abspath(__file__),
               *child_argv(args, backend, layout, f"{path}.{r}", r)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    logs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        return dict(error="\n".join(f"[rank {r}, exit {p.returncode}]\n" + log[-3000:]
                                    for r, (p, log) in enumerate(zip(procs, logs))))
    parts = []
    for r in range(dp):
        with open(f"{path}.{r}") as f:
            parts.append(json.load(f))
    return merge(parts)


def agreement(a: dict, b: dict) -> dict:
    keys = sorted(a, key=int)
    same = sum(a[k] == b[k] for k in keys)
    tokens = sum(sum(p == q for p, q in zip(a[k], b[k])) for k in keys)
    first = [next((i for i, (p, q) in enumerate(zip(a[k], b[k])) if p != q), len(a[k])) for k in keys]
    return dict(identical_sequences=f"{same}/{len(keys)}",
                identical_tokens=round(tokens / sum(len(a[k]) for k in keys), 4),
                mean_tokens_before_first_difference=round(sum(first) / len(first), 1))


def compare(ref: dict, res: dict) -> dict:
    """A layout's results against one GPU's: greedy agreement, and per domain both
    perplexities and the layout's difference in percent."""
    row = agreement(ref["greedy"], res["greedy"])
    for name, (nll, count) in res["ppl"].items():
        nll1, count1 = ref["ppl"][name]
        if count != count1:
            raise ValueError(f"{name}: {count} tokens scored, {count1} on one GPU")
        row[f"ppl_{name}"] = round(math.exp(nll / count), 4)
        row[f"ppl_one_{name}"] = round(math.exp(nll1 / count1), 4)
        row[f"delta_pct_{name}"] = round(100 * (math.exp((nll - nll1) / count) - 1), 4)
    return row


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.one:
        one(args)
        return 0
    if "CUSTOM" in args.backends and not args.codebooks:
        p.error("CUSTOM needs --codebooks")
    need = max(math.prod(layout_sizes(x)) for x in args.layouts)
    have = visible_gpus()
    if need > have:
        p.error(f"--layouts {' '.join(args.layouts)} need {need} GPUs, {have} visible "
                "(CUDA_VISIBLE_DEVICES): drop the larger layouts or run on more GPUs")
    os.makedirs(args.work, exist_ok=True)
    section = dict(provenance(), model=args.model, layouts=args.layouts, docs_per_domain=args.docs,
                   max_len=args.max_len, mode="batch-invariant eager",
                   greedy=f"{args.prompts} prompts x {args.gen_tokens} tokens", rows=[])
    if args.codebooks:
        section["codebooks"] = codebook_meta(args.codebooks)
    for backend in args.backends:
        ref = None
        for layout in ["one", *args.layouts]:
            t0 = time.time()
            res = run(args, backend, layout, os.path.join(args.work, f"{args.model_name}_{backend}_{layout}"))
            if "error" in res:
                print(f"{backend} {layout}: FAILED\n{res['error']}", flush=True)
                section["rows"].append(dict(backend=backend, layout=layout, error=res["error"]))
                if ref is None:
                    print(f"{backend}: no one-GPU reference, its layouts are skipped", flush=True)
                    break
                continue
            if ref is None:
                ref = res
                continue
            row = dict(backend=backend, layout=layout, against="one GPU",
                       seconds=round(time.time() - t0, 1), **compare(ref, res))
            section["rows"].append(row)
            print(json.dumps(row), flush=True)
    save_section(args.out, args.model_name, section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
