"""What every recorded result under eval/results carries: the device, the versions, the
git commit, the command as run and the date."""

import datetime
import importlib.metadata
import os
import subprocess
import sys


def git_commit() -> str:
    """HEAD of the checkout (``+dirty`` with uncommitted changes); where the tree travels
    without .git, the PQ_GIT_COMMIT the launcher exported."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=here, capture_output=True, text=True).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("PQ_GIT_COMMIT", "unknown")


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
