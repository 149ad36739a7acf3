"""Finding the CUDA kernels: the extension built in place (``install.sh``, ``setup.py
build_ext --inplace``), else built just in time from ``csrc/`` with torch's extension
tooling and ninja on first use (cached per torch build and source hash), else a clear
error. The slow PyTorch reference path runs on a GPU only when asked for with
``VLLM_PQ_ALLOW_REFERENCE=1``; without a GPU it is the only path and needs no asking."""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import time
from pathlib import Path

import torch
from vllm.logger import init_logger

logger = init_logger(f"vllm.{__name__}")  # under vLLM's handler, see __init__

ENV_ALLOW_REFERENCE = "VLLM_PQ_ALLOW_REFERENCE"
CSRC = Path(__file__).resolve().parent.parent / "csrc"


class KernelsUnavailable(RuntimeError):
    pass


@functools.cache
def load() -> str | None:
    """Where the kernels come from (a path), or None for the reference path (no GPU, or
    VLLM_PQ_ALLOW_REFERENCE=1). Registers ``torch.ops.pq_backend.*`` as a side effect."""
    try:
        from . import _C

        return _C.__file__
    except ImportError as e:
        missing = e
    if not torch.cuda.is_available():
        return None
    if os.environ.get(ENV_ALLOW_REFERENCE) == "1":
        logger.warning("vllm_pq_backend: CUDA kernels not built (%s); %s=1: running the slow "
                       "PyTorch reference path.", missing, ENV_ALLOW_REFERENCE)
        return None
    try:
        return _build()
    except Exception as e:  # noqa: BLE001  (any build failure gets the same advice)
        raise KernelsUnavailable(
            f"vllm_pq_backend: the CUDA kernels are not built ({missing}) and building them "
            f"now failed ({type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else e}). "
            "Fix: put the CUDA toolkit's nvcc on PATH (or set CUDA_HOME) and run `bash "
            "install.sh` in the source checkout; or set "
            f"{ENV_ALLOW_REFERENCE}=1 to run the slow PyTorch reference path."
        ) from e


def _build() -> str:
    from torch.utils.cpp_extension import load as load_extension

    if not (CSRC / "pq_binding.cpp").is_file():
        raise FileNotFoundError(f"no CUDA sources at {CSRC} (a source checkout has them)")
    spec = importlib.util.spec_from_file_location("pq_extension", CSRC / "extension.py")
    ext = importlib.util.module_from_spec(spec)  # by path: csrc is not a package
    spec.loader.exec_module(ext)
    digest = hashlib.sha256()
    for p in sorted(CSRC.glob("*")) + [Path(__file__).parent / "layout.py"]:
        if p.is_file():
            digest.update(p.name.encode() + p.read_bytes())
    tag = f"torch{torch.__version__}-cuda{torch.version.cuda}-{digest.hexdigest()[:12]}"
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    build_dir = cache / "vllm_pq_backend" / tag
    logger.info("vllm_pq_backend: building the CUDA kernels just in time in %s (first use "
                "with this torch and these sources: a few minutes, cached after)", build_dir)
    start = time.time()
    mod = load_extension(
        name="vllm_pq_backend_C",
        sources=ext.sources(str(build_dir / "units")),
        extra_include_paths=[str(CSRC), str(build_dir / "units")],
        extra_cflags=ext.CXX_FLAGS,
        extra_cuda_cflags=ext.NVCC_FLAGS,
        extra_ldflags=ext.link_args(),
        build_directory=str(build_dir),
    )
    logger.info("vllm_pq_backend: CUDA kernels ready in %.0f s (%s)", time.time() - start,
                mod.__file__)
    return mod.__file__
