"""One engine's PQ settings, resolved once from its vLLM config: the codebook file (checked
against the model), Mk and Mv, the window, and the window store's rows. The backend (page
size), the metadata builder and the impl all read this one object (``EngineConfig.of``).

What the user asked for comes from ``config.PQConfig``; the codebook file is the authority
on Mk and Mv and is checked against the model and the configuration here, once.
"""

from __future__ import annotations

import sys
import weakref

import torch
from vllm.logger import init_logger

from . import codebooks
from .config import PQConfig
from .layout import PageLayout

logger = init_logger(f"vllm.{__name__}")  # under vLLM's handler, see __init__

# fewer window store rows than this (where max_num_seqs allows them) get a warning: the
# scheduler then admits that few requests at a time
FEW_ROWS = 8

# VllmConfig is unhashable: entries are keyed by id() and dropped when their config is
# collected, so a new config never finds an old one's entry under a reused id.
_RESOLVED: dict[int, tuple[weakref.ref, EngineConfig]] = {}


class EngineConfig:
    """The PQ settings of the engine a ``VllmConfig`` describes (see module doc).

    vLLM settles the KV block size after it builds the model, and the scheduler's admission
    (``max_num_active_seqs``) when the model first runs: those are read from the engine's
    config when used, never copied at construction."""

    def __init__(self, vllm_config) -> None:
        mc = vllm_config.model_config
        self.user = PQConfig.from_sources(vllm_config.additional_config, mc.model)
        self.head_size = mc.get_head_size()
        self.codebooks = codebooks.read_info(self.user.codebook_file(self.head_size))
        codebooks.validate(self.codebooks, mc.hf_config, self.user.m_k, self.user.m_v, mc.model)
        self.m_k_layers = self.codebooks.m_k_layers  # K subspaces per head, of each layer
        self.m_v_layers = self.codebooks.m_v_layers  # V subspaces per head, of each layer
        self.exact = self.user.exact  # exact store entries per page and KV head
        self.max_model_len = mc.max_model_len
        self._cache = vllm_config.cache_config
        self._scheduler = vllm_config.scheduler_config
        self._parallel = vllm_config.parallel_config
        self._compilation = vllm_config.compilation_config
        self._windows: dict[int, int] = {}  # block size -> window
        self._sliding_window = mc.get_sliding_window()  # the default window's bound
        spec = vllm_config.speculative_config
        # tokens a verification step adds per request beyond the one it decodes (0: none)
        self.draft_tokens = int(getattr(spec, "num_speculative_tokens", 0) or 0)
        # the running requests' window store rows (metadata.WindowRows), one table for all
        # of this engine's metadata builders, made by the first
        self.window_table = None
        self._rows: int | None = None  # the window store's rows, once decided (window_rows)
        # CUDA memory this process held before this engine: earlier engines of the process
        # (vLLM does not free all of a dropped engine's) are not this engine's
        self._reserved_before = torch.cuda.memory_reserved() if torch.cuda.is_initialized() else 0

    @staticmethod
    def of(vllm_config) -> EngineConfig:
        """The engine's settings, resolved on the first call for this config object."""
        key = id(vllm_config)
        hit = _RESOLVED.get(key)
        if hit is not None and hit[0]() is vllm_config:
            return hit[1]
        resolved = EngineConfig(vllm_config)
        _RESOLVED[key] = (weakref.ref(vllm_config), resolved)
        weakref.finalize(vllm_config, _RESOLVED.pop, key, None)
        return resolved

    @staticmethod
    def of_caller() -> EngineConfig:
        """The settings of the engine whose code is calling (see ``vllm_config_of_caller``)."""
        return EngineConfig.of(vllm_config_of_caller())

    @property
    def block_size(self) -> int:
        return self._cache.block_size

    def layout(self, layer: int, block_size: int | None = None) -> PageLayout:
        """Layer ``layer``'s page layout at ``block_size`` (default: the engine's)."""
        return PageLayout(block_size or self.block_size, self.m_k_layers[layer],
                          self.m_v_layers[layer], self.head_size, self.exact)

    @property
    def has_sliding_layers(self) -> bool:
        return self._sliding_window is not None

    @property
    def m_k(self) -> int | None:
        """K subspaces per head if every layer has the same (else None: m_k_layers)."""
        return self.codebooks.m_k

    @property
    def m_v(self) -> int | None:
        """V subspaces per head if every layer has the same (else None: m_v_layers)."""
        return self.codebooks.m_v

    @property
    def window(self) -> int:
        """Tokens of the residual window at the engine's block size (layout.py), resolved
        once per block size; the first resolution warns if the codebooks were calibrated
        for another window."""
        b = self.block_size
        if b not in self._windows:
            w = self.user.resolve_window(b, self._sliding_window)
            if 0 < w <= self.draft_tokens:
                raise ValueError(
                    f"pq window {w} must exceed the {self.draft_tokens} speculative tokens "
                    f"of a verification step (so that one step spans at most two window "
                    f"segments); lower num_speculative_tokens or raise the window.")
            if self.exact and w != b:
                raise ValueError(
                    f"pq exact needs the window to be the block size (window {w}, block "
                    f"{b}): a query then reads exact entries only of pages wholly before its "
                    f"window, whose entries no later token changes, so that results do not "
                    f"depend on chunking; serve with window {b} (or --block-size {w} if "
                    f"{w} >= 32), or exact 0.")
            self._check_calibration_window(w)
            self._windows[b] = w
        return self._windows[b]

    @property
    def window_halves(self) -> int:
        """Window store rows per running request (layout.window_row): 2 under speculative
        decoding, whose verification steps may cross into the next window segment and
        then fall back before it when drafts are rejected; else 1."""
        return 2 if self.draft_tokens else 1

    def _check_calibration_window(self, window: int) -> None:
        """Calibration keeps statistics of the keys a query reads through codes, which the
        window decides: codebooks calibrated for another window serve, but fit less well."""
        calibrated = codebooks.calibration_of(self.codebooks).get("window")
        if calibrated is None or int(calibrated) == window:
            return
        logger.warning(
            "vllm_pq_backend: serving with window %d, but the codebooks %s were calibrated "
            "for window %d; recalibrate with `python -m vllm_pq_backend.calibrate ... "
            "--window %d`, or serve with --additional-config '{\"pq\": {\"window\": %d}}'.",
            window, self.codebooks.path, int(calibrated), window, int(calibrated))

    @property
    def window_memory(self) -> float:
        return self.user.window_memory

    @property
    def max_decode_rows(self) -> int:
        """Most rows one decode step can pass the kernel: max_num_seqs, or a larger CUDA
        graph capture size (graphs pad a batch up to one)."""
        sizes = self._compilation.cudagraph_capture_sizes or []
        return max([self._scheduler.max_num_seqs, *sizes])

    def window_store_shape(self, num_kv_heads: int, dtype: torch.dtype,
                           device) -> tuple[int, int, int, int]:
        """One layer's window store of K (and of V): ``window_halves`` rows
        (layout.window_row) for each running request (``window_rows``) and for the
        scratch row."""
        rows = self.window_rows(num_kv_heads, dtype, device) + 1
        return (rows * self.window_halves, num_kv_heads, self.window, self.head_size)

    def window_bytes_per_seq(self, num_kv_heads: int, dtype: torch.dtype) -> int:
        """Window store bytes of one running sequence, all layers."""
        esz = torch.tensor([], dtype=dtype).element_size()
        return (2 * self.window_halves * num_kv_heads * self.window * self.head_size * esz
                * self.codebooks.num_layers)

    def window_rows(self, num_kv_heads: int, dtype: torch.dtype, device) -> int:
        """Running sequences the window store has rows for: vLLM's admission limit (the
        scheduler's ``max_num_active_seqs``, else ``max_num_seqs``), lowered on first use
        so that the store takes at most ``window_memory`` of the memory vLLM will give the
        KV cache, and then written back as ``max_num_active_seqs`` so that the scheduler,
        which this engine builds after the model, admits no more (metadata.WindowRows gives
        each running request one of these). The user's ``--max-num-active-seqs`` wins.
        Where the worker is not in the scheduler's process (several workers, or data
        parallelism's one worker under the "mp" executor) nothing is lowered. Rows asked for
        (the user's, or max_num_seqs where nothing is lowered) whose store would not fit in
        that memory are refused with the numbers and the fixes, before allocating. Fewer
        than ``FEW_ROWS`` rows (when max_num_seqs allows more) is said in a warning
        with the numbers and the fix."""
        sched = self._scheduler
        asked = sched.max_num_active_seqs
        if asked is not None and asked == self._rows:  # settled by this engine's first layer
            return asked
        cap = sched.max_num_seqs
        # the scheduler reads the lowered rows only where the worker is its own process
        # (the "uni" executor); data parallelism runs each engine's worker apart ("mp")
        lower = (asked is None and self._parallel.world_size == 1
                 and self._parallel.distributed_executor_backend in (None, "uni"))
        if torch.device(device).type != "cuda":
            return cap if asked is None else asked
        budget, source = self._kv_cache_budget(device)
        per_seq = self.window_bytes_per_seq(num_kv_heads, dtype)
        if not lower:
            rows = cap if asked is None else asked
            if rows * per_seq > budget:
                raise ValueError(self._no_fit_message(rows, per_seq, budget, source))
            self._rows = rows
            return rows
        rows = max(1, min(cap, int(self.window_memory * max(budget, 0)) // per_seq))
        if rows < min(cap, FEW_ROWS):
            logger.warning(
                "vllm_pq_backend: the window store fits only %d running requests (of "
                "max_num_seqs=%d): window_memory %g of the KV cache's %.2f GiB (%s) at "
                "%.1f MiB per request. vLLM will admit %d at a time. Set "
                "--max-num-active-seqs N (the store then takes N x %.1f MiB), raise "
                "window_memory in --additional-config '{\"pq\": {...}}', or give vLLM more "
                "memory (--gpu-memory-utilization).",
                rows, cap, self.window_memory, budget / 2**30, source, per_seq / 2**20, rows,
                per_seq / 2**20)
        sched.max_num_active_seqs = self._rows = rows
        return rows

    def _kv_cache_budget(self, device) -> tuple[float, str]:
        """Bytes vLLM will give the KV cache on ``device``, and how that was found."""
        if self._cache.kv_cache_memory_bytes:  # the user sized the KV cache: no profile
            budget = self._cache.kv_cache_memory_bytes
            return budget, f"--kv-cache-memory-bytes {budget}"
        # vLLM gives the KV cache gpu_memory_utilization x the GPU's memory less what this
        # engine holds (gpu_worker.determine_available_memory); other processes' memory
        # was checked against that share at start-up and is not subtracted again. The
        # profile's activation peak is still to come: this overestimates.
        _, total = torch.cuda.mem_get_info(device)
        held = max(0, torch.cuda.memory_reserved(device) - self._reserved_before)
        util = self._cache.gpu_memory_utilization
        return util * total - held, (f"gpu_memory_utilization {util:g} x {total / 2**30:.1f} "
                                     f"GiB less the {held / 2**30:.1f} GiB this engine holds")

    def _no_fit_message(self, asked: int, per_seq: int, budget: float, source: str) -> str:
        share = int(self.window_memory * max(budget, 0)) // per_seq  # as lowering picks
        what = ("--max-num-active-seqs" if self._scheduler.max_num_active_seqs is not None
                else f"max_num_seqs, with the scheduler apart from the worker "
                     f"({self._parallel.distributed_executor_backend} executor)")
        fix = (f"Set --max-num-active-seqs {share} (the store then takes window_memory "
               f"{self.window_memory:g} of it), a smaller" if share else "Set a smaller")
        return (f"vllm_pq_backend: the window store cannot fit: {asked} rows ({what}) x "
                f"{per_seq / 2**20:.2f} MiB per row (window {self.window}) = "
                f"{asked * per_seq / 2**30:.2f} GiB, but vLLM has {budget / 2**30:.2f} GiB "
                f"for the KV cache ({source}). {fix} window in --additional-config "
                f"'{{\"pq\": {{\"window\": ...}}}}', or raise --gpu-memory-utilization.")

    @property
    def max_num_seqs(self) -> int:
        return self._scheduler.max_num_seqs

    @property
    def scratch_row(self) -> int:
        """The window store's last row, where CUDA-graph padding requests and dummy runs
        write, never touching a live request's rows: one past the rows of the running
        requests (``window_rows``), read when asked (the first layer settles them)."""
        return self._scheduler.max_num_active_seqs or self._scheduler.max_num_seqs


def vllm_config_of_caller():
    """The vLLM config of the engine whose code is calling.

    vLLM makes it current while it builds the layers, but asks the backend for the page
    size (``customize_spec``, from the model runner's ``get_kv_cache_spec``) outside that
    context, with no handle on the engine. There it is the caller's: a ``vllm_config``
    argument or the model runner's ``self.vllm_config`` in a frame up the stack. Read from
    the stack rather than remembered from an earlier call, so that two engines in one
    process never see each other's configuration."""
    from vllm.config import VllmConfig, get_current_vllm_config_or_none

    vc = get_current_vllm_config_or_none()
    for loc in callers_locals() if vc is None else ():
        found = [c for c in (loc.get("vllm_config"), getattr(loc.get("self"), "vllm_config", None))
                 if isinstance(c, VllmConfig)]
        if found:
            vc = found[0]
            break
    if vc is None:
        raise RuntimeError(
            "vllm_pq_backend: no vLLM config is current and no caller holds one; the "
            "backend's page size depends on the engine's codebooks"
        )
    return vc


def layer_of_caller() -> int | None:
    """The index of the attention layer whose page size vLLM is asking for, or None.

    ``customize_spec`` gets a spec without the layer it is for; its callers hold the layer:
    the model runners' ``get_kv_cache_spec`` loops over ``layer_name``, and a layer's own
    ``get_kv_cache_spec`` (sliding-window layers) is a method of the layer. Needed only
    where the codebooks give layers different bits."""
    from vllm.model_executor.models.utils import extract_layer_index

    for loc in callers_locals():
        name = loc.get("layer_name", getattr(loc.get("self"), "layer_name", None))
        if isinstance(name, str):
            return extract_layer_index(name)
    return None


def callers_locals():
    """The local variables of the frames above the caller, innermost first. vLLM hands a
    backend no handle on its engine or layer at two calls (the page size,
    ``vllm_config_of_caller`` and ``layer_of_caller``; the metadata builder's construction,
    ``metadata.runner_requests``); the engine's own frames up the stack hold what they need.
    The one place the package reads the stack."""
    frame = sys._getframe(2)  # 0: this generator, 1: its consumer, 2: the consumer's caller
    while frame is not None:
        yield frame.f_locals
        frame = frame.f_back
