"""vllm_pq_backend: product-quantized KV cache attention backend for vLLM.

The CUDA kernels (csrc/) build when this runs next to a CUDA build of torch and nvcc:
``python setup.py build_ext --inplace`` (what install.sh does after ``pip install -e``).
In pip's isolated build env, which has no torch, the package installs as pure Python.
"""

import os
import sys

from setuptools import find_packages, setup


def cuda_extensions():
    if os.environ.get("VLLM_PQ_SKIP_KERNELS") == "1":  # install.sh builds them after pip
        print("vllm_pq_backend: VLLM_PQ_SKIP_KERNELS=1: installing without the CUDA kernels")
        return [], {}
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except ImportError:
        print("vllm_pq_backend: torch is not importable here; skipping the CUDA kernels")
        return [], {}
    if torch.version.cuda is None or CUDA_HOME is None:
        print(
            "vllm_pq_backend: no CUDA build of torch or no nvcc (CUDA_HOME); installing "
            "without the CUDA kernels (the PyTorch reference path is used)"
        )
        return [], {}
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, os.path.join(here, "csrc"))
    import extension  # csrc/extension.py: sources, flags and link inputs, as kernels.py's build

    unit_dir = os.path.join(here, "build", "units")
    sources = [os.path.relpath(p, here) for p in extension.sources(unit_dir)]
    ext = CUDAExtension(
        "vllm_pq_backend._C",
        sources,
        include_dirs=[os.path.join(here, "csrc"), unit_dir],  # unit_dir: pq_decode_shapes.inc
        extra_compile_args={"cxx": extension.CXX_FLAGS, "nvcc": extension.NVCC_FLAGS + ["-Xptxas=-v"]},
        extra_link_args=extension.link_args(),
    )
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = cuda_extensions()

setup(
    name="vllm_pq_backend",
    version="0.1.0",
    description="Product-quantized KV cache attention backend for vLLM",
    long_description=open("README.md").read() if os.path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["vllm_pq_backend", "vllm_pq_backend.*"]),
    python_requires=">=3.10",
    install_requires=[
        "vllm==0.32.0",
        "torch==2.13.0",
        "safetensors==0.8.0",
        "tqdm==4.70.1",
    ],
    extras_require={
        "test": ["pytest==9.2.0"],
        "eval": ["lm-eval==0.4.13", "matplotlib==3.10.8", "gguf==0.19.0", "accelerate==1.15.0"],
    },
    entry_points={
        "vllm.general_plugins": ["pq_backend = vllm_pq_backend:register"],
        "console_scripts": ["vllm-pq-calibrate = vllm_pq_backend.calibrate:main"],
    },
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
