"""What every recorded result under eval/results carries: the device, the versions, the
command as run and the date."""

import datetime
import importlib.metadata
import sys


def provenance(device: str | None = None) -> dict:
    """``device``: a description for runs off the GPU; default the CUDA device's name."""
    import torch

    return dict(
        device=device or torch.cuda.get_device_name(),
        vllm=importlib.metadata.version("vllm"), torch=torch.__version__,
        command="python " + " ".join(sys.argv),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    )
