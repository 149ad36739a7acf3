"""Token perplexity with K/V read exactly as the CUSTOM backend reads them (codes from the
reference quantizer, full precision inside the residual window), computed in
transformers on the CPU: a way to compare codebooks and windows without a GPU. On the
same documents it reproduces what vLLM measures (see eval/results/quant_ppl_cpu.json).

    python eval/quant_ppl_cpu.py --model eval/data/smollm2 --heldout eval/data/text/heldout.jsonl \
        --codebooks eval/data/smollm2/pq/codebooks_m32.safetensors --windows 0 128
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch
from provenance import provenance  # eval/ is the script's directory


def nearest(x, cb):
    """reference.encode through a matmul (||c||^2 - 2 x.c): the same codes but for
    rounding at near-ties, and fast enough for thousands of tokens on a CPU."""
    n, h, d = x.shape
    _, m, c, ds = cb.shape
    xs = x.reshape(n, h * m, ds).transpose(0, 1)  # [h*m, n, ds]
    cs = cb.reshape(h * m, c, ds)
    dist = (cs * cs).sum(-1).unsqueeze(1) - 2 * torch.bmm(xs, cs.transpose(1, 2))
    return dist.argmin(-1).transpose(0, 1).reshape(n, h, m).to(torch.uint8)


def attention_fn(books, window):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from vllm_pq_backend import reference
    from vllm_pq_backend.layout import window_start

    def fn(module, q, k, v, mask, scaling=None, **kw):
        if books is None:
            return sdpa_attention_forward(module, q, k, v, mask, scaling=scaling, **kw)
        kc, vc = books[module.layer_idx]
        kk, vv = k[0].transpose(0, 1).float(), v[0].transpose(0, 1).float()  # [T, H, d]
        kq = reference.decode_codes(nearest(kk, kc), kc)
        vq = reference.decode_codes(nearest(vv, vc), vc)
        if window == 0:  # every key through its codes: plain (fast) SDPA on K^ and V^
            k, v = (x.transpose(0, 1)[None].to(q.dtype) for x in (kq, vq))
            return sdpa_attention_forward(module, q, k, v, mask, scaling=scaling, **kw)
        g = q.shape[1] // k.shape[1]
        qf = q[0].float()  # [Hq, T, d]
        t = kk.shape[0]
        pos = torch.arange(t)
        causal = pos.view(1, -1) <= pos.view(-1, 1)
        exact = causal & (pos.view(1, -1) >= window_start(pos, window).view(-1, 1))
        rep = lambda x: x.transpose(0, 1).repeat_interleave(g, 0)  # noqa: E731  [Hq, T, d]
        s = torch.where(exact, qf @ rep(kk).transpose(1, 2), qf @ rep(kq).transpose(1, 2))
        p = (s * scaling).masked_fill(~causal, float("-inf")).softmax(-1)
        o = (p * exact) @ rep(vv) + (p * ~exact) @ rep(vq)
        return o.transpose(0, 1)[None].to(q.dtype), None

    return fn


def perplexity(model, docs, books, window):
    from transformers import AttentionInterface

    AttentionInterface.register("pq_sim", attention_fn(books, window))
    model.config._attn_implementation = "pq_sim"
    nll, n = 0.0, 0
    with torch.inference_mode():
        for ids in docs:
            x = torch.tensor([ids])
            lp = torch.log_softmax(model(x).logits[0, :-1].float(), -1)
            nll -= lp.gather(1, x[0, 1:, None]).sum().item()
            n += len(ids) - 1
    return math.exp(nll / n), n


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--heldout", required=True)
    p.add_argument("--codebooks", nargs="+", required=True)
    p.add_argument("--windows", type=int, nargs="+", default=[0])
    p.add_argument("--docs", type=int, default=16)
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--no-bos", action="store_true",
                   help="documents start with their first text token (no BOS attention sink to pin)")
    p.add_argument("--out", default="eval/results/quant_ppl_cpu.json")
    a = p.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_pq_backend import codebooks

    tok = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval()
    docs = [json.loads(line)["text"] for line in open(a.heldout)][: a.docs]
    bos = [] if a.no_bos else [tok.bos_token_id]
    docs = [(bos + tok(d, add_special_tokens=False)["input_ids"])[: a.max_len] for d in docs]
    base, n = perplexity(model, docs, None, 0)
    rows = [dict(codebooks=None, window=None, ppl=base)]
    print(f"unquantized: ppl {base:.4f} over {n} tokens", flush=True)
    for path in a.codebooks:
        info = codebooks.read_info(path)
        books = [codebooks.load_layer(info, i, slice(None)) for i in range(info.num_layers)]
        for w in a.windows:
            ppl, _ = perplexity(model, docs, books, w)
            rows.append(dict(codebooks=path, m=info.m, window=w, ppl=ppl,
                             ppl_vs_unquantized_pct=round(100 * (ppl / base - 1), 2)))
            print(f"{os.path.basename(path)} M={info.m} W={w}: ppl {ppl:.4f} "
                  f"({rows[-1]['ppl_vs_unquantized_pct']:+.2f}%)", flush=True)
    with open(a.out, "w") as f:
        json.dump(dict(provenance("cpu (transformers, float32)"), tokens=n, documents=len(docs), bos=not a.no_bos,
                       rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
