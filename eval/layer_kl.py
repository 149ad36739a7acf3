"""Where a codebook file's error sits, by layer and by K or V: the KL divergence from the
exact model's next-token distribution to the model's with only that layer's keys (or
values) read through the file's codes, per scored position, on documents of text the file
never saw; beside it, every layer's K and V coded at once.

The model runs in float32 in transformers (so that the rounding of bf16 does not drown
parts that cost little) with accuracy_sim's simulated reads: codes by nearest centroid in
the trained metric where serving reads codes (outside the residual window; BOS pinned when
the file pins it), full precision elsewhere. Documents are made as eval/long_context.py
makes its fidelity documents.

    python eval/layer_kl.py --model eval/data/smollm2 --text eval/data/text/kernel.jsonl \\
        --docs 2 --length 2048 --codebooks eval/data/smollm2/pq/b4S.safetensors
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from accuracy_sim import Sim, file_layers  # noqa: E402
from common import codebook_meta, provenance, write_result  # noqa: E402
from long_context import Text, fidelity_docs  # noqa: E402


def read_layers(path: str, device) -> list[dict]:
    """A codebook file's layers as Sim reads them."""
    from vllm_pq_backend import codebooks

    info, layers = file_layers(path)
    pinned = bool(codebooks.calibration_of(info).get("pinned_bos_sink"))
    f = lambda x: None if x is None else x.to(device).float()  # noqa: E731
    return [dict(k=f(k), v=f(v), k_transform=f(tk), v_transform=f(tv), sink=pinned)
            for k, v, tk, tv in layers]


def log_probs(model, ids: list[int], device) -> torch.Tensor:
    """The model's next-token log-probabilities at every position of ``ids`` (float32)."""
    with torch.inference_mode():
        return model(torch.tensor([ids], device=device)).logits[0].float().log_softmax(-1)


def kl_sum(model, docs, ref) -> float:
    """Summed over the documents' positions: KL(exact ``ref`` || the model as it reads now)."""
    total = 0.0
    for d, p in zip(docs, ref):
        q = log_probs(model, d, p.device)
        total += float((p.exp() * (p - q)).sum())
    return total


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--codebooks", nargs="+", required=True)
    p.add_argument("--text", nargs="+", required=True, help="held-out text (.jsonl)")
    p.add_argument("--docs", type=int, default=2)
    p.add_argument("--length", type=int, default=2048, help="tokens per document")
    p.add_argument("--window", type=int, default=128, help="the serving window")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default="eval/results/layer_kl.json")
    a = p.parse_args(argv)

    from tqdm import tqdm
    from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).to(a.device).eval()
    if getattr(model.config.get_text_config(), "sliding_window", None):
        p.error(f"{a.model}: sliding-window layers; the simulated reads (accuracy_sim.Sim) "
                "attend causally over the whole sequence")
    sim = Sim()
    sim.window = a.window
    AttentionInterface.register(Sim.NAME, sim)
    model.config._attn_implementation = Sim.NAME
    docs = fidelity_docs(Text(tok, a.text), a.docs, a.length, a.seed)
    positions = sum(map(len, docs))
    ref = [log_probs(model, d, a.device) for d in docs]
    layers = model.config.get_text_config().num_hidden_layers
    types = getattr(model.config.get_text_config(), "layer_types", None)
    rows, metas = [], []
    for path in a.codebooks:
        meta = codebook_meta(path)
        metas.append(meta)
        sim.books = read_layers(path, a.device)
        sim.layers, sim.parts = None, "kv"
        whole = kl_sum(model, docs, ref) / positions
        rows.append(dict(codebook_sha256=meta["codebook_sha256"], layer=None, part="kv",
                         kl=round(whole, 8)))
        for i in tqdm(range(layers), desc=os.path.basename(path), unit="layer"):
            for part in "kv":
                sim.layers, sim.parts = {i}, part
                kl = kl_sum(model, docs, ref) / positions
                rows.append(dict(codebook_sha256=meta["codebook_sha256"], layer=i, part=part,
                                 attention=types[i] if types else "full_attention",
                                 kl=round(kl, 8)))
        by_part = {part: sum(r["kl"] for r in rows if r["codebook_sha256"] == meta["codebook_sha256"]
                             and r["part"] == part) for part in "kv"}
        print(f"{os.path.basename(path)}: KL {whole:.5f} per position with every layer coded; "
              f"summed over layers coded alone K {by_part['k']:.5f}, V {by_part['v']:.5f}")
    dev = torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu"
    write_result(a.out, dict(provenance(dev), model=a.model, text=[os.path.basename(t) for t in a.text],
                             docs=a.docs, length=a.length, window=a.window, seed=a.seed,
                             positions=positions, dtype="float32", codebooks=metas, rows=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
