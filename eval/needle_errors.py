"""How well the codes keep what a passkey prompt asks for: the relative coding error of K
and V at the needle's digits against the haystack's tokens, per layer, for each codebook
file, on passkey prompts made as eval/long_context.py makes them.

The model runs unquantized in transformers; each layer's keys (after RoPE) and values are
encoded with the file's codebooks as the backend encodes them (nearest centroid in the
trained metric) and decoded back. The error of a token is ||x - x_hat||^2 / ||x||^2,
averaged over KV heads; BOS, the needle's own words and the last 200 positions (the
question and the serving window) are left out of the haystack's.

    python eval/needle_errors.py --model eval/data/smollm2 --length 2048 --prompts 40 \\
        --codebooks eval/data/smollm2/pq/b4S.safetensors eval/data/smollm2/pq/k4v2S.safetensors
"""

from __future__ import annotations

import argparse
import os
import random
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from accuracy_sim import dequant, file_layers  # noqa: E402
from common import codebook_meta, provenance, write_result  # noqa: E402
from long_context import Text, make_sample  # noqa: E402

NAME = "pq_needle_record"
TAIL = 200  # last positions left out of the haystack's tokens: the question, the window


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--codebooks", nargs="+", required=True)
    p.add_argument("--length", type=int, default=2048, help="prompt length in tokens")
    p.add_argument("--prompts", type=int, default=40)
    p.add_argument("--haystack", nargs="+",
                   default=["eval/data/text/fortunes.jsonl", "eval/data/text/heldout.jsonl"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default="eval/results/needle_errors.json")
    a = p.parse_args(argv)

    from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    tok = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16).to(a.device).eval()
    seen = {}

    def record(module, q, k, v, mask, **kw):  # sdpa, keeping each layer's K and V [T, H, d]
        seen[module.layer_idx] = (k[0].transpose(0, 1).float(), v[0].transpose(0, 1).float())
        return sdpa_attention_forward(module, q, k, v, mask, **kw)

    AttentionInterface.register(NAME, record)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)  # causal and sliding as sdpa's
    model.config._attn_implementation = NAME
    text_cfg = model.config.get_text_config()
    layers = text_cfg.num_hidden_layers
    books = [file_layers(path)[1][:layers] for path in a.codebooks]
    # per file, part and layer: summed error and count, at the digits and in the haystack
    sums = torch.zeros(len(a.codebooks), 2, layers, 2, 2, dtype=torch.float64)
    text, rng = Text(tok, a.haystack), random.Random(a.seed)
    for s in range(a.prompts):
        smp = make_sample(text, "passkey", a.length, (s + 0.5) / a.prompts, rng)
        ids, key = smp["ids"], smp["answer"]
        needle = text.encode_many([f"The pass key is {key}. Remember it. {key} is the pass key."])[0]
        at = next(i for i in range(len(ids)) if ids[i : i + len(needle)] == needle)
        where = torch.zeros(2, len(ids), dtype=torch.bool)  # [digits, haystack]
        for j, t in enumerate(needle):
            where[0, at + j] = tok.decode([t]).strip().isdigit()
        where[1, 1:] = True
        where[1, at : at + len(needle)] = False
        where[1, -TAIL:] = False
        with torch.no_grad():
            model(torch.tensor([ids], device=a.device))
        for f, per_layer in enumerate(books):
            for i, (kc, vc, tk, tv) in enumerate(per_layer):
                for part, (x, c, t) in enumerate(((seen[i][0], kc, tk), (seen[i][1], vc, tv))):
                    t = None if t is None else t.to(a.device).float()
                    xh = dequant(x, c.to(a.device).float(), t)
                    err = (((xh - x) ** 2).sum(-1) / (x**2).sum(-1).clamp_min(1e-12)).mean(-1).cpu()
                    for w in range(2):
                        sums[f, part, i, w] += torch.tensor([err[where[w]].sum().item(), where[w].sum().item()])
    mean = sums[..., 0] / sums[..., 1].clamp_min(1)
    types = getattr(text_cfg, "layer_types", None)
    metas = [codebook_meta(path) for path in a.codebooks]
    rows = [dict(codebook_sha256=metas[f]["codebook_sha256"], part=part, layer=i,
                 attention=types[i] if types else "full_attention",
                 digits=round(mean[f, pi, i, 0].item(), 6), haystack=round(mean[f, pi, i, 1].item(), 6))
            for f, path in enumerate(a.codebooks) for pi, part in enumerate("kv") for i in range(layers)]
    for f, path in enumerate(a.codebooks):
        for pi, part in enumerate("KV"):
            print(f"{os.path.basename(path)} {part}: digits {mean[f, pi, :, 0].mean():.4f}, "
                  f"haystack {mean[f, pi, :, 1].mean():.4f} (mean over layers)")
    dev = torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu"
    write_result(a.out, dict(provenance(dev), model=a.model, length=a.length, prompts=a.prompts,
                             haystack=[os.path.basename(h) for h in a.haystack], seed=a.seed,
                             digit_tokens=int(sums[0, 0, 0, 0, 1].item()),
                             haystack_tokens=int(sums[0, 0, 0, 1, 1].item()), codebooks=metas,
                             rows=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
