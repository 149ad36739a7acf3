"""How the CUDA extension is built, by setup.py (in place: install.sh) and by
vllm_pq_backend/kernels.py (just in time) alike: its sources, compiler flags and link
inputs, handed to torch's extension tooling."""

import glob
import importlib.util
import os

HERE = os.path.dirname(os.path.abspath(__file__))
CXX_FLAGS = ["-O3", "-std=c++17"]
NVCC_FLAGS = ["-O3", "-std=c++17", "--use_fast_math", "-lineinfo"]


def sources(unit_dir: str) -> list[str]:
    """The CUDA units, the generated decode units (written into unit_dir) and the binding."""
    spec = importlib.util.spec_from_file_location("pq_gen_units", os.path.join(HERE, "gen_units.py"))
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    units = gen.units(unit_dir)  # one unit per (dtype, head_dim): parallel compiles
    return sorted(glob.glob(os.path.join(HERE, "*.cu"))) + units + [os.path.join(HERE, "pq_binding.cpp")]


def loaded_libstdcxx() -> str | None:
    """The libstdc++ this process runs (torch's, once torch is imported), or None."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                if os.path.basename(path).startswith("libstdc++.so"):
                    return path
    except OSError:
        pass
    return None


def link_args() -> list[str]:
    """The extension links the libstdc++ that torch's process runs, named by path ahead of the
    compiler's own -lstdc++. A toolchain that ships only libstdc++.a (CXX=/opt/gcc/bin/g++ on a
    GPU image) otherwise copies the C++ runtime into the extension: two copies in one process,
    whose iostreams then look facets up by the other copy's ids, so that a TORCH_CHECK message
    that formats a number crashed the process (SIGSEGV) instead of raising. Given the shared
    library first, the linker resolves the runtime there and takes nothing from the archive."""
    path = loaded_libstdcxx()
    return [path] if path else []
