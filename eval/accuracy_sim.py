"""Codebook ablations by simulation: token perplexity with K/V read exactly as the CUSTOM
backend reads them (codes by nearest centroid in the trained metric, full precision
inside the residual window, the BOS sink pinned), computed in transformers on the GPU
(or CPU). One process loads the model, captures the calibration statistics once, trains
every configuration (vllm_pq_backend.calibrate.train) and scores every text domain.
On the same documents it agreed with vLLM within 0.06 points of perplexity change
(docs/results.md); winners are confirmed in vLLM by eval/quality.py.

    python eval/accuracy_sim.py --model eval/data/smollm2 --calib eval/data/text/calib.jsonl \
        --eval python=eval/data/text/heldout.jsonl kernel=eval/data/text/kernel.jsonl \
        --configs plain default --bits 4/4 2/2 4/2

Configurations are named in CONFIGS (a Method each, or pre-RoPE keys); bits are K/V bits
per element. Writes one row per (configuration, bits, window, domain) to --out.

``--exact SPEC ...`` also scores every set of codebooks with more of K and V kept in full
precision, one idea each (what it would be worth, and where the error sits):
  rows:F   the fraction F of each layer's and KV head's keys, and of its values, whose
           codes err most (relative L2) read exactly: a sparse store of whole vectors,
           16 x F more bits per element;
  elems:F  the fraction F of each layer's and KV head's elements of K and of V whose codes
           err most, read exactly (dense-and-sparse, as KVQuant or MUSTAFAR): about 24 x F
           more bits per element (a 16-bit value and an 8-bit index);
  page:P   in every block of 128 positions, the P keys and the P values of each KV head
           whose codes err most, read exactly: the rows store kept inside vLLM's pages,
           16 x P / 128 more bits per element;
  vec:R    the R elements of every key and every value whose codes err most, read exactly:
           the same idea with a fixed count per vector (a layout a kernel reads in step),
           R x 24 / head_dim more bits per element;
  mass:N   the N keys of each layer and KV head (BOS aside) that draw the most attention
           over the whole document, K and V read exactly: an oracle for keeping exact the
           tokens where attention concentrates, as attention-sink or heavy-hitter caches do;
  first:N  positions 1 to N read exactly (BOS is already): the sink tokens of StreamingLLM,
           a choice that needs no oracle.

``--allocate BITS ...`` (with --calib and uniform --codebooks files of several widths, all
calibrated on that text) measures each layer's cost of K and of V at every width the files
give, from one Fisher capture of --calib (calibrate.coding_cost), chooses per layer the
pair of widths the kernels build of least summed cost for a mean of at most BITS per
element (calibrate.allocate_pairs, as calibrate --bits-mean does), and scores it with
each layer's K and V read through the file of its widths: what K and V bits by layer would
be worth.

``--v-from PATH@LAYERS[+PATH@LAYERS] ...`` also scores the first --codebooks file with the V
codebooks of the named layers (``18-23``, ``12-17,24-29``) taken from the codebook file
PATH of other V bits (several files joined by ``+``): what giving some layers more or fewer
bits of V than the others is worth, at the bits per element it averages to.

    python eval/accuracy_sim.py --model eval/data/smollm2 --configs --long --max-len 8192 \
        --docs 16 --eval kernel=eval/data/text/kernel.jsonl \
        --codebooks eval/data/smollm2/pq/codebooks_m32.safetensors \
        --exact rows:0.01 elems:0.01 mass:32 --out eval/results/long_exact_sim.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, replace

import torch
from common import POSITION_BUCKETS, bucket_name, codebook_meta, load_docs, provenance

from vllm_pq_backend import calibrate, codebooks
from vllm_pq_backend.calibrate import Method, rotate_half
from vllm_pq_backend.config import parse_layers
from vllm_pq_backend.layout import window_start

PLAIN = Method(k_gamma=0, k_rotate=False, k_alpha=0, v_rotate=False, v_alpha=0)
CONFIGS = {  # name -> (Method, keys quantized before RoPE)
    "plain": (PLAIN, False),
    "k_query_g1": (replace(PLAIN, k_gamma=1.0), False),
    "k_query_g0.5": (replace(PLAIN, k_gamma=0.5), False),
    "k_rotate": (replace(PLAIN, k_rotate=True), False),
    "k_query_g0.5_rotate": (replace(PLAIN, k_gamma=0.5, k_rotate=True), False),
    "k_query_g1_rotate": (replace(PLAIN, k_gamma=1.0, k_rotate=True), False),
    "k_mass0.5": (replace(PLAIN, k_alpha=0.5), False),
    "v_mass0.5": (replace(PLAIN, v_alpha=0.5), False),
    "v_mass1": (replace(PLAIN, v_alpha=1.0), False),
    "v_rotate": (replace(PLAIN, v_rotate=True), False),
    "v_rotate_mass0.5": (replace(PLAIN, v_rotate=True, v_alpha=0.5), False),
    "pre_rope": (PLAIN, True),
    "pre_rope_v_rotate_mass0.5": (replace(PLAIN, v_rotate=True, v_alpha=0.5), True),
    "default": (Method(), False),  # at <= 2 bits of V: calibrate.default_method's v_gamma
    "default_k_g0.25": (replace(Method(), k_gamma=0.25), False),
    "default_k_g0.75": (replace(Method(), k_gamma=0.75), False),
    "default_v_o0.5": (replace(Method(), v_gamma=0.5), False),
    "default_v_o1": (replace(Method(), v_gamma=1.0), False),
    "default_v_o0.5_nomass": (replace(Method(), v_gamma=0.5, v_alpha=0), False),
    # calibrate's default at the bits (a dict: fields over default_method's)
    "fisher_k0.5": ({"k_fisher": 0.5}, False),
    "fisher_k1": ({"k_fisher": 1.0}, False),
    "fisher_v0.5": ({"v_fisher": 0.5}, False),
    "fisher_v1": ({"v_fisher": 1.0}, False),
    "fisher_kv0.5": ({"k_fisher": 0.5, "v_fisher": 0.5}, False),
    "fisher_kv1": ({"k_fisher": 1.0, "v_fisher": 1.0}, False),
}


def rope_pairs(d: int) -> torch.Tensor:
    """A permutation putting each RoPE pair (i, i + d/2) side by side, so that 2-dim
    subspaces hold whole pairs (rotate_half convention)."""
    h = d // 2
    return torch.tensor([j for i in range(h) for j in (i, i + h)])


def file_layers(path: str):
    """A codebook file's header and, per layer, its (K centroids, V centroids, K transform,
    V transform), a transform None where the file has none."""
    info = codebooks.read_info(path)
    return info, [(*codebooks.load_layer(info, i, slice(None)),
                   *codebooks.load_transforms(info, i, slice(None)))
                  for i in range(info.num_layers)]


def nearest(x, cb):
    """Codes of ``x [n, H, d]`` under centroids ``cb [H, m, 256, ds]`` (||c||^2 - 2 x.c)."""
    n, h, d = x.shape
    _, m, c, ds = cb.shape
    xs = x.reshape(n, h * m, ds).transpose(0, 1)
    cs = cb.reshape(h * m, c, ds)
    dist = (cs * cs).sum(-1).unsqueeze(1) - 2 * torch.bmm(xs, cs.transpose(1, 2))
    return dist.argmin(-1).transpose(0, 1).reshape(n, h, m)


def dequant(x, cb, t):
    """What the backend reads back for rows ``x [n, H, d]``: codes of ``x t`` decoded and
    mapped back by ``t^-1`` (t None: identity)."""
    xt = x if t is None else torch.einsum("nhd,hde->nhe", x, t)
    codes = nearest(xt, cb)
    h, m, _, ds = cb.shape
    rec = cb[torch.arange(h)[None, :, None], torch.arange(m)[None, None], codes].reshape(x.shape)
    return rec if t is None else torch.einsum("nhe,hed->nhd", rec, torch.linalg.inv(t))


PAGE = 128  # the backend's default block size, for page:P


def exact_spec(spec: str) -> tuple[str, float]:
    """``rows:F`` / ``elems:F`` (0 < F < 1) or ``page:N`` / ``vec:N`` / ``mass:N`` /
    ``first:N`` (N >= 1) as (kind, amount)."""
    kind, _, amount = spec.partition(":")
    try:
        x = float(amount)
    except ValueError:
        x = -1.0
    ok = (0 < x < 1) if kind in ("rows", "elems") else \
        (x >= 1 and x == int(x)) if kind in ("page", "vec", "mass", "first") else False
    if not ok:
        raise argparse.ArgumentTypeError(f"{spec!r}: expected rows:F or elems:F with 0 < F < 1, "
                                         f"or page:N, vec:N, mass:N or first:N with N a whole number >= 1")
    return kind, x


def v_from_spec(spec: str) -> list[tuple[str, list[int]]]:
    """PATH@LAYERS[+PATH@LAYERS] (``--v-from``): each donor codebook file and its layers,
    e.g. ``b4.safetensors@18-23,26+b1.safetensors@0-11``."""
    out = []
    for part in spec.split("+"):
        path, _, layers = part.rpartition("@")
        try:
            ids = parse_layers(layers)
        except ValueError:
            ids = []
        if not path or not ids:
            raise argparse.ArgumentTypeError(
                f"--v-from {spec!r}: give PATH@LAYERS, e.g. b4.safetensors@18-23")
        out.append((path, ids))
    return out


def keep_exact(kind: str, amount: float, x, xq, mass=None):
    """``xq [T, H, d]`` (codes read back) with part of it replaced by the exact ``x``: per KV
    head, the ``rows`` or ``elems`` fraction whose codes err most, the ``page`` rows of every
    block of PAGE positions that err most, the ``vec`` elements of
    each vector that err most, the ``mass`` keys that draw the most attention (``mass
    [H, T]``), or the ``first`` positions; position 0 is pinned already."""
    t, h, d = x.shape
    out = xq.clone()
    heads = torch.arange(h, device=x.device)
    if kind in ("rows", "page"):
        err = ((x - xq) ** 2).sum(-1) / (x * x).sum(-1).clamp_min(1e-30)  # [T, H]
        err[0] = -1
        if kind == "rows":
            sel = err.topk(max(1, math.ceil(amount * t)), dim=0).indices  # [n, H]
        else:
            sel = torch.cat([err[lo : lo + PAGE].topk(min(int(amount), t - lo, PAGE), dim=0).indices + lo
                             for lo in range(0, t, PAGE)])  # [P per page, H]
    elif kind == "mass":
        m = mass.clone()
        m[:, 0] = -1
        sel = m.topk(min(int(amount), t), dim=1).indices.T  # [N, H]
    elif kind == "first":
        out[1 : int(amount) + 1] = x[1 : int(amount) + 1]
        return out
    elif kind == "elems":
        err = (x - xq).abs().transpose(0, 1).reshape(h, t * d)  # [H, T*d]
        sel = err.topk(max(1, math.ceil(amount * t * d)), dim=1).indices
        flat = out.transpose(0, 1).reshape(h, t * d)
        flat.scatter_(1, sel, x.transpose(0, 1).reshape(h, t * d).gather(1, sel))
        return flat.view(h, t, d).transpose(0, 1)
    else:  # vec
        sel = (x - xq).abs().topk(min(int(amount), d), dim=-1).indices  # [T, H, R]
        return out.scatter_(-1, sel, x.gather(-1, sel))
    rows = (sel, heads.expand_as(sel))  # whole vectors: [n, H] positions, one per head
    out[rows] = x[rows]
    return out


class Sim:
    """transformers attention function: exact, or through one layer set of codebooks."""

    NAME = "pq_sim"

    def __init__(self):
        self.books = None  # per layer: dict(k, v, k_transform, v_transform) on the device
        self.window = 0
        self.pre_rope = None  # permutation of dims when keys are quantized before RoPE
        self.rope = None  # (cos, sin) [T, d] of the current document
        self.parts = "kv"  # which of K and V are read through codes
        self.layers = None  # the layers that are quantized (None: all)
        self.exact = None  # (kind, amount) of keep_exact, or None

    def __call__(self, module, q, k, v, mask, scaling=None, **kw):
        t = k.shape[2]
        g = q.shape[1] // k.shape[1]
        qf = q[0].float()
        kk, vv = k[0].transpose(0, 1).float(), v[0].transpose(0, 1).float()  # [T, H, d]
        pos = torch.arange(t, device=q.device)
        causal = pos.view(1, -1) <= pos.view(-1, 1)
        rep = lambda x: x.transpose(0, 1).repeat_interleave(g, 0)  # noqa: E731  [Hq, T, d]
        if self.books is None or (self.layers is not None and module.layer_idx not in self.layers):
            s = qf @ rep(kk).transpose(1, 2)
            p = (s * scaling).masked_fill(~causal, float("-inf")).softmax(-1)
            return (p @ rep(vv)).transpose(0, 1)[None].to(q.dtype), None
        b = self.books[module.layer_idx]
        if "k" not in self.parts:
            kq = kk
        elif self.pre_rope is not None:
            cos, sin = (x[:, None] for x in self.rope)
            kp = kk * cos - rotate_half(kk) * sin  # R(-theta) k
            perm = self.pre_rope
            kq_p = torch.empty_like(kp)
            kq_p[..., perm] = dequant(kp[..., perm].contiguous(), b["k"], b["k_transform"])
            kq = kq_p * cos + rotate_half(kq_p) * sin
        else:
            kq = dequant(kk, b["k"], b["k_transform"])
        vq = dequant(vv, b["v"], b["v_transform"]) if "v" in self.parts else vv
        if b["sink"]:  # position 0 is exact (pinned) in every codebook
            kq[0], vq[0] = kk[0], vv[0]
        s_exact = qf @ rep(kk).transpose(1, 2)
        if self.exact is not None:
            kind, amount = self.exact
            mass = None
            if kind == "mass":  # attention each key draws from every query, exact K and V
                p = (s_exact * scaling).masked_fill(~causal, float("-inf")).softmax(-1)
                mass = p.sum(1).view(k.shape[1], g, t).sum(1)
            kq = keep_exact(kind, amount, kk, kq, mass) if "k" in self.parts else kq
            vq = keep_exact(kind, amount, vv, vq, mass) if "v" in self.parts else vq
        exact = causal & (pos.view(1, -1) >= window_start(pos, self.window).view(-1, 1))
        s = torch.where(exact, s_exact, qf @ rep(kq).transpose(1, 2))
        p = (s * scaling).masked_fill(~causal, float("-inf")).softmax(-1)
        o = (p * exact) @ rep(vv) + (p * ~exact) @ rep(vq)
        return o.transpose(0, 1)[None].to(q.dtype), None


def perplexity(model, docs, sim, device):
    """(perplexity, scored tokens, {position bucket: [perplexity, tokens]}), buckets by the
    position of the predicted token."""
    rotary = model.model.rotary_emb
    nll, pos = [], []
    with torch.inference_mode():
        for ids in docs:
            x = torch.tensor([ids], device=device)
            cos, sin = rotary(torch.zeros(1, device=device), torch.arange(len(ids), device=device)[None])
            sim.rope = (cos[0].float(), sin[0].float())
            lp = torch.log_softmax(model(x).logits[0, :-1].float(), -1)
            nll.append(-lp.gather(1, x[0, 1:, None])[:, 0].cpu().double())
            pos.append(torch.arange(1, len(ids)))
    nll, pos = torch.cat(nll), torch.cat(pos)
    buckets = {}
    for lo, hi in POSITION_BUCKETS:
        sel = (pos >= lo) & (pos < hi)
        if sel.any():
            buckets[bucket_name(lo, hi)] = [math.exp(nll[sel].mean().item()), int(sel.sum())]
    return math.exp(nll.mean().item()), len(nll), buckets


def allocate(a, stats, files, score, d, dev) -> None:
    """--allocate: each layer's K and V cost at every width the files give
    (calibrate.coding_cost, from the Fisher capture of --calib), then for each mean the
    pair of widths per layer, among those the kernels build (layout.BIT_RATES), of least
    summed cost (calibrate.allocate_pairs), scored with each layer's K and V read through
    the file of its widths."""
    from vllm_pq_backend.layout import BIT_RATES, bits_of

    parts = {"k": {}, "v": {}}  # bits -> (path, books): the first file with those bits
    for path, (info, books) in zip(a.codebooks, files):
        if not info.uniform:
            raise SystemExit(f"--allocate: {path} has bits by layer; give uniform files")
        parts["k"].setdefault(bits_of(d, info.m_k), (path, books))
        parts["v"].setdefault(bits_of(d, info.m_v), (path, books))
    pairs = [(bk, bv) for bk, bv in BIT_RATES if bk in parts["k"] and bv in parts["v"]]
    costs = [{part: {b: calibrate.coding_cost(st, part, books[part][i], books[f"{part}_transform"][i], dev)
                     for b, (_, books) in parts[part].items()} for part in "kv"}
             for i, st in enumerate(stats)]
    pinned = stats[0].sink is not None
    for mean in a.allocate:
        layers = calibrate.allocate_pairs([c["k"] for c in costs], [c["v"] for c in costs],
                                          pairs, mean)
        mixed = {key: [] for key in ("k", "v", "k_transform", "v_transform")}
        for i, (bk, bv) in enumerate(layers):
            for part, b in (("k", bk), ("v", bv)):
                books = parts[part][b][1]
                mixed[part].append(books[part][i])
                mixed[f"{part}_transform"].append(books[f"{part}_transform"][i])
        params = dict(allocate=mean, layers=[list(x) for x in layers],
                      files={f"{part}{b:g}": dict(file=os.path.abspath(path),
                                                  codebook_sha256=codebook_meta(path)["codebook_sha256"])
                             for part in "kv" for b, (path, _) in parts[part].items()},
                      costs=[{part: {f"{b:g}": float(f"{x:.6g}") for b, x in c[part].items()}
                              for part in "kv"} for c in costs])
        score(f"allocate:{mean:g}", mixed, [b * d // 8 for b, _ in layers],
              [b * d // 8 for _, b in layers], False, params, None, pinned)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--calib", nargs="*", default=[], help="calibration text for --configs")
    p.add_argument("--eval", required=True, nargs="+", help="NAME=FILE.jsonl text domains")
    p.add_argument("--configs", nargs="*", default=["plain", "default"], choices=list(CONFIGS))
    p.add_argument("--codebooks", nargs="*", default=[],
                   help="also score these codebook files (as the backend reads them)")
    p.add_argument("--bits", nargs="+", default=["4/4", "2/2"], help="K/V bits per element")
    p.add_argument("--windows", type=int, nargs="+", default=[128])
    p.add_argument("--parts", nargs="+", default=["kv"], choices=["kv", "k", "v"],
                   help="also score with only K or only V through codes (where the error is)")
    p.add_argument("--exact", nargs="+", default=[], type=exact_spec, metavar="SPEC",
                   help="also score each set of codebooks with more kept exact: rows:F, "
                   "elems:F, page:P, vec:R, mass:N or first:N (see the docstring)")
    p.add_argument("--v-from", nargs="+", default=[], type=v_from_spec, metavar="PATH@LAYERS",
                   help="also score the first --codebooks file with these layers' V "
                   "codebooks from PATH (other V bits; see the docstring)")
    p.add_argument("--allocate", type=float, nargs="+", default=[], metavar="BITS",
                   help="also score K and V bits chosen per layer for a mean of at most BITS "
                   "per element, among the pairs the kernels build, each layer's K and V read "
                   "through the --codebooks file of their bits (see the docstring)")
    p.add_argument("--layer-groups", type=int, default=0,
                   help="also score with only each group of this many layers quantized")
    p.add_argument("--docs", type=int, default=64, help="documents per domain")
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--long", action="store_true", help="score --docs sequences of --max-len "
                   "tokens each, documents joined (packed, from each file's start), and report "
                   "perplexity by position (0-2K, 2-4K, 4-8K, ...): how the error grows with "
                   "distance")
    p.add_argument("--tokens", type=int, default=65536, help="calibration tokens")
    p.add_argument("--samples", type=int, default=32768)
    p.add_argument("--niter", type=int, default=Method.niter)
    p.add_argument("--shuffle-docs", action="store_true", help="as calibrate --shuffle-docs")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default="eval/results/accuracy_sim.json")
    a = p.parse_args()
    dev = a.device

    from transformers import AttentionInterface

    cfg, tok, model = calibrate.load_model(a.model, a.dtype, dev)
    d = cfg.head_dim
    domains, paths = {}, {}
    for spec in a.eval:
        name, path = spec.split("=", 1)
        paths[name] = os.path.abspath(path)
        domains[name] = (calibrate.token_sequences(tok, calibrate.read_documents([path]), a.max_len,
                                                   a.docs * a.max_len, pack=True)[: a.docs]
                         if a.long else load_docs(path, tok, a.max_len, a.docs))
    if (a.configs or a.allocate) and not a.calib:
        p.error("--configs trains codebooks and --allocate measures costs: give --calib TEXT")
    seqs = calibrate.token_sequences(tok, calibrate.read_documents(a.calib), a.max_len, a.tokens,
                                     0 if a.shuffle_docs else None) if a.configs or a.allocate else []
    total = sum(map(len, seqs))
    t0 = time.time()
    need_pre = any(CONFIGS[c][1] for c in a.configs)
    fisher = any(isinstance(CONFIGS[c][0], dict) for c in a.configs) or bool(a.allocate)
    stats = calibrate.capture(model, tok, seqs, min(1.0, a.samples / total), 0, max(a.windows),
                              dev, pre_rope=need_pre, fisher=fisher) if seqs else None
    capture_s = time.time() - t0

    sim = Sim()
    AttentionInterface.register(Sim.NAME, sim)
    model.config._attn_implementation = Sim.NAME
    base = {name: perplexity(model, docs, sim, dev) for name, docs in domains.items()}
    for name, (ppl, n, _) in base.items():
        print(f"bf16 {name}: ppl {ppl:.4f} over {n} tokens", flush=True)
    rows = [dict(method="bf16", eval_text=name, ppl=ppl, tokens=n, **({"buckets": b} if a.long else {}))
            for name, (ppl, n, b) in base.items()]
    stamp = dict(provenance(None if dev.startswith("cuda") else "cpu"), model=a.model,
                 calib_text=a.calib, calib_tokens=total, capture_seconds=round(capture_s, 1),
                 calib_samples=a.samples, shuffle_docs=a.shuffle_docs, max_len=a.max_len,
                 docs_per_domain=a.docs, packed_docs=a.long, dtype=a.dtype,
                 eval_text=paths,
                 note="simulation in transformers; 'ppl_bf16' is the same run unquantized")

    perm = rope_pairs(d)

    def score(cname, books, mk, mv, pre, method, train_s, pinned, digest=None, v_from=None):
        """Every window, part and layer group of one set of codebooks, on every domain;
        ``mv`` a list where layers differ in V's subspaces (``v_from``: where from)."""
        def layer(key, i):  # stacked or per-layer lists; None where there is no transform
            val = books[key]
            return None if val is None or val[i] is None else val[i].to(dev)

        sim.books = [dict(k=layer("k", i), v=layer("v", i), k_transform=layer("k_transform", i),
                          v_transform=layer("v_transform", i), sink=pinned)
                     for i in range(cfg.num_hidden_layers)]
        sim.pre_rope = perm.to(dev) if pre else None
        n_layers, g = cfg.num_hidden_layers, a.layer_groups
        variants = [(part, None, None) for part in a.parts] + [
            ("kv", range(i, min(i + g, n_layers)), None) for i in range(0, n_layers if g else 0, g or 1)] + [
            ("kv", None, spec) for spec in a.exact] if v_from is None else [("kv", None, None)]
        mvs = mv if isinstance(mv, list) else [mv] * n_layers
        bits_v = round(sum(8 * m / d for m in mvs) / n_layers, 4)
        mks = mk if isinstance(mk, list) else [mk] * n_layers
        bits_k = round(sum(8 * m / d for m in mks) / n_layers, 4)
        bits_k = int(bits_k) if bits_k.is_integer() else bits_k
        for w in a.windows:
            sim.window = w
            for part, layers, exact in variants:
                sim.parts, sim.layers, sim.exact = part, layers, exact
                for name, docs in domains.items():
                    ppl, n, buckets = perplexity(model, docs, sim, dev)
                    rows.append(dict(
                        method=cname, bits_k=bits_k, bits_v=int(bits_v) if bits_v.is_integer() else bits_v,
                        m_k=mk, m_v=mv, **({"v_from": v_from} if v_from else {}),
                        window=w, pre_rope=pre, quantized=part,
                        layers="all" if layers is None else f"{layers.start}-{layers.stop - 1}",
                        exact=None if exact is None else f"{exact[0]}:{exact[1]:g}",
                        eval_text=name, ppl=ppl, ppl_bf16=base[name][0],
                        delta_pct=round(100 * (ppl / base[name][0] - 1), 3),
                        train_seconds=train_s, method_params=method,
                        rel_mse_k=books.get("rel_mse_k"), rel_mse_v=books.get("rel_mse_v"),
                        **({"codebook_sha256": digest} if digest else {})))
                    if a.long:  # [perplexity, tokens, change against bf16 in %] per bucket
                        rows[-1]["buckets"] = {k: [p_, t, round(100 * (p_ / base[name][2][k][0] - 1), 3)]
                                               for k, (p_, t) in buckets.items()}
                    print(f"{cname:24s} K{bits_k:g}/V{bits_v:g} W={w:4d} {part:2s} "
                          f"{rows[-1]['layers']:5s} {rows[-1]['exact'] or '':11s} {name:8s}: ppl {ppl:.4f} "
                          f"({rows[-1]['delta_pct']:+.2f}%)"
                          + "".join(f"; {k} {v[2]:+.2f}%" for k, v in rows[-1].get("buckets", {}).items()),
                          flush=True)
        with open(a.out, "w") as f:  # after every configuration: a cut run keeps its rows
            json.dump(dict(stamp, rows=rows), f, indent=1)

    def read_books(path):
        """A codebook file's layers as score() takes them (lists: layers may differ)."""
        info, layers = file_layers(path)
        return info, {key: list(val) for key, val in
                      zip(("k", "v", "k_transform", "v_transform"), zip(*layers))}

    for n, path in enumerate(a.codebooks):  # files as calibrate wrote them
        info, books = read_books(path)
        cal = codebooks.calibration_of(info)
        pinned, digest = bool(cal.get("pinned_bos_sink")), codebook_meta(path)["codebook_sha256"]
        own_k = info.m_k or list(info.m_k_layers)  # lists where the file's layers differ
        own = info.m_v or list(info.m_v_layers)
        score(path, books, own_k, own, False, cal, None, pinned, digest)
        for donors in a.v_from if n == 0 else []:
            mixed = {key: list(val) for key, val in books.items()}
            mvs = list(info.m_v_layers)
            for donor, layers in donors:
                dinfo, dbooks = read_books(donor)
                for i in layers:
                    mixed["v"][i], mixed["v_transform"][i] = dbooks["v"][i], dbooks["v_transform"][i]
                    mvs[i] = dinfo.m_v_layers[i]
            if mvs == list(info.m_v_layers):
                continue  # the file's own V bits
            score(path, mixed, own_k, mvs, False, cal, None, pinned, digest,
                  v_from=[dict(file=os.path.abspath(donor), layers=layers,
                               codebook_sha256=codebook_meta(donor)["codebook_sha256"])
                          for donor, layers in donors])
    if a.allocate:
        allocate(a, stats, [read_books(path) for path in a.codebooks], score, d, dev)
    for bits in a.bits:
        bk, bv = (int(x) for x in bits.split("/"))
        mk, mv = bk * d // 8, bv * d // 8
        for cname in a.configs:
            method, pre = CONFIGS[cname]
            if cname == "default":  # what calibrate does at these bits
                method = calibrate.default_method(bv)
            elif isinstance(method, dict):
                method = replace(calibrate.default_method(bv), **method)
            method = replace(method, niter=a.niter)
            t1 = time.time()
            if pre:  # keys before RoPE, RoPE pairs side by side in a subspace
                pre_stats = [calibrate.LayerStats(k=[x[..., perm] for x in st.k_pre], v=st.v,
                                                  mass=st.mass, qa=st.qa, sink=None)
                             for st in stats]
                books = calibrate.train(pre_stats, mk, mv, method, 0, dev, progress=False)
            else:
                books = calibrate.train(stats, mk, mv, method, 0, dev, progress=False)
            books["rel_mse_k"] = sum(books["rel_mse_k"]) / len(books["rel_mse_k"])
            books["rel_mse_v"] = sum(books["rel_mse_v"]) / len(books["rel_mse_v"])
            score(cname, books, mk, mv, pre, asdict(method), round(time.time() - t1, 1),
                  stats[0].sink is not None)
    with open(a.out, "w") as f:  # also when only the bf16 rows were asked for
        json.dump(dict(stamp, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
