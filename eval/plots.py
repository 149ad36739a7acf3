"""The speed plots the README shows, drawn from the recorded results (CUSTOM labelled by
bits per element: 8 M / head_dim).

    python eval/plots.py     # eval/results/e2e_throughput.png, decode_kernel.png
"""

from __future__ import annotations

import json
import re
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def bits_label(name: str, head_dim: int) -> str:
    """'CUSTOM M=32' -> 'CUSTOM 2 bits (M=32)' for this head_dim; other names unchanged."""
    m = re.fullmatch(r"CUSTOM M=(\d+)", name)
    return f"CUSTOM {8 * int(m.group(1)) // head_dim} bits (M={m.group(1)})" if m else name


def _bits(row: dict, head_dim: int) -> str:
    """A kernel row's setting, bits per element ('4', '2', K/V '4/2'); older rows name M."""
    return row["bits"] if "bits" in row else str(8 * row["M"] // head_dim)


def e2e(path="eval/results/e2e_throughput.json", out="eval/results/e2e_throughput.png", head_dim=128):
    rows = json.load(open(path))["rows"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for name in dict.fromkeys(r["backend"] for r in rows):
        rs = sorted((r for r in rows if r["backend"] == name), key=lambda r: r["context"])
        label = bits_label(name, head_dim)
        a.plot([r["context"] for r in rs], [r["decode_tok_s"] for r in rs], marker="o", label=label)
        b.bar(label, rs[0]["kv_capacity_tokens"] / 1e6)
    a.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="decode tokens/s",
          title="LLM.generate decode, Llama-3-8B shape, H200")
    a.legend(fontsize=8)
    b.set(ylabel="KV cache capacity (million tokens)", title="capacity at gpu_memory_utilization=0.9")
    b.tick_params(axis="x", labelrotation=20, labelsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    return out


def kernel(path="eval/results/decode_kernel.json", out="eval/results/decode_kernel.png"):
    d = json.load(open(path))
    head_dim = d["shapes"]["head_dim"]
    rows = d["rows"]
    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(4 * len(batches), 3.6), squeeze=False)
    for ax, batch in zip(axes[0], batches):
        for bits in dict.fromkeys(_bits(r, head_dim) for r in rows):
            rs = sorted((r for r in rows if r["batch"] == batch and _bits(r, head_dim) == bits),
                        key=lambda r: r["context"])
            label = f"CUSTOM {bits} bits" if "/" not in bits else "CUSTOM K{} / V{} bits".format(*bits.split("/"))
            ax.plot([r["context"] for r in rs], [r["speedup_vs_fa3"] for r in rs], marker="o",
                    label=label)
        ax.axhline(1, color="gray", lw=0.8, label="FA3 bf16")
        ax.set(xscale="log", xlabel="context (tokens)", ylabel="speed vs FA3 (x)", title=f"batch {batch}")
        ax.legend(fontsize=7)
    fig.suptitle("decode attention kernel, Llama-3-8B shape, H200")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    return out


if __name__ == "__main__":
    print(e2e(), kernel())
    sys.exit(0)
