"""How much a scheduling-induced difference in K/V grows when it is read through PQ codes.

Chunked prefill computes a prompt's K/V with other matrix shapes than a one-shot prefill,
so in bf16 they differ in their last bits (vLLM 0.32 is not invariant to this, not even
FLASH_ATTN in batch-invariant mode: eval/results/vllm_features*.json). Read at full
precision such a difference stays small; read through codes, a vector that moved across a
boundary between two centroids' cells reads a whole centroid distance away. This script
measures that on the CPU (transformers, bf16): each document's K/V once from a one-shot
forward pass and once from 64-token chunks, then per layer the relative difference of the
raw K/V, the share of codes that differ, and the relative difference of what the codes
decode to; amplification = dequantized / raw.

    python eval/flip_amplification.py --model eval/data/smollm2 \
        --heldout eval/data/text/heldout.jsonl \
        --codebooks eval/data/smollm2/pq/codebooks_m32.safetensors
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from provenance import provenance  # eval/ is the script's directory
from accuracy_sim import nearest


def kv_caches(model, ids, chunk):
    from transformers import DynamicCache

    with torch.inference_mode():
        one = DynamicCache()
        model(ids, past_key_values=one, use_cache=True)
        chunked = DynamicCache()
        for s in range(0, ids.shape[1], chunk):
            model(ids[:, s : s + chunk], past_key_values=chunked, use_cache=True)
    return one, chunked


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--heldout", required=True)
    p.add_argument("--codebooks", required=True)
    p.add_argument("--docs", type=int, default=4)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--out", default="eval/results/flip_amplification.json")
    a = p.parse_args()
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_pq_backend import codebooks, reference

    tok = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16).eval()
    info = codebooks.read_info(a.codebooks)
    if info.transforms:
        sys.exit(f"{a.codebooks} has K/V maps ({', '.join(info.transforms)}); this script "
                 "measures flips of map-free codebooks (calibrate --plain)")
    books = [codebooks.load_layer(info, i, slice(None)) for i in range(info.num_layers)]
    texts = [json.loads(line)["text"] for line in open(a.heldout)][: a.docs]
    # per layer and K/V, summed over documents: squared norms, share of codes that differ
    acc = torch.zeros(info.num_layers, 2, 5, dtype=torch.float64)
    for text in tqdm(texts, desc="documents"):
        ids = [tok.bos_token_id] + tok(text, add_special_tokens=False)["input_ids"]
        one, chunked = kv_caches(model, torch.tensor([ids[: a.tokens]]), a.chunk)
        for layer in range(info.num_layers):
            pairs = ((one.layers[layer].keys, chunked.layers[layer].keys),
                     (one.layers[layer].values, chunked.layers[layer].values))
            for j, (x, y) in enumerate(pairs):
                x, y = (t[0].transpose(0, 1).float() for t in (x, y))  # [T, H, d]
                cb = books[layer][j]
                cx, cy = nearest(x, cb), nearest(y, cb)
                dx, dy = reference.decode_codes(cx, cb), reference.decode_codes(cy, cb)
                acc[layer, j] += torch.tensor([
                    (x - y).square().sum(), x.square().sum(), (dx - dy).square().sum(),
                    dx.square().sum(), (cx != cy).float().mean(),
                ], dtype=torch.float64)
    rows = []
    for layer in range(info.num_layers):
        for j, name in enumerate("KV"):
            dxy, xx, ddq, dqq, flips = acc[layer, j].tolist()
            raw, deq = (dxy / xx) ** 0.5, (ddq / dqq) ** 0.5
            rows.append(dict(layer=layer, tensor=name, raw_rel_diff=raw,
                             codes_differing=flips / len(texts), dequant_rel_diff=deq,
                             amplification=deq / raw if raw else None))
    amps = sorted(r["amplification"] for r in rows if r["amplification"] is not None)
    summary = dict(raw_differs=f"{len(amps)} of {len(rows)} (layer, K/V)",
                   codes_differ=f"{sum(r['codes_differing'] > 0 for r in rows)} of {len(rows)}",
                   amplification_median=amps[len(amps) // 2], amplification_min=amps[0],
                   amplification_max=amps[-1])
    print(json.dumps(summary))
    with open(a.out, "w") as f:
        json.dump(dict(provenance("cpu (transformers, bfloat16)"), m_k=info.m_k, m_v=info.m_v, docs=len(texts), tokens=a.tokens, chunk=a.chunk,
                       summary=summary, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
