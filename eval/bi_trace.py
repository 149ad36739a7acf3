"""Where a scheduling change first changes the numbers, layer by layer, under vLLM's
batch-invariant mode (VLLM_BATCH_INVARIANT=1): one prompt, greedy, run twice: prefilled
in one step and in 64-token chunks (--against chunked), or compiled with CUDA graphs and
with enforce_eager (--against eager). The attention impl of the chosen backend is wrapped
so that every layer's q, k, v (what reaches attention) and its output are recorded for
the prompt's positions; the two runs are then compared bit for bit.

If a layer's q/k/v already differ, the difference was made upstream of attention (GEMMs,
norms, RoPE: vLLM's part); if they are equal and the attention output differs, the
backend is not chunk-invariant. The first differing layer and tensor are the answer.

    python eval/bi_trace.py --model eval/data/smollm2 --heldout eval/data/text/heldout.jsonl \
        --backends CUSTOM FLASH_ATTN [--eager | --against eager] --out OUT.json
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import torch

from provenance import provenance  # eval/ is the script's directory
from vllm_features import engine_arguments, engine_kwargs, in_own_process

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
os.environ["VLLM_BATCH_INVARIANT"] = "1"
TENSORS = ("q", "k", "v", "out")


def run(backend, chunk, eager, args, prompt, path):
    """One engine; writes {layer: {tensor: rows of the prompt's positions}} to ``path``."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.plugins import load_general_plugins
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    load_general_plugins()  # registers CUSTOM
    impl_cls = AttentionBackendEnum[backend].get_class().get_impl_cls()
    rec: dict[str, dict[str, list[torch.Tensor]]] = {}
    live = []  # empty until the engine is built: its warm-up and capture runs are not ours
    want = len(prompt) + args.gen_tokens
    inner = impl_cls.forward

    def forward(self, layer, query, key, value, kv_cache, md, output, *a, **kw):
        res = inner(self, layer, query, key, value, kv_cache, md, output, *a, **kw)
        if live and md is not None:
            n = md.num_actual_tokens
            r = rec.setdefault(layer.layer_name, {t: [] for t in TENSORS})
            if sum(x.shape[0] for x in r["q"]) < want:
                for t, x in zip(TENSORS, (query, key, value, output)):
                    r[t].append(x[:n].detach().to("cpu", copy=True))
        return res

    impl_cls.forward = forward
    kw = engine_kwargs(args, backend, args.window, enforce_eager=eager)
    if chunk:
        kw.update(max_num_batched_tokens=chunk, enable_chunked_prefill=True)
    llm = LLM(**kw)
    live.append(True)
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)],
                       SamplingParams(max_tokens=args.gen_tokens, temperature=0.0),
                       use_tqdm=False)
    torch.save({name: {t: torch.cat(xs) for t, xs in r.items()} for name, r in rec.items()},
               path)
    return list(out[0].outputs[0].token_ids)


def compare(a, b, rows):
    """Per layer and tensor: bitwise equal over the first ``rows`` rows, and the largest
    difference relative to the tensor's largest magnitude."""
    layers = []
    for name in a:  # recorded in execution order: layer 0 first
        row = {"layer": name}
        for t in TENSORS:
            x, y = a[name][t][:rows].float(), b[name][t][:rows].float()
            row[t] = "equal" if torch.equal(x, y) else \
                f"{((x - y).abs().max() / x.abs().max().clamp_min(1e-30)).item():.1e}"
        layers.append(row)
    first = next(((r["layer"], t) for r in layers for t in TENSORS if r[t] != "equal"), None)
    return layers, first


def main() -> int:
    p = engine_arguments(__doc__)
    p.add_argument("--prompt-tokens", type=int, default=700)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--gen-tokens", type=int, default=16)
    p.add_argument("--eager", action="store_true", help="enforce_eager in both runs")
    p.add_argument("--against", choices=["chunked", "eager"], default="chunked")
    p.add_argument("--out", required=True)
    args = p.parse_args()

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    text = json.loads(open(args.heldout).readline())["text"]
    prompt = [tok.bos_token_id] + tok(text, add_special_tokens=False)["input_ids"]
    prompt = prompt[:args.prompt_tokens]
    # (chunk, eager) of the two runs; a compiled run replays decodes from CUDA graphs,
    # where nothing is recorded, so then only the prompt's rows are compared.
    if args.against == "chunked":
        runs = [(0, args.eager), (args.chunk, args.eager)]
    else:
        runs = [(0, False), (0, True)]
    rows = len(prompt) + (args.gen_tokens - 1 if all(e for _, e in runs) else 0)
    result = dict(provenance(), runs_compared=runs, m=args.m, window=args.window,
                  prompt_tokens=len(prompt), compared_rows=rows, runs=[])
    with tempfile.TemporaryDirectory() as tmp:
        for backend in args.backends:
            paths = [os.path.join(tmp, f"{backend}_{i}.pt") for i in range(2)]
            tokens = [in_own_process(run, backend, c, e, args, prompt, f)
                      for (c, e), f in zip(runs, paths)]
            layers, first = compare(*(torch.load(f) for f in paths), rows)
            r = dict(backend=backend, same_tokens=tokens[0] == tokens[1],
                     first_difference=first, layers=layers)
            result["runs"].append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "layers"}), flush=True)
            for row in layers:
                print("  ", json.dumps(row), flush=True)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
