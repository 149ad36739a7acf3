"""What the user asks for: the codebook file, its subspaces per head and the window.

Precedence, highest first:
  1. ``--additional-config '{"pq": {"codebooks": PATH, "m": 32, "m_v": 16, "window": 128,
     "window_memory": 0.1, "exact": 2}}'``
     (``LLM(..., additional_config={"pq": {...}})``)
  2. environment: ``VLLM_PQ_CODEBOOKS``, ``VLLM_PQ_M``, ``VLLM_PQ_M_V``, ``VLLM_PQ_WINDOW``,
     ``VLLM_PQ_EXACT`` (handy for lm-eval, whose ``--model_args`` cannot carry a JSON dict)
  3. defaults: ``m = head_dim // 2`` (4 bits per element), ``m_v = m``, codebooks at
     ``<model dir>/pq/codebooks_m<M>[_v<Mv>].safetensors`` (where
     ``vllm_pq_backend.calibrate`` writes them), window = 128 tokens when the block size
     allows it, window_memory = 0.1 (the window store may take at most this share of
     the memory vLLM has for the KV cache; see EngineConfig.window_rows), exact =
     DEFAULT_EXACT keys and values per page and KV head kept exact by the exact store
     (layout.py; 0: none).
``m`` is the K subspaces per head (and V's unless ``m_v`` is given); the codebook file is
the authority, these only select the default file and are checked against it
(engine_config.EngineConfig resolves them once per engine).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .layout import BLOCK_ALIGN

DEFAULT_WINDOW = 128
DEFAULT_WINDOW_MEMORY = 0.1
DEFAULT_BLOCK_SIZE = 128
ENV_CODEBOOKS = "VLLM_PQ_CODEBOOKS"
ENV_M = "VLLM_PQ_M"
ENV_M_V = "VLLM_PQ_M_V"
ENV_WINDOW = "VLLM_PQ_WINDOW"
ENV_EXACT = "VLLM_PQ_EXACT"
DEFAULT_EXACT = 0
MAX_EXACT = 16
_KEYS = {"codebooks", "m", "m_v", "window", "window_memory", "exact"}


def parse_layers(text: str) -> list[int]:
    """Layer indices from ``18-23`` or ``0-11,18-23`` (sorted, once each); ValueError if
    that is not what it is."""
    ids = []
    for run in text.split(","):
        lo, dash, hi = run.partition("-")
        first, last = int(lo), int(hi if dash else lo)
        if first < 0 or last < first:
            raise ValueError(f"layers {run!r}: give FIRST-LAST with 0 <= FIRST <= LAST")
        ids += range(first, last + 1)
    return sorted(set(ids))


def layer_runs(ids) -> str:
    """``0-11,18-23`` for those layers: parse_layers' inverse."""
    ids, runs = sorted(ids), []
    for i in ids:
        if runs and runs[-1][1] == i - 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


def layers_of_m(m_layers, other_than=None) -> dict:
    """{M: its layers as layer_runs text} for each width in ``m_layers`` (one per layer)
    other than ``other_than``, the widest first."""
    return {m: layer_runs(i for i, x in enumerate(m_layers) if x == m)
            for m in sorted(set(m_layers) - {other_than}, reverse=True)}


def layers_words(runs: str) -> str:
    """'layer 4' or 'layers 2-3,7' (layer_runs' text)."""
    return ("layers " if any(c in runs for c in ",-") else "layer ") + runs


def default_codebook_path(model_dir: str, m_k: int, m_v: int | None = None,
                          m_v_layers=None, m_k_layers=None) -> str:
    """MODEL/pq/codebooks_m<Mk>[_v<Mv>][_k<Mk>l<layers>...][_v<Mv>l<layers>...].safetensors;
    the last parts name the layers whose K differs from ``m_k`` and whose V from ``m_v``
    (``m_k_layers``, ``m_v_layers``: each layer's)."""
    # In a subfolder: vLLM loads every top-level *.safetensors of a model as weights.
    name = f"m{m_k}" + ("" if m_v in (None, m_k) else f"_v{m_v}")
    for part, base, ms in (("k", m_k, m_k_layers), ("v", m_v or m_k, m_v_layers)):
        for m, runs in layers_of_m(ms or (), base).items():
            name += f"_{part}{m}l{runs}"
    return os.path.join(model_dir, "pq", f"codebooks_{name}.safetensors")


@dataclass(frozen=True)
class PQConfig:
    codebooks: str
    m_k: int | None  # K subspaces per head (the key "m"); None: the codebook file's
    m_v: int | None  # V subspaces per head; None: m_k when m_k is given, else the file's
    window: int | None  # None: the default for the block size
    window_memory: float = DEFAULT_WINDOW_MEMORY  # share of the KV memory (impl.window_rows)
    exact: int = DEFAULT_EXACT  # exact store entries per page and KV head (layout.py)

    @staticmethod
    def from_sources(additional_config: dict | None, model: str | None) -> PQConfig:
        user = dict((additional_config or {}).get("pq") or {})
        unknown = set(user) - _KEYS
        if unknown:
            raise ValueError(
                f"Unknown key(s) {sorted(unknown)} in additional_config['pq']; "
                f"accepted: {sorted(_KEYS)}."
            )

        def pick(key, env, conv):
            if user.get(key) is not None:
                return conv(user[key])
            if os.environ.get(env):
                return conv(os.environ[env])
            return None

        m = pick("m", ENV_M, int)
        m_v = pick("m_v", ENV_M_V, int)
        window = pick("window", ENV_WINDOW, int)
        exact = pick("exact", ENV_EXACT, int)
        exact = DEFAULT_EXACT if exact is None else exact
        path = pick("codebooks", ENV_CODEBOOKS, str)
        if path is None:
            if not model or not os.path.isdir(model):
                raise ValueError(
                    "vllm_pq_backend needs codebooks: the model is not a local folder, "
                    "so give the file explicitly with --additional-config "
                    "'{\"pq\": {\"codebooks\": \"/path/pq_codebooks.safetensors\"}}' or "
                    f"{ENV_CODEBOOKS}=/path. Make one with "
                    "`python -m vllm_pq_backend.calibrate --model DIR --text FILES`."
                )
            path = model  # resolved to the default file once head_dim is known
        for name, val in (("m", m), ("m_v", m_v)):
            if val is not None and val <= 0:
                raise ValueError(f"pq {name} must be positive, got {val}")
        if m_v is not None and m is None:
            raise ValueError("pq m_v needs m too (m: K subspaces per head, m_v: V's)")
        if window is not None and window < 0:
            raise ValueError(f"pq window must be >= 0, got {window}")
        if not 0 <= exact <= MAX_EXACT:
            raise ValueError(f"pq exact must be in 0..{MAX_EXACT} (keys and values kept exact "
                             f"per page and KV head), got {exact}")
        share = float(user.get("window_memory", DEFAULT_WINDOW_MEMORY))
        if not 0 < share <= 1:
            raise ValueError(f"pq window_memory must be in (0, 1], got {share}")
        return PQConfig(codebooks=path, m_k=m, m_v=m_v if m_v is not None else m,
                        window=window, window_memory=share, exact=exact)

    def codebook_file(self, head_dim: int) -> str:
        if os.path.isdir(self.codebooks):
            m_k = self.m_k or head_dim // 2
            return default_codebook_path(self.codebooks, m_k, self.m_v or m_k)
        return self.codebooks

    def resolve_window(self, block_size: int, sliding_window=None) -> int:
        """The window for this block size; W must divide B (see layout.py). The default
        also stays below the model's sliding window (``default_window``)."""
        if self.window is None:
            return default_window(block_size, sliding_window)
        w = self.window
        if w and (block_size % w or w % 16):
            raise ValueError(
                f"pq window {w} must be a multiple of 16 that divides the KV block size "
                f"{block_size} (so that prefix-cache hits never split a window); "
                f"pick e.g. window={block_size} or --block-size {max(w, BLOCK_ALIGN)}."
            )
        return w


def default_window(block_size: int, sliding_window=None) -> int:
    """DEFAULT_WINDOW where the block size allows it, else the block size; halved while it
    is not below the model's sliding window (the residual window must sit inside a sliding
    layer's window: gpt-oss, whose sliding layers read 128 keys, gets 64), 0 (no window)
    below 16 tokens. Halving a multiple of 32 that divides the block size keeps a multiple
    of 16 that divides it. ``sliding_window`` as a model config gives it: anything but a
    positive int is none."""
    w = DEFAULT_WINDOW if block_size % DEFAULT_WINDOW == 0 else block_size
    if not (isinstance(sliding_window, int) and sliding_window > 0):
        return w
    while w >= sliding_window:
        if w % 32:
            return 0
        w //= 2
    return w
