#!/usr/bin/env bash
# Set-up in one command, inside the Python environment you want it in (a venv, conda env):
#     bash install.sh
# Installs the package with its pinned dependencies and test tools. Then, where torch is
# a CPU-only build, removes the CUDA builds of torchvision/torchaudio/torchcodec that vLLM
# pulls in (next to CPU torch they break `import transformers`; text models do not use
# them); where torch is a CUDA build, a GPU is visible (or TORCH_CUDA_ARCH_LIST names one)
# and nvcc is on PATH, builds the CUDA kernels in place.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
# a fresh venv may lack setuptools (3.12) or wheel (3.11): the editable install needs both
# (installed only where missing: vLLM pins setuptools below the newest)
$PY -m pip install -q "setuptools>=64" wheel
if $PY - <<'EOF' 2>/dev/null; then
import importlib.metadata as m, sys
sys.exit(not (m.version("vllm") == "0.32.0" and m.version("torch").split("+")[0] == "2.13.0"))
EOF
  # vLLM 0.32.0 and torch 2.13.0 are here already (a GPU image, a prepared environment):
  # leave them and their CUDA libraries as they are; add the package and its other pins.
  # No isolated build: it would download setuptools, which fails on an offline machine
  # (setuptools and wheel are here, above); the kernels are built below, not by pip.
  VLLM_PQ_SKIP_KERNELS=1 $PY -m pip install -q --no-deps --no-build-isolation -e .
  # The package's other pins (and pytest) where absent or at another version: installed
  # from the index; where that fails (offline) a version already here is kept, with a warning.
  todo=$($PY - <<'EOF'
import importlib.metadata as m
from packaging.requirements import Requirement
for r in map(Requirement, m.requires("vllm_pq_backend") or []):
    if r.name in ("vllm", "torch") or (r.marker and not r.marker.evaluate({"extra": "test"})):
        continue
    try:
        have = m.version(r.name)
    except m.PackageNotFoundError:
        have = ""
    if not have or have not in r.specifier:
        print(f"{str(r).split(';')[0]} {r.name} {have or '-'}")
EOF
)
  specs=$(echo "$todo" | cut -d' ' -f1 | tr '\n' ' ')
  added=""
  if [ -n "$todo" ]; then
    if $PY -m pip install -q $specs; then
      added=" (and $specs)"
    else
      absent=$(echo "$todo" | { grep ' -$' || true; } | cut -d' ' -f1 | tr '\n' ' ')
      if [ -n "$absent" ]; then
        echo "install.sh: error: could not install ${absent}(not installed here either)" >&2
        exit 1
      fi
      echo "install.sh: warning: could not install ${specs}(offline?); keeping what is here: $(echo "$todo" | awk '{printf "%s%s %s", s, $2, $3; s=", "}')" >&2
    fi
  fi
  echo "install.sh: vLLM 0.32.0 and torch 2.13.0 found: installed the package next to them$added"
else
  $PY -m pip install -q -e ".[test]"
fi
if $PY -c "import sys, torch; sys.exit(torch.version.cuda is not None)"; then
  $PY -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  echo "install.sh: CPU-only torch: the PyTorch reference path runs (no CUDA kernels); removed vLLM's CUDA builds of torchvision/torchaudio/torchcodec"
elif [ -z "${TORCH_CUDA_ARCH_LIST:-}" ] && ! $PY -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
  echo "install.sh: no GPU visible: the CUDA kernels are not built (run install.sh on the GPU machine, or set TORCH_CUDA_ARCH_LIST, e.g. 9.0, to build them for one here)"
elif command -v nvcc >/dev/null 2>&1; then
  mkdir -p build
  echo "install.sh: building the CUDA kernels (a few minutes; log in build/kernels.log)"
  start=$(date +%s)
  if ! MAX_JOBS=${MAX_JOBS:-$(nproc)} $PY setup.py build_ext --inplace > build/kernels.log 2>&1; then
    tail -n 30 build/kernels.log
    echo "install.sh: error: the CUDA kernels did not build (see build/kernels.log)" >&2
    exit 1
  fi
  $PY -c "import torch, vllm_pq_backend._C"  # torch first: it loads libc10 for _C
  echo "install.sh: CUDA kernels built in $(( $(date +%s) - start )) s"
else
  echo "install.sh: warning: torch is a CUDA build but nvcc is not on PATH: the CUDA kernels are not built and the backend would run its slow PyTorch reference path; put the CUDA toolkit's nvcc on PATH and run install.sh again" >&2
fi
echo "install.sh: done. Tests: python -m pytest -q"
