"""The long-context retrieval tasks (eval/lm_eval/pq_long_*.yaml) through lm-eval's own
command line, `lm_eval --model vllm`, for each KV cache side by side in one run: the third
entry point on the work eval/long_context.py measures with prompts of token ids. Results
(accuracy per task and prompt length, with provenance and the codebooks' bits and hash) go
to ``--out``; lm-eval's own files to ``--lm-eval-out``.

    python eval/long_context.py --model eval/data/smollm2 --prompts-only \\
        --lengths 2048 4096 8192 --lm-eval-data eval/data/long_context
    python eval/lm_eval/pq_long.py --model eval/data/smollm2 --model-name SmolLM2-135M \\
        --codebooks eval/data/smollm2/pq/codebooks_m32.safetensors
"""

import argparse
import glob
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from common import codebook_meta, engine_label, provenance, write_result  # noqa: E402
from pq_long_utils import LENGTHS, TASKS  # noqa: E402

from vllm_pq_backend.config import DEFAULT_WINDOW  # noqa: E402


def model_args(model: str, backend: str, codebooks: str | None, max_model_len: int,
               **engine) -> dict:
    """``engine``: more LLM(...) arguments, those left None dropped."""
    args = dict(pretrained=model, attention_backend=backend, max_model_len=max_model_len,
                add_bos_token=True, **{k: v for k, v in engine.items() if v is not None})
    if codebooks:
        args["additional_config"] = {"pq": {"codebooks": codebooks}}
    return args


def scores(results: dict) -> dict:
    """{task: {length: accuracy}} from lm-eval's results file; lengths without prompts
    (their metric is -1) are left out."""
    out = {}
    for task in TASKS:
        row = results["results"][f"pq_long_{task}"]
        out[task] = {str(n): row[f"{n},none"] for n in LENGTHS
                     if row.get(f"{n},none", -1) >= 0}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--model-name", required=True, help="as eval/long_context.py names it")
    p.add_argument("--codebooks", nargs="+", default=[], help="one CUSTOM run per file")
    p.add_argument("--baselines", nargs="*", default=["FLASH_ATTN"])
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None, help="the KV cache's size "
                   "instead of what memory profiling leaves (so other processes may share the GPU)")
    p.add_argument("--limit", type=int, default=None, help="documents per task")
    p.add_argument("--timeout", type=int, default=900, help="seconds per lm-eval run")
    p.add_argument("--out", default="eval/results/lm_eval_long.json")
    p.add_argument("--lm-eval-out", default=None, help="default: OUT without .json")
    args = p.parse_args()
    raw = args.lm_eval_out or os.path.splitext(args.out)[0]
    runs = [(f"{b} bf16", b, None) for b in args.baselines] + [
        (engine_label(codebook_meta(c), DEFAULT_WINDOW), "CUSTOM", c) for c in args.codebooks]
    rows = []
    for name, backend, books in runs:
        out = os.path.join(raw, backend if books is None else os.path.basename(books))
        cmd = ["lm_eval", "--model", "vllm", "--model_args",
               json.dumps(model_args(args.model, backend, books, args.max_model_len,
                                          gpu_memory_utilization=args.gpu_memory_utilization,
                                          kv_cache_memory_bytes=args.kv_cache_memory_bytes)),
               "--tasks", "pq_long", "--include_path", str(HERE), "--batch_size", "auto",
               "--output_path", out] + (["--limit", str(args.limit)] if args.limit else [])
        print(f"== {name}: {' '.join(cmd)}", flush=True)
        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", HF_DATASETS_OFFLINE="1")
        t0 = time.time()
        subprocess.run(cmd, env=env, check=True, timeout=args.timeout)
        files = sorted(glob.glob(os.path.join(out, "**", "results_*.json"), recursive=True),
                       key=os.path.getmtime)
        row = dict(name=name, backend=backend, seconds=round(time.time() - t0, 1),
                   accuracy=scores(json.load(open(files[-1]))),
                   command=" ".join(cmd))
        if books:
            row.update(codebook_meta(books))
        rows.append(row)
        print(json.dumps(row["accuracy"]), flush=True)
    write_result(args.out, dict(provenance(), model=args.model_name,
                                rows=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
