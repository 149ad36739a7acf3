"""Codebook files: K and V centroids per layer and KV head, in safetensors.

Tensors ``k_centroids`` float32 ``[layers, kv_heads, Mk, 256, head_dim/Mk]`` and
``v_centroids`` ``[layers, kv_heads, Mv, 256, head_dim/Mv]`` (K and V may differ in bits).
V's subspaces may also differ by layer (``calibrate --bits-v-layers``): metadata
``m_v_layers`` (JSON, one per layer) replaces ``m_v``, and ``v_centroids`` is
``[layers, kv_heads, 256 * head_dim]``, each layer's ``[Mv, 256, head_dim/Mv]`` flattened
(the same count at every Mv);
optional ``k_transform`` / ``v_transform``: float32 ``[layers, kv_heads, head_dim, head_dim]``.
With a K transform T the codes are of ``k T`` (and the backend scores ``q T^-T``, so
q.k is unchanged); with a V transform the codes are of ``v T`` and the attention output is
mapped back by ``T^-1`` (see calibrate.py for why). Absent means identity.
Metadata (strings): ``format``, ``fingerprint`` (hash of the model's attention-relevant
config), ``fingerprint_fields`` (JSON, to say what differs), ``head_dim``, ``m_k``, ``m_v``,
``bits_k``, ``bits_v`` (per element), ``k_post_rope``, ``num_layers``, ``num_kv_heads``,
``model``, ``calibration`` (JSON). Formats 1 and 2 had one ``m`` for K and V; format 4
added ``m_v_layers``.

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

FORMAT = "vllm_pq_backend/codebooks/4"
# 1: no transforms; 1 and 2: one M for K and V; 1 to 3: one M for V in every layer
READABLE = tuple(f"vllm_pq_backend/codebooks/{n}" for n in (1, 2, 3)) + (FORMAT,)
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


def base_m_v(m_v_layers) -> int:
    """The V subspaces most layers have (the lower on a tie): the others are exceptions."""
    return max(sorted(set(m_v_layers)), key=list(m_v_layers).count)


def mean_bits(head_dim: int, m_v_layers) -> float:
    """V's bits per element averaged over the layers."""
    return bits_of(head_dim, round(sum(m_v_layers) / len(m_v_layers), 6))


def describe_layers_m(head_dim: int, m_k: int, m_v_layers) -> str:
    """describe_m, with the layers whose V differs: 'K 4 / V 2 bits per element, V 4 in
    layers 18-23 (3.2 bits per element on average; Mk=32, Mv=16, 32 in 18-23)'."""
    if len(set(m_v_layers)) == 1:
        return describe_m(head_dim, m_k, m_v_layers[0])
    base = base_m_v(m_v_layers)
    where = layers_of_m(m_v_layers, base)
    mean = (bits_of(head_dim, m_k) + mean_bits(head_dim, m_v_layers)) / 2
    return (f"K {bits_of(head_dim, m_k)} / V {bits_of(head_dim, base)} bits per element, "
            + ", ".join(f"V {bits_of(head_dim, m)} in {layers_words(r)}" for m, r in where.items())
            + f" ({mean:.3g} bits per element on average; Mk={m_k}, Mv={base}, "
            + ", ".join(f"{m} in {r}" for m, r in where.items()) + ")")


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


def save_codebooks(path: str, k: torch.Tensor, v, cfg, extra: dict,
                   k_transform: torch.Tensor | None = None,
                   v_transform: torch.Tensor | None = None) -> None:
    """``v``: ``[layers, kv_heads, Mv, 256, head_dim/Mv]``, or a list of each layer's
    ``[kv_heads, Mv, 256, head_dim/Mv]`` where layers differ in Mv."""
    assert k.dim() == 5 and k.shape[3] == NUM_CENTROIDS, k.shape
    layers, heads, m_k, _, ds = k.shape
    d = m_k * ds
    if not torch.is_tensor(v):
        assert len(v) == layers, len(v)
        v = torch.stack(v) if len({t.shape for t in v}) == 1 else v
    m_v_layers = ([t.shape[1] for t in v] if isinstance(v, list) else [v.shape[2]] * layers)
    for m_v, t in zip(m_v_layers, v):
        assert t.shape == (heads, m_v, NUM_CENTROIDS, d // m_v), t.shape
    mixed = isinstance(v, list)
    v = torch.stack([t.reshape(heads, -1) for t in v]) if mixed else v
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
        **({"m_v_layers": json.dumps(m_v_layers)} if mixed else {"m_v": str(m_v_layers[0])}),
        "bits_k": str(bits_of(d, m_k)),
        "bits_v": str(mean_bits(d, m_v_layers)),
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
    m_v_layers: tuple[int, ...]  # V subspaces per head, of each layer
    head_dim: int
    num_layers: int
    num_kv_heads: int
    fingerprint: str
    fields: dict
    transforms: tuple[str, ...] = ()  # which of TRANSFORMS the file has

    @property
    def m_v(self) -> int | None:
        """V subspaces per head if every layer has the same, else None (m_v_layers)."""
        return self.m_v_layers[0] if len(set(self.m_v_layers)) == 1 else None

    @property
    def bits_v(self) -> float:
        """V's bits per element, averaged over the layers."""
        return mean_bits(self.head_dim, self.m_v_layers)

    def describe(self) -> str:
        return describe_layers_m(self.head_dim, self.m_k, self.m_v_layers)


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

    m_k = number("m_k", "m")
    d, layers, heads = number("head_dim"), number("num_layers"), number("num_kv_heads")
    mixed = "m_v_layers" in meta
    if mixed:
        try:
            m_v_layers = json.loads(meta["m_v_layers"])
        except json.JSONDecodeError:
            m_v_layers = None
        if (not isinstance(m_v_layers, list) or len(m_v_layers) != layers
                or not all(isinstance(m, int) and m > 0 for m in m_v_layers)):
            raise _damaged(path, f"metadata m_v_layers={meta['m_v_layers']!r} is not a list of "
                                 f"{layers} positive integers (one per layer)")
    else:
        m_v_layers = [number("m_v", "m")] * layers
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
    for m in (m_k, *sorted(set(m_v_layers))):
        if d % m:
            raise _damaged(path, f"head_dim {d} is not a multiple of its {m} subspaces")
    want = {"k_centroids": [layers, heads, m_k, NUM_CENTROIDS, d // m_k],
            "v_centroids": [layers, heads, NUM_CENTROIDS * d] if mixed else
            [layers, heads, m_v_layers[0], NUM_CENTROIDS, d // m_v_layers[0]]}
    want.update({name: [layers, heads, d, d] for name in TRANSFORMS if name in shapes})
    m_v_text = f"m_v_layers {m_v_layers}" if mixed else f"m_v {m_v_layers[0]}"
    for name, shape in want.items():
        if shapes[name] != shape:
            raise _damaged(path, f"{name} has shape {shapes[name]}, its metadata (num_layers "
                                 f"{layers}, num_kv_heads {heads}, head_dim {d}, m_k {m_k}, "
                                 f"{m_v_text}) says {shape}")
        if dtypes[name] not in FLOAT_DTYPES:
            raise _damaged(path, f"{name} is {dtypes[name]}, not floating point")
    with safe_open(path, framework="pt") as f:  # subspace 0, where the marker is: a small read
        sub0 = [f.get_slice("k_centroids")[:, :, 0].unsqueeze(2)]
        v_sub = f.get_slice("v_centroids")
        sub0 += ([v_sub[i, :, : NUM_CENTROIDS * d // m].view(heads, 1, NUM_CENTROIDS, -1)
                  for i, m in enumerate(m_v_layers)] if mixed else [v_sub[:, :, 0].unsqueeze(2)])
    if not all(nan_code_free(c) for c in sub0):
        logger.warning(
            "PQ codebooks %s: code %d of subspace 0 holds a trained centroid, which serving "
            "gives up to mark non-finite K/V (layout.NAN_CODE); vectors nearest to it, the "
            "BOS attention sink among them, are coded less exactly. %s",
            path, NAN_CODE, calibrate_hint())
    return CodebookInfo(
        path=path,
        m_k=m_k,
        m_v_layers=tuple(m_v_layers),
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
    for name, want, have in (("M", want_m, info.m_k),
                             ("Mv", want_m_v, info.m_v or f"one per layer, {info.describe()}")):
        if want is not None and want != have:
            problems.append(f"{name}: file has {have}, configuration asks for {want}")
    if info.head_dim != fields["head_dim"]:
        problems.append(f"head_dim: file {info.head_dim}, model {fields['head_dim']}")
    else:
        for m_v in sorted(set(info.m_v_layers)):
            if (info.m_k, m_v) not in supported_m(info.head_dim):
                where = ("" if info.m_v else
                         f" ({layers_words(layers_of_m(info.m_v_layers)[m_v])})")
                problems.append(f"the file's Mk={info.m_k}, Mv={m_v}{where} is not a supported "
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
    ``[heads, Mv, 256, head_dim/Mv]`` (this layer's Mv); a non-finite centroid is refused
    (CodebookError)."""
    _layer_index(info, layer)
    with safe_open(info.path, framework="pt") as f:
        k = f.get_slice("k_centroids")[layer, heads]
        v = f.get_slice("v_centroids")[layer, heads]
    m_v = info.m_v_layers[layer]
    v = v.reshape(v.shape[0], m_v, NUM_CENTROIDS, info.head_dim // m_v)
    return (_finite(info, layer, "K centroids", k.float().contiguous()),
            _finite(info, layer, "V centroids", v.float().contiguous()))


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
