"""What every recorded result under eval/results carries: the device, the versions, the
git commit, the command as run and the date."""

import datetime
import hashlib
import importlib.metadata
import json
import os
import subprocess
import sys


def git_commit() -> str:
    """PQ_GIT_COMMIT when the launcher exported it (a copied tree may carry a .git that is
    not the one the code came from); else HEAD of the checkout, ``+dirty`` with
    uncommitted changes."""
    if os.environ.get("PQ_GIT_COMMIT"):
        return os.environ["PQ_GIT_COMMIT"]
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=here, capture_output=True, text=True).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def provenance(device: str | None = None) -> dict:
    """``device``: a description for runs off the GPU; default the CUDA device's name."""
    import torch

    return dict(
        device=device or torch.cuda.get_device_name(),
        vllm=_version("vllm"), torch=torch.__version__, transformers=_version("transformers"),
        git_commit=git_commit(),
        command="python " + " ".join(sys.argv),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    )


def write_result(path: str, result: dict) -> None:
    """A run's JSON (its rows stamped with provenance()) into ``path``, and say so."""
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")


def codebook_meta(path):
    """bits, M, method and hash of a codebook file, for the rows it produces."""
    from vllm_pq_backend import codebooks
    from vllm_pq_backend.layout import bits_of

    info = codebooks.read_info(path)
    cal = codebooks.calibration_of(info)
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:16]
    return dict(m_k=info.m_k, m_v=info.m_v, bits_k=bits_of(info.head_dim, info.m_k),
                bits_v=bits_of(info.head_dim, info.m_v), codebook_sha256=digest,
                codebook_file=os.path.abspath(path),
                method="plain" if not info.transforms and not cal.get("method") else
                json.dumps(cal.get("method"), sort_keys=True),
                calib_text=cal.get("texts"), calib_tokens=cal.get("tokens"),
                calib_seq_len=cal.get("seq_len"))
