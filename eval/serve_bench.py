"""Serving benchmark with vLLM's own tools: a model folder to serve, and one results file
from a `vllm bench sweep serve` experiment.

`vllm bench sweep serve` starts `vllm serve` once per entry of the serve parameters (each
backend, same model and flags), runs `vllm bench serve` at each request rate and writes
every result under `--output-dir`; `collect` gathers them, per server setting and rate
(output throughput, TTFT, TPOT, inter-token latency), with provenance.

Llama-3-8B's shape with dummy weights (config, tokenizer and random codebooks at 4 and 2
bits per element; speed does not depend on the centroids):

    python eval/serve_bench.py model /tmp/llama8b --tokenizer-from eval/data/smollm2 --bits 4 2
    mkdir -p /tmp/sweep/llama8b
    vllm bench sweep serve \\
      --serve-cmd "vllm serve /tmp/llama8b --load-format dummy --max-model-len 4096 --gpu-memory-utilization 0.9" \\
      --bench-cmd "vllm bench serve --model /tmp/llama8b --dataset-name random --random-input-len 1024 --random-output-len 128 --num-prompts 160 --ignore-eos" \\
      --serve-params eval/serve_params/serve_llama8b.json --bench-params eval/serve_params/rates_short.json \\
      --num-runs 1 --warmup-num-prompts 16 --output-dir /tmp/sweep -e llama8b --resume
    python eval/serve_bench.py collect /tmp/sweep/llama8b --out eval/results/serve_bench.json \\
      --command "vllm bench sweep serve ..."

The long-context mix (prompts of 4K-12K tokens, outputs of 512-1536, 200 requests all at
once: the request rate each backend sustains when its KV cache is the limit):

    mkdir -p /tmp/sweep/llama8b_long
    vllm bench sweep serve \\
      --serve-cmd "vllm serve /tmp/llama8b --load-format dummy --max-model-len 16384 --gpu-memory-utilization 0.9" \\
      --bench-cmd "vllm bench serve --model /tmp/llama8b --dataset-name random --random-input-len 8192 --random-output-len 1024 --random-range-ratio 0.5 --num-prompts 200 --ignore-eos" \\
      --serve-params eval/serve_params/serve_llama8b_long.json --bench-params eval/serve_params/rates_long.json \\
      --num-runs 1 --warmup-num-prompts 4 --output-dir /tmp/sweep -e llama8b_long --resume
    python eval/serve_bench.py collect /tmp/sweep/llama8b_long --out eval/results/serve_bench_long.json \\
      --command "vllm bench sweep serve ..."

(`--resume` continues an interrupted sweep and needs the experiment folder to exist.) A
server takes minutes to start on a cold machine: one serve setting per invocation, each
with a serve-params file holding that one entry, loses at most one setting to a cut:

    for s in FLASH_ATTN CUSTOM_4bits CUSTOM_2bits; do
      python -c "import json; d = json.load(open('eval/serve_params/serve_llama8b_long.json')); json.dump({'$s': d['$s']}, open('/tmp/serve_$s.json', 'w'))"
      vllm bench sweep serve ... --serve-params /tmp/serve_$s.json ... -e llama8b_long --resume
    done

SmolLM2 with calibrated codebooks next to the model (`MODEL/pq/codebooks_m32.safetensors`
for 4 bits, `codebooks_m16.safetensors` for 2 bits): the same with `--serve-cmd "vllm serve
eval/data/smollm2 --max-model-len 4096 --gpu-memory-utilization 0.5"`, `--serve-params
eval/serve_params/serve_smollm2.json` and `--bench-params eval/serve_params/rates.json`.

`model --weights` saves random bf16 weights instead (16 GB), e.g. to time calibration on
Llama-3-8B's shape.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
from pathlib import Path

from common import LLAMA3_8B, provenance, write_model_dir, write_result

KEEP = ("completed", "failed", "duration", "request_throughput", "output_throughput",
        "total_token_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
        "p99_tpot_ms", "median_itl_ms", "p99_itl_ms")


def rows_of(exp: Path) -> list[dict]:
    """One row per (server setting, request rate) of a sweep's experiment folder."""
    rows = []
    for path in sorted(exp.glob("*/run=*.json")):
        m = re.match(r"SERVE--(.+?)-BENCH-", path.parent.name)
        data = json.loads(path.read_text())
        rows.append(dict(setting=m.group(1) if m else path.parent.name,
                         request_rate=data.get("request_rate"),  # a number, or "inf": all at once
                         **{k: data.get(k) for k in KEEP}))
    return sorted(rows, key=lambda r: (r["setting"], float(r["request_rate"])))


def model(a) -> int:
    if a.weights:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.set_default_dtype(torch.bfloat16)
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            LlamaForCausalLM(LlamaConfig(**LLAMA3_8B)).save_pretrained(a.out)
    else:
        head_dim = LLAMA3_8B["head_dim"]
        write_model_dir(a.out, [head_dim * bits // 8 for bits in a.bits], a.maps)  # 8-bit codes
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(a.tokenizer_from, f), a.out)
    print("saved", a.out)
    return 0


def collect(a) -> int:
    rows = rows_of(Path(a.experiment_dir))
    if not rows:
        print(f"serve_bench.py: no run=*.json under {a.experiment_dir}", file=sys.stderr)
        return 1
    write_result(a.out, dict(provenance(), command=a.command, note=a.note, rows=rows))
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    m = sub.add_parser("model", help="a Llama-3-8B-shaped model folder to serve")
    m.add_argument("out")
    m.add_argument("--tokenizer-from", required=True, help="a local model folder")
    m.add_argument("--bits", type=int, nargs="+", default=[4], choices=(2, 4),
                   help="bits per element of the random codebooks")
    m.add_argument("--maps", action="store_true",
                   help="codebooks with K and V maps, as calibrate writes them")
    m.add_argument("--weights", action="store_true",
                   help="random bf16 weights (16 GB) instead of config and codebooks")
    c = sub.add_parser("collect", help="a sweep's experiment folder into one results file")
    c.add_argument("experiment_dir")
    c.add_argument("--out", required=True)
    c.add_argument("--command", required=True, help="the sweep command, recorded as run")
    c.add_argument("--note", default="", help="what the settings hold (model, codebooks)")
    a = p.parse_args()
    return model(a) if a.what == "model" else collect(a)


if __name__ == "__main__":
    sys.exit(main())
