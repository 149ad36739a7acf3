"""Codebook files: K and V centroids per layer and KV head, in safetensors.

Tensors ``k_centroids`` float32 ``[layers, kv_heads, Mk, 256, head_dim/Mk]`` and
``v_centroids`` ``[layers, kv_heads, Mv, 256, head_dim/Mv]`` (K and V may differ in bits).
V's subspaces may also differ by layer (``calibrate --bits-v-layers``): metadata
``m_v_layers`` (JSON, one per layer) replaces ``m_v``, and ``v_centroids`` is
``[layers, kv_heads, 256 * head_dim]``, each layer's ``[Mv, 256, head_dim/Mv]`` flattened
(the same count at every Mv); K's likewise (``calibrate --bits-mean``: ``m_k_layers`` and a
flat ``k_centroids``);
optional ``k_transform`` / ``v_transform``: float32 ``[layers, kv_heads, head_dim, head_dim]``.
With a K transform T the codes are of ``k T`` (and the backend scores ``q T^-T``, so
q.k is unchanged); with a V transform the codes are of ``v T`` and the attention output is
mapped back by ``T^-1`` (see calibrate.py for why). Absent means identity.
Metadata (strings): ``format``, ``fingerprint`` (hash of the model's attention-relevant
config), ``fingerprint_fields`` (JSON, to say what differs), ``head_dim``, ``m_k``, ``m_v``,
``bits_k``, ``bits_v`` (per element), ``k_post_rope``, ``num_layers``, ``num_kv_heads``,
``model``, ``calibration`` (JSON). Formats 1 and 2 had one ``m`` for K and V; format 4
added ``m_v_layers``, format 5 ``m_k_layers``.

A file is checked before use, not trusted: the metadata must be complete and agree with
the tensors' shapes (read_info), and every centroid and map must be finite, every map
invertible (load_layer, load_transforms, as each layer is read).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from dataclasses import dataclass

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .config import default_codebook_path, layers_of_m, layers_words
from .layout import NAN_CODE, NUM_CENTROIDS, bits_of, supported_m

FORMAT = "vllm_pq_backend/codebooks/5"
# 1: no transforms; 1 and 2: one M for K and V; 1 to 3: one M for V in every layer; 1 to
# 4: one M for K in every layer
READABLE = tuple(f"vllm_pq_backend/codebooks/{n}" for n in (1, 2, 3, 4)) + (FORMAT,)
PARTS = ("k", "v")
TRANSFORMS = ("k_transform", "v_transform")
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")  # safetensors' names

# Named under vllm's logger, as vllm_pq_backend/__init__.py explains; plain logging, so
# that the calibration command does not import vLLM for it.
logger = logging.getLogger(f"vllm.{__name__}")


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


def base_m(m_layers) -> int:
    """The subspaces most layers have (the lower on a tie): the others are exceptions."""
    return max(sorted(set(m_layers)), key=list(m_layers).count)


def mean_bits(head_dim: int, m_layers) -> float:
    """Bits per element averaged over the layers."""
    return bits_of(head_dim, round(sum(m_layers) / len(m_layers), 6))


def describe_layers_m(head_dim: int, m_k_layers, m_v_layers) -> str:
    """describe_m, with the layers whose K or V differs from the others': 'K 4 / V 2 bits
    per element, V 4 in layers 18-23 (3.2 bits per element on average; Mk=32, Mv=16, 32
    in 18-23)'."""
    if len(set(m_k_layers)) == 1 and len(set(m_v_layers)) == 1:
        return describe_m(head_dim, m_k_layers[0], m_v_layers[0])
    parts = []  # (name, the width most layers have, the others' layers)
    for name, ms in (("K", m_k_layers), ("V", m_v_layers)):
        base = base_m(ms)
        parts.append((name, base, layers_of_m(ms, base)))
    mean = (mean_bits(head_dim, m_k_layers) + mean_bits(head_dim, m_v_layers)) / 2
    return (f"K {bits_of(head_dim, parts[0][1])} / V {bits_of(head_dim, parts[1][1])} bits "
            "per element, "
            + ", ".join(f"{name} {bits_of(head_dim, m)} in {layers_words(r)}"
                        for name, _, where in parts for m, r in where.items())
            + f" ({mean:.3g} bits per element on average; "
            + ", ".join(f"M{name.lower()}={base}" + "".join(f", {m} in {r}" for m, r in where.items())
                        for name, base, where in parts) + ")")


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


def _per_layer(t, layers: int, heads: int, d: int) -> tuple[torch.Tensor, list[int]]:
    """K's or V's centroids as the file holds them, and each layer's subspaces: ``t``
    ``[layers, heads, M, 256, d/M]``, or a list of each layer's ``[heads, M, 256, d/M]``
    (flattened to ``[layers, heads, 256 d]`` where the layers' M differ)."""
    if torch.is_tensor(t):
        t = list(t)
    assert len(t) == layers, len(t)
    ms = [x.shape[1] for x in t]
    for m, x in zip(ms, t):
        assert x.shape == (heads, m, NUM_CENTROIDS, d // m), x.shape
    out = torch.stack(t) if len(set(ms)) == 1 else torch.stack([x.reshape(heads, -1) for x in t])
    return out.float().contiguous(), ms


def save_codebooks(path: str, k, v, cfg, extra: dict,
                   k_transform: torch.Tensor | None = None,
                   v_transform: torch.Tensor | None = None) -> None:
    """``k``, ``v``: ``[layers, kv_heads, M, 256, head_dim/M]``, or a list of each layer's
    ``[kv_heads, M, 256, head_dim/M]`` where layers differ in M."""
    layers, heads = len(k), k[0].shape[0]
    d = k[0].shape[1] * k[0].shape[-1]
    tensors, widths = {}, {}
    for part, t in zip(PARTS, (k, v)):
        tensors[f"{part}_centroids"], widths[part] = _per_layer(t, layers, heads, d)
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
        **{(f"m_{part}_layers" if len(set(ms)) > 1 else f"m_{part}"):
           (json.dumps(ms) if len(set(ms)) > 1 else str(ms[0])) for part, ms in widths.items()},
        **{f"bits_{part}": str(mean_bits(d, ms)) for part, ms in widths.items()},
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
    m_k_layers: tuple[int, ...]  # K subspaces per head, of each layer
    m_v_layers: tuple[int, ...]  # V subspaces per head, of each layer
    head_dim: int
    num_layers: int
    num_kv_heads: int
    fingerprint: str
    fields: dict
    transforms: tuple[str, ...] = ()  # which of TRANSFORMS the file has

    @property
    def m_k(self) -> int | None:
        """K subspaces per head if every layer has the same, else None (m_k_layers)."""
        return self.m_k_layers[0] if len(set(self.m_k_layers)) == 1 else None

    @property
    def m_v(self) -> int | None:
        """V subspaces per head if every layer has the same, else None (m_v_layers)."""
        return self.m_v_layers[0] if len(set(self.m_v_layers)) == 1 else None

    @property
    def uniform(self) -> bool:
        """Whether every layer has the same K and V subspaces (and so pages)."""
        return self.m_k is not None and self.m_v is not None

    @property
    def pairs(self) -> list[tuple[int, int]]:
        """(Mk, Mv) of each layer."""
        return list(zip(self.m_k_layers, self.m_v_layers))

    @property
    def bits_k(self) -> float:
        """K's bits per element, averaged over the layers."""
        return mean_bits(self.head_dim, self.m_k_layers)

    @property
    def bits_v(self) -> float:
        """V's bits per element, averaged over the layers."""
        return mean_bits(self.head_dim, self.m_v_layers)

    def describe(self) -> str:
        return describe_layers_m(self.head_dim, self.m_k_layers, self.m_v_layers)


def read_info(path: str) -> CodebookInfo:
    """The file's header, checked against its tensors' shapes, read once per version of
    the file: the cache key holds its modification time and size, so a file recalibrated
    in place is read again."""
    if not os.path.isfile(path):
        raise CodebookError(f"PQ codebook file not found: {path}. " + calibrate_hint())
    st = os.stat(path)
    return _read_info(path, st.st_mtime_ns, st.st_size)


def _damaged(path: str, what: str) -> CodebookError:
    return CodebookError(f"PQ codebook file {path}: {what}; it is not as the calibration "
                         "wrote it (damaged or edited). " + calibrate_hint())


@functools.lru_cache(maxsize=16)
def _read_info(path: str, _mtime_ns: int, _size: int) -> CodebookInfo:
    try:
        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
            slices = {name: f.get_slice(name) for name in f.keys()}
            shapes = {name: s.get_shape() for name, s in slices.items()}
            dtypes = {name: s.get_dtype() for name, s in slices.items()}
    except Exception as e:  # a truncated or foreign file
        raise CodebookError(f"{path} is not a readable safetensors file ({e}).") from e
    if meta.get("format") not in READABLE or {"k_centroids", "v_centroids"} - set(shapes):
        raise CodebookError(
            f"{path} is not a vllm_pq_backend codebook file (format "
            f"{meta.get('format')!r}, expected {FORMAT!r}). " + calibrate_hint()
        )

    def number(key: str, old_key: str | None = None) -> int:
        if key not in meta and old_key in meta:  # formats 1 and 2
            key = old_key
        if key not in meta:
            raise _damaged(path, f"its metadata has no {key!r}")
        try:
            value = int(meta[key])
        except ValueError:
            raise _damaged(path, f"metadata {key}={meta[key]!r} is not an integer") from None
        if value <= 0:
            raise _damaged(path, f"metadata {key}={value} is not positive")
        return value

    d, layers, heads = number("head_dim"), number("num_layers"), number("num_kv_heads")

    def widths(part: str) -> list[int]:
        """Each layer's subspaces of K or V: m_<part>_layers, or m_<part> in every layer."""
        key = f"m_{part}_layers"
        if key not in meta:
            return [number(f"m_{part}", "m")] * layers
        try:
            ms = json.loads(meta[key])
        except json.JSONDecodeError:
            ms = None
        if (not isinstance(ms, list) or len(ms) != layers
                or not all(isinstance(m, int) and m > 0 for m in ms)):
            raise _damaged(path, f"metadata {key}={meta[key]!r} is not a list of "
                                 f"{layers} positive integers (one per layer)")
        return ms

    ms = {part: widths(part) for part in PARTS}
    mixed = {part: f"m_{part}_layers" in meta for part in PARTS}
    for key in ("fingerprint", "fingerprint_fields"):
        if key not in meta:
            raise _damaged(path, f"its metadata has no {key!r}")
    try:
        fields = json.loads(meta["fingerprint_fields"])
    except json.JSONDecodeError:
        fields = None
    if not isinstance(fields, dict):
        raise _damaged(path, "metadata fingerprint_fields is not a JSON object")
    for key, have in (("num_hidden_layers", layers), ("num_key_value_heads", heads),
                      ("head_dim", d)):
        if key in fields and fields[key] != have:
            raise _damaged(path, f"fingerprint_fields says {key}={fields[key]!r}, the "
                                 f"header {have}")
    for m in sorted(set(ms["k"] + ms["v"])):
        if d % m:
            raise _damaged(path, f"head_dim {d} is not a multiple of its {m} subspaces")
    want = {f"{part}_centroids": [layers, heads, NUM_CENTROIDS * d] if mixed[part] else
            [layers, heads, ms[part][0], NUM_CENTROIDS, d // ms[part][0]] for part in PARTS}
    want.update({name: [layers, heads, d, d] for name in TRANSFORMS if name in shapes})
    m_text = ", ".join(f"m_{part}_layers {ms[part]}" if mixed[part] else f"m_{part} {ms[part][0]}"
                       for part in PARTS)
    for name, shape in want.items():
        if shapes[name] != shape:
            raise _damaged(path, f"{name} has shape {shapes[name]}, its metadata (num_layers "
                                 f"{layers}, num_kv_heads {heads}, head_dim {d}, "
                                 f"{m_text}) says {shape}")
        if dtypes[name] not in FLOAT_DTYPES:
            raise _damaged(path, f"{name} is {dtypes[name]}, not floating point")
    sub0 = []  # subspace 0, where the marker is: a small read
    with safe_open(path, framework="pt") as f:
        for part in PARTS:
            t = f.get_slice(f"{part}_centroids")
            sub0 += ([t[i, :, : NUM_CENTROIDS * d // m].view(heads, 1, NUM_CENTROIDS, -1)
                      for i, m in enumerate(ms[part])] if mixed[part] else
                     [t[:, :, 0].unsqueeze(2)])
    if not all(nan_code_free(c) for c in sub0):
        logger.warning(
            "PQ codebooks %s: code %d of subspace 0 holds a trained centroid, which serving "
            "gives up to mark non-finite K/V (layout.NAN_CODE); vectors nearest to it, the "
            "BOS attention sink among them, are coded less exactly. %s",
            path, NAN_CODE, calibrate_hint())
    return CodebookInfo(
        path=path,
        m_k_layers=tuple(ms["k"]),
        m_v_layers=tuple(ms["v"]),
        head_dim=d,
        num_layers=layers,
        num_kv_heads=heads,
        fingerprint=meta["fingerprint"],
        fields=fields,
        transforms=tuple(t for t in TRANSFORMS if t in shapes),
    )


def validate(info: CodebookInfo, cfg, want_m: int | None, want_m_v: int | None,
             model: str | None) -> None:
    """One clear error naming every mismatch between the file and the model (or the
    kernels)."""
    fields = fingerprint_fields(cfg)
    problems = []
    for name, want, have in (("M", want_m, info.m_k), ("Mv", want_m_v, info.m_v)):
        if want is not None and want != have:
            problems.append(f"{name}: file has {have or f'one per layer, {info.describe()}'}, "
                            f"configuration asks for {want}")
    if info.head_dim != fields["head_dim"]:
        problems.append(f"head_dim: file {info.head_dim}, model {fields['head_dim']}")
    else:
        for m_k, m_v in sorted(set(info.pairs)):
            if (m_k, m_v) not in supported_m(info.head_dim):
                where = ("" if info.uniform else
                         f" ({layers_words(layers_of_m(info.pairs)[(m_k, m_v)])})")
                problems.append(f"the file's Mk={m_k}, Mv={m_v}{where} is not a supported "
                                f"setting (head_dim {info.head_dim}: "
                                f"{supported_m_text(info.head_dim)})")
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


def _layer_index(info: CodebookInfo, layer: int) -> None:
    if not 0 <= layer < info.num_layers:
        raise CodebookError(f"{info.path} has {info.num_layers} layers, asked for layer {layer}")


def _finite(info: CodebookInfo, layer: int, name: str, t: torch.Tensor) -> torch.Tensor:
    if not torch.isfinite(t).all():
        raise _damaged(info.path, f"layer {layer}'s {name} hold NaN or infinity")
    return t


def load_layer(info: CodebookInfo, layer: int, heads: slice) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 K and V centroids of one layer, ``[heads, Mk, 256, head_dim/Mk]`` and
    ``[heads, Mv, 256, head_dim/Mv]`` (this layer's Mk and Mv); a non-finite centroid is refused
    (CodebookError)."""
    _layer_index(info, layer)
    out = []
    with safe_open(info.path, framework="pt") as f:
        for part, m in zip(PARTS, (info.m_k_layers[layer], info.m_v_layers[layer])):
            t = f.get_slice(f"{part}_centroids")[layer, heads]
            t = t.reshape(t.shape[0], m, NUM_CENTROIDS, info.head_dim // m)
            out.append(_finite(info, layer, f"{part.upper()} centroids", t.float().contiguous()))
    return tuple(out)


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
    """float32 K and V transforms of one layer, ``[heads, d, d]`` each, or None (identity);
    a non-finite or singular map is refused (CodebookError)."""
    _layer_index(info, layer)
    out = []
    with safe_open(info.path, framework="pt") as f:
        for name in TRANSFORMS:
            if name not in info.transforms:
                out.append(None)
                continue
            t = _finite(info, layer, name, f.get_slice(name)[layer, heads].float().contiguous())
            if (torch.linalg.inv_ex(t.double()).info != 0).any():
                raise _damaged(info.path, f"layer {layer}'s {name} is singular (not invertible)")
            out.append(t)
    return tuple(out)


def calibration_of(info: CodebookInfo) -> dict:
    """The calibration settings a file records (its ``calibration`` metadata)."""
    with safe_open(info.path, framework="pt") as f:
        text = (f.metadata() or {}).get("calibration", "{}")
    try:
        out = json.loads(text)
    except json.JSONDecodeError:
        out = None
    if not isinstance(out, dict):
        raise _damaged(info.path, "metadata calibration is not a JSON object")
    return out
