"""Codebook files: K and V centroids per layer and KV head, in safetensors.

Tensors ``k_centroids`` float32 ``[layers, kv_heads, Mk, 256, head_dim/Mk]`` and
``v_centroids`` ``[layers, kv_heads, Mv, 256, head_dim/Mv]`` (K and V may differ in bits);
optional ``k_transform`` / ``v_transform``: float32 ``[layers, kv_heads, head_dim, head_dim]``.
With a K transform T the codes are of ``k T`` (and the backend scores ``q T^-T``, so
q.k is unchanged); with a V transform the codes are of ``v T`` and the attention output is
mapped back by ``T^-1`` (see calibrate.py for why). Absent means identity.
Metadata (strings): ``format``, ``fingerprint`` (hash of the model's attention-relevant
config), ``fingerprint_fields`` (JSON, to say what differs), ``head_dim``, ``m_k``, ``m_v``,
``bits_k``, ``bits_v`` (per element), ``k_post_rope``, ``num_layers``, ``num_kv_heads``,
``model``, ``calibration`` (JSON). Formats 1 and 2 had one ``m`` for K and V.
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

from .config import default_codebook_path
from .layout import NAN_CODE, NUM_CENTROIDS, bits_of, supported_m

FORMAT = "vllm_pq_backend/codebooks/3"
# 1: no transforms; 1 and 2: one M for K and V
READABLE = ("vllm_pq_backend/codebooks/1", "vllm_pq_backend/codebooks/2", FORMAT)
TRANSFORMS = ("k_transform", "v_transform")


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


def describe_m(head_dim: int, m_k: int, m_v: int) -> str:
    """'K 4 / V 2 bits per element (Mk=32, Mv=16)', or '4 bits per element (M=32)'."""
    bk, bv = bits_of(head_dim, m_k), bits_of(head_dim, m_v)
    if m_k == m_v:
        return f"{bk} bits per element (M={m_k})"
    return f"K {bk} / V {bv} bits per element (Mk={m_k}, Mv={m_v})"


def supported_m_text(head_dim: int) -> str:
    return "; ".join(describe_m(head_dim, mk, mv) for mk, mv in supported_m(head_dim))


def codebook_path_hint(path: str, model: str, m_k: int, m_v: int, head_dim: int) -> str:
    """The command that serves the file just written."""
    if os.path.abspath(path) != os.path.abspath(default_codebook_path(model, m_k, m_v)):
        extra = f"\"codebooks\": \"{os.path.abspath(path)}\""
    elif m_k != m_v:
        extra = f"\"m\": {m_k}, \"m_v\": {m_v}"
    else:
        extra = "" if m_k == head_dim // 2 else f"\"m\": {m_k}"
    extra = f" --additional-config '{{\"pq\": {{{extra}}}}}'" if extra else ""
    return f"serve it: vllm serve {model} --attention-backend CUSTOM{extra}"


def calibrate_hint(model: str | None = None, m: int | None = None,
                   m_v: int | None = None) -> str:
    return (
        "Make matching codebooks with `python -m vllm_pq_backend.calibrate "
        f"--model {model or 'MODEL_DIR'} --text CALIBRATION_TEXT"
        + (f" --m {m}" if m else "")
        + (f" --m-v {m_v}" if m_v and m_v != m else "")
        + "` (see README)."
    )


class CodebookError(ValueError):
    pass


def save_codebooks(path: str, k: torch.Tensor, v: torch.Tensor, cfg, extra: dict,
                   k_transform: torch.Tensor | None = None,
                   v_transform: torch.Tensor | None = None) -> None:
    assert k.dim() == 5 and k.shape[3] == NUM_CENTROIDS, k.shape
    layers, heads, m_k, _, ds = k.shape
    d, m_v = m_k * ds, v.shape[2]
    assert v.shape == (layers, heads, m_v, NUM_CENTROIDS, d // m_v), v.shape
    tensors = {"k_centroids": k.float().contiguous(), "v_centroids": v.float().contiguous()}
    for name, t in zip(TRANSFORMS, (k_transform, v_transform)):
        if t is not None:
            assert t.shape == (layers, heads, d, d), (name, t.shape)
            tensors[name] = t.float().contiguous()
    fields = fingerprint_fields(cfg)
    meta = {
        "format": FORMAT,
        "fingerprint": fingerprint(fields),
        "fingerprint_fields": json.dumps(fields, sort_keys=True),
        "head_dim": str(d),
        "m_k": str(m_k),
        "m_v": str(m_v),
        "bits_k": str(bits_of(d, m_k)),
        "bits_v": str(bits_of(d, m_v)),
        "k_post_rope": "true",
        "num_layers": str(layers),
        "num_kv_heads": str(heads),
        "model": str(extra.pop("model", "")),
        "calibration": json.dumps(extra, sort_keys=True),
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    save_file(tensors, path, metadata=meta)


@dataclass(frozen=True)
class CodebookInfo:
    path: str
    m_k: int  # K subspaces per head
    m_v: int
    head_dim: int
    num_layers: int
    num_kv_heads: int
    fingerprint: str
    fields: dict
    transforms: tuple[str, ...] = ()  # which of TRANSFORMS the file has


def read_info(path: str) -> CodebookInfo:
    """The file's header, read once per version of the file: the cache key holds its
    modification time and size, so a file recalibrated in place is read again."""
    if not os.path.isfile(path):
        raise CodebookError(f"PQ codebook file not found: {path}. " + calibrate_hint())
    st = os.stat(path)
    return _read_info(path, st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=16)
def _read_info(path: str, _mtime_ns: int, _size: int) -> CodebookInfo:
    try:
        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
            names = set(f.keys())
    except Exception as e:  # a truncated or foreign file
        raise CodebookError(f"{path} is not a readable safetensors file ({e}).") from e
    if meta.get("format") not in READABLE or {"k_centroids", "v_centroids"} - names:
        raise CodebookError(
            f"{path} is not a vllm_pq_backend codebook file (format "
            f"{meta.get('format')!r}, expected {FORMAT!r}). " + calibrate_hint()
        )
    m_k, m_v = (int(meta[k] if k in meta else meta["m"]) for k in ("m_k", "m_v"))
    return CodebookInfo(
        path=path,
        m_k=m_k,
        m_v=m_v,
        head_dim=int(meta["head_dim"]),
        num_layers=int(meta["num_layers"]),
        num_kv_heads=int(meta["num_kv_heads"]),
        fingerprint=meta["fingerprint"],
        fields=json.loads(meta["fingerprint_fields"]),
        transforms=tuple(t for t in TRANSFORMS if t in names),
    )


def validate(info: CodebookInfo, cfg, want_m: int | None, want_m_v: int | None,
             model: str | None) -> None:
    """One clear error naming every mismatch between the file and the model (or the
    kernels)."""
    fields = fingerprint_fields(cfg)
    problems = []
    for name, want, have in (("M", want_m, info.m_k), ("Mv", want_m_v, info.m_v)):
        if want is not None and want != have:
            problems.append(f"{name}: file has {have}, configuration asks for {want}")
    if info.head_dim != fields["head_dim"]:
        problems.append(f"head_dim: file {info.head_dim}, model {fields['head_dim']}")
    elif (info.m_k, info.m_v) not in supported_m(info.head_dim):
        problems.append(f"the file's Mk={info.m_k}, Mv={info.m_v} is not a supported setting "
                        f"(head_dim {info.head_dim}: {supported_m_text(info.head_dim)})")
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
            + calibrate_hint(model, want_m, want_m_v)
        )


def load_layer(info: CodebookInfo, layer: int, heads: slice) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 K and V centroids of one layer, ``[heads, Mk, 256, head_dim/Mk]`` and
    ``[heads, Mv, 256, head_dim/Mv]``."""
    if not 0 <= layer < info.num_layers:
        raise CodebookError(f"{info.path} has {info.num_layers} layers, asked for layer {layer}")
    with safe_open(info.path, framework="pt") as f:
        k = f.get_slice("k_centroids")[layer, heads]
        v = f.get_slice("v_centroids")[layer, heads]
    return k.float().contiguous(), v.float().contiguous()


def nan_marked(centroids: torch.Tensor) -> torch.Tensor:
    """The centroids as served: ``layout.NAN_CODE`` of subspace 0 made NaN, the marker of
    non-finite K/V (layout.py). Calibration leaves that slot a copy of a lower code
    (reserve_nan_code), so the marker takes no centroid any finite vector would get."""
    out = centroids.clone()
    out[:, 0, NAN_CODE] = float("nan")
    return out


def reserve_nan_code(centroids: torch.Tensor) -> None:
    """Make the marker's slot (``NAN_CODE`` of subspace 0) of ``centroids [..., M, 256,
    ds]`` a copy of code 0, in place: never nearest, as ties go to the first index, so
    the file codes exactly as served even where nothing marks it."""
    centroids[..., 0, NAN_CODE, :] = centroids[..., 0, 0, :]


def nan_code_free(centroids: torch.Tensor) -> bool:
    """Whether the marker's slot of ``centroids [..., M, 256, ds]`` copies a lower code
    in every codebook: then nan_marked costs nothing."""
    sub0 = centroids[..., 0, :, :].float()
    same = (sub0[..., :NAN_CODE, :] == sub0[..., NAN_CODE : NAN_CODE + 1, :]).all(-1)
    return bool(same.any(-1).all())


def load_transforms(info: CodebookInfo, layer: int, heads: slice):
    """float32 K and V transforms of one layer, ``[heads, d, d]`` each, or None (identity)."""
    out = []
    with safe_open(info.path, framework="pt") as f:
        for name in TRANSFORMS:
            out.append(f.get_slice(name)[layer, heads].float().contiguous()
                       if name in info.transforms else None)
    return tuple(out)


def calibration_of(info: CodebookInfo) -> dict:
    """The calibration settings a file records (its ``calibration`` metadata)."""
    with safe_open(info.path, framework="pt") as f:
        return json.loads((f.metadata() or {}).get("calibration", "{}"))
