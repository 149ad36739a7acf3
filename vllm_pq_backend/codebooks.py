"""Codebook files: K and V centroids per layer and KV head, in safetensors.

Tensors ``k_centroids`` and ``v_centroids``: float32 ``[layers, kv_heads, M, 256, head_dim/M]``.
Metadata (strings): ``format``, ``fingerprint`` (hash of the model's attention-relevant
config), ``fingerprint_fields`` (JSON, to say what differs), ``head_dim``, ``m``, ``bits``,
``k_post_rope``, ``num_layers``, ``num_kv_heads``, ``model``, ``calibration`` (JSON).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from dataclasses import dataclass

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .layout import NUM_CENTROIDS

FORMAT = "vllm_pq_backend/codebooks/1"


def _rope_theta(cfg) -> float | None:
    theta = getattr(cfg, "rope_theta", None)
    if theta is None:
        params = getattr(cfg, "rope_parameters", None) or {}
        theta = params.get("rope_theta") if isinstance(params, dict) else None
    return None if theta is None else float(theta)


def head_dim_of(cfg) -> int:
    hd = getattr(cfg, "head_dim", None)
    return int(hd) if hd else cfg.hidden_size // cfg.num_attention_heads


def fingerprint_fields(cfg) -> dict:
    """The parts of a (transformers) model config that decide what K/V look like."""
    return {
        "model_type": getattr(cfg, "model_type", None),
        "num_hidden_layers": cfg.num_hidden_layers,
        "hidden_size": cfg.hidden_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": getattr(cfg, "num_key_value_heads", None)
        or cfg.num_attention_heads,
        "head_dim": head_dim_of(cfg),
        "vocab_size": cfg.vocab_size,
        "rope_theta": _rope_theta(cfg),
    }


def fingerprint(fields: dict) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def calibrate_hint(model: str | None = None, m: int | None = None) -> str:
    return (
        "Make matching codebooks with `python -m vllm_pq_backend.calibrate "
        f"--model {model or 'MODEL_DIR'} --text CALIBRATION_TEXT"
        + (f" --m {m}" if m else "")
        + "` (see README)."
    )


class CodebookError(ValueError):
    pass


def save_codebooks(path: str, k: torch.Tensor, v: torch.Tensor, cfg, extra: dict) -> None:
    assert k.shape == v.shape and k.dim() == 5 and k.shape[3] == NUM_CENTROIDS
    layers, heads, m, _, ds = k.shape
    fields = fingerprint_fields(cfg)
    meta = {
        "format": FORMAT,
        "fingerprint": fingerprint(fields),
        "fingerprint_fields": json.dumps(fields, sort_keys=True),
        "head_dim": str(m * ds),
        "m": str(m),
        "bits": "8",
        "k_post_rope": "true",
        "num_layers": str(layers),
        "num_kv_heads": str(heads),
        "model": str(extra.pop("model", "")),
        "calibration": json.dumps(extra, sort_keys=True),
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    save_file(
        {"k_centroids": k.float().contiguous(), "v_centroids": v.float().contiguous()},
        path,
        metadata=meta,
    )


@dataclass(frozen=True)
class CodebookInfo:
    path: str
    m: int
    head_dim: int
    num_layers: int
    num_kv_heads: int
    fingerprint: str
    fields: dict


@functools.lru_cache(maxsize=16)
def read_info(path: str) -> CodebookInfo:
    if not os.path.isfile(path):
        raise CodebookError(f"PQ codebook file not found: {path}. " + calibrate_hint())
    try:
        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
            names = set(f.keys())
    except Exception as e:  # a truncated or foreign file
        raise CodebookError(f"{path} is not a readable safetensors file ({e}).") from e
    if meta.get("format") != FORMAT or {"k_centroids", "v_centroids"} - names:
        raise CodebookError(
            f"{path} is not a vllm_pq_backend codebook file (format "
            f"{meta.get('format')!r}, expected {FORMAT!r}). " + calibrate_hint()
        )
    return CodebookInfo(
        path=path,
        m=int(meta["m"]),
        head_dim=int(meta["head_dim"]),
        num_layers=int(meta["num_layers"]),
        num_kv_heads=int(meta["num_kv_heads"]),
        fingerprint=meta["fingerprint"],
        fields=json.loads(meta["fingerprint_fields"]),
    )


def validate(info: CodebookInfo, cfg, want_m: int | None, model: str | None) -> None:
    """One clear error naming every mismatch between the file and the model."""
    fields = fingerprint_fields(cfg)
    problems = []
    if want_m is not None and want_m != info.m:
        problems.append(f"M: file has {info.m}, configuration asks for {want_m}")
    if info.head_dim != fields["head_dim"]:
        problems.append(f"head_dim: file {info.head_dim}, model {fields['head_dim']}")
    if info.fingerprint != fingerprint(fields):
        diff = [
            f"{k}: file {info.fields.get(k)!r}, model {v!r}"
            for k, v in fields.items()
            if info.fields.get(k) != v
        ]
        problems.append("model config differs (" + "; ".join(diff or ["fingerprint"]) + ")")
    if problems:
        raise CodebookError(
            f"PQ codebooks {info.path} do not match this model: "
            + "; ".join(problems)
            + ". "
            + calibrate_hint(model, want_m)
        )


def load_layer(info: CodebookInfo, layer: int, heads: slice) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 K and V centroids of one layer, ``[heads, M, 256, head_dim/M]``."""
    if not 0 <= layer < info.num_layers:
        raise CodebookError(f"{info.path} has {info.num_layers} layers, asked for layer {layer}")
    with safe_open(info.path, framework="pt") as f:
        k = f.get_slice("k_centroids")[layer, heads]
        v = f.get_slice("v_centroids")[layer, heads]
    return k.float().contiguous(), v.float().contiguous()
