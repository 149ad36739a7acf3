"""Finding the CUDA kernels: the extension built in place (``install.sh``, ``setup.py
build_ext --inplace``), else built just in time from ``csrc/`` with torch's extension
tooling and ninja on first use (cached per torch build and source hash), else a clear
error. The slow PyTorch reference path runs on a GPU only when asked for with
``VLLM_PQ_ALLOW_REFERENCE=1``; without a GPU it is the only path and needs no asking.

Code built just in time is loaded only from a directory no one else could have written
to (build_directory): the cache ``$XDG_CACHE_HOME/vllm_pq_backend/`` (default
``~/.cache/vllm_pq_backend/``) when this user owns it and everything in it, none of it is
writable by group or others, and the directory above cannot be used to replace it;
otherwise a fresh private directory, said in one log line.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import shutil
import stat
import tempfile
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


def _unsafe(path: Path, recursive: bool = True) -> str | None:
    """Why code under ``path`` could be someone else's, or None: it (and, if
    ``recursive``, everything in it) must be owned by this user, writable by no one else."""
    for p in [path, *(path.rglob("*") if recursive else ())]:
        st = p.stat()  # a link is judged by what it points to
        if st.st_uid != os.geteuid():
            return f"{p} belongs to uid {st.st_uid}"
        if st.st_mode & 0o022:
            return f"{p} is writable by others ({stat.filemode(st.st_mode)})"
    return None


def _replaceable(parent: Path) -> str | None:
    """Why an entry of ``parent`` could be renamed away and replaced by others, or None (a
    directory writable by others is safe only with the sticky bit, as /tmp)."""
    mode = parent.stat().st_mode
    if mode & 0o022 and not mode & stat.S_ISVTX:
        return f"{parent} is writable by others ({stat.filemode(mode)})"
    return None


def build_directory(tag: str) -> tuple[Path, bool]:
    """(directory, cached): where the kernels of build ``tag`` are built and loaded from.
    The cache's ``vllm_pq_backend/<tag>`` (made 0700 where missing) when it is safe (see
    the module docstring), else a new private directory, with one log line saying why."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    root = cache / "vllm_pq_backend"
    where = root / tag
    try:
        cache.mkdir(mode=0o700, parents=True, exist_ok=True)
        for d in (root, where):
            d.mkdir(mode=0o700, exist_ok=True)
        why = _replaceable(cache) or _unsafe(root, recursive=False) or _unsafe(where)
    except OSError as e:
        why = f"{e.filename}: {e.strerror}"
    if why is None:
        return where, True
    private = Path(tempfile.mkdtemp(prefix="vllm_pq_backend-"))
    logger.warning("vllm_pq_backend: not loading CUDA kernels from %s (%s); building them in "
                   "the private directory %s instead, at every start until %s and what is in "
                   "it are this user's alone (chown, chmod go-w) or XDG_CACHE_HOME names "
                   "another cache.", where, why, private, root)
    return private, False


def _seal(path: Path) -> None:
    """Take group and others' write permission off what a build left (a umask of 002
    leaves it), so that the cache passes build_directory's check next time."""
    for p in [path, *path.rglob("*")]:
        if not p.is_symlink():
            try:
                p.chmod(p.stat().st_mode & ~0o022)
            except OSError:  # then the next check refuses the cache: safe, only slower
                pass


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
    build_dir, cached = build_directory(tag)
    logger.info("vllm_pq_backend: building the CUDA kernels just in time in %s (first use "
                "with this torch and these sources: a few minutes%s)", build_dir,
                ", cached after" if cached else "")
    start = time.time()
    try:
        mod = load_extension(
            name="vllm_pq_backend_C",
            sources=ext.sources(str(build_dir / "units")),
            extra_include_paths=[str(CSRC), str(build_dir / "units")],
            extra_cflags=ext.CXX_FLAGS,
            extra_cuda_cflags=ext.NVCC_FLAGS,
            extra_ldflags=ext.link_args(),
            build_directory=str(build_dir),
        )
    finally:
        if cached:
            _seal(build_dir)
        else:  # loaded (or failed): a private build is not reused
            shutil.rmtree(build_dir, ignore_errors=True)
    logger.info("vllm_pq_backend: CUDA kernels ready in %.0f s (%s)", time.time() - start,
                mod.__file__)
    return mod.__file__
