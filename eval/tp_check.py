"""Tensor and pipeline parallelism against one GPU: greedy outputs of CUSTOM with TP=2 (and
PP=2) vs one GPU, next to FLASH_ATTN's, on a Llama-shaped model with random weights (8 KV
heads, head_dim 128) and codebooks calibrated for it.

    python eval/tp_check.py --work /tmp/tp --tokenizer-from eval/data/smollm2 \
        --text eval/data/text/calib.jsonl --out eval/results/tp2.json

Each engine runs in its own process. Two modes: vLLM's batch-invariant eager mode
(VLLM_BATCH_INVARIANT=1, --enforce-eager) and the default (CUDA graphs). TP=2 splits the
model's row-parallel matmuls into two partial sums that are added across GPUs, so no
backend need give TP=1's bits; the comparison that tells whether each rank attends with
its own KV heads' codebooks is CUSTOM's agreement next to FLASH_ATTN's (a rank with
another head's codebooks would decode nonsense). PP=2 gives each GPU two of the four
layers (each loads its own layers' codebooks) and changes no arithmetic.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from common import provenance

PROMPTS = [f"{w} " * 3 + "and then" for w in (
    "river", "kernel", "garden", "tensor", "winter", "violin", "harbor", "pepper",
    "canyon", "mirror", "planet", "ladder", "saddle", "copper", "meadow", "lantern")]


def make_model(out: str, tokenizer_from: str) -> None:
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=2048, intermediate_size=4096, num_hidden_layers=4,
                      num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                      vocab_size=49152, max_position_embeddings=4096, rope_theta=500000.0,
                      bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16")
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg)
    model.save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tokenizer_from, f), out)


def one(args) -> None:
    """Child process: one engine, greedy outputs to --json."""
    from vllm import LLM, SamplingParams

    kw = dict(additional_config={"pq": {"codebooks": args.books}}) if args.backend == "CUSTOM" else {}
    llm = LLM(model=args.model, attention_backend=args.backend, tensor_parallel_size=args.tp,
              pipeline_parallel_size=args.pp,
              enforce_eager=args.mode == "batch_invariant", max_model_len=1024, seed=0,
              gpu_memory_utilization=0.3, max_num_seqs=16, **kw)
    out = llm.generate(PROMPTS, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True),
                       use_tqdm=False)
    with open(args.json, "w") as f:
        json.dump([list(o.outputs[0].token_ids) for o in out], f)


def agreement(a, b) -> dict:
    same = sum(x == y for x, y in zip(a, b))
    tokens = sum(sum(p == q for p, q in zip(x, y)) for x, y in zip(a, b))
    first = [next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), len(x)) for x, y in zip(a, b)]
    return dict(identical_sequences=f"{same}/{len(a)}",
                identical_tokens=round(tokens / sum(len(x) for x in a), 4),
                mean_tokens_before_first_difference=round(sum(first) / len(first), 1))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", required=True)
    p.add_argument("--tokenizer-from")
    p.add_argument("--text")
    p.add_argument("--out", default="eval/results/tp2.json")
    p.add_argument("--modes", nargs="*", default=["batch_invariant", "default"],
                   help="none: only make the model and its codebooks")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    for k in ("model", "books", "backend", "mode", "json"):
        p.add_argument(f"--{k}", help=argparse.SUPPRESS)
    p.add_argument("--layouts", nargs="*", default=["tp2", "pp2"],
                   help="parallel layouts compared with one GPU: tp2, pp2")
    p.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--pp", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        one(args)
        return 0
    model = os.path.join(args.work, "model")
    books = os.path.join(args.work, "codebooks_b4.safetensors")
    if not os.path.exists(os.path.join(model, "config.json")):
        make_model(model, args.tokenizer_from)
    if not os.path.exists(books):
        subprocess.run([sys.executable, "-m", "vllm_pq_backend.calibrate", "--model", model,
                        "--text", args.text, "--tokens", "32768", "--out", books], check=True)
    outputs, rows = {}, []
    if not args.modes:
        return 0
    for mode in args.modes:
        for backend in ("CUSTOM", "FLASH_ATTN"):
            for layout in ["one", *args.layouts]:
                tp, pp = {"one": (1, 1), "tp2": (2, 1), "pp2": (1, 2)}[layout]
                path = os.path.join(args.work, f"{mode}_{backend}_{layout}.json")
                env = dict(os.environ, VLLM_BATCH_INVARIANT="1" if mode == "batch_invariant" else "0")
                cmd = [sys.executable, __file__, "--one", "--work", args.work, "--model", model,
                       "--books", books, "--backend", backend, "--mode", mode, "--tp", str(tp),
                       "--pp", str(pp), "--json", path]
                res = subprocess.run(cmd, env=env, capture_output=True, text=True)
                if res.returncode:
                    rows.append(dict(mode=mode, backend=backend, layout=layout, error=res.stderr[-3000:]))
                    print(f"{mode} {backend} {layout}: FAILED\n{res.stderr[-3000:]}", flush=True)
                    continue
                with open(path) as f:
                    outputs[mode, backend, layout] = json.load(f)
                if layout != "one" and (mode, backend, "one") in outputs:
                    row = dict(mode=mode, backend=backend, layout=layout, against="one GPU",
                               **agreement(outputs[mode, backend, "one"], outputs[mode, backend, layout]))
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    with open(args.out, "w") as f:
        json.dump(dict(provenance(), model="Llama shape, random weights: 4 layers, 16 query / 8 KV "
                       "heads, head_dim 128", codebooks=books, bits=4, prompts=len(PROMPTS),
                       max_tokens=64, rows=rows), f, indent=1)
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
