"""The extension's link (csrc/extension.py), checked on the CPU with the host compiler: a
small shared object that formats a number through iostreams, linked as the extension is by
a toolchain that has only a static libstdc++ (as CXX=/opt/gcc/bin/g++ on a GPU image), is
loaded into a process that runs torch and its libstdc++.so.6."""

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch  # noqa: F401  (loads the libstdc++ that link_args names)

CSRC = Path(__file__).resolve().parent.parent / "csrc"
SOURCE = r"""
#include <cstring>
#include <sstream>
extern "C" void format(char* out, long x) {
  std::ostringstream s;
  s << "x=" << x;
  std::strcpy(out, s.str().c_str());
}
"""
LOAD = """
import ctypes, sys
import torch
out = ctypes.create_string_buffer(64)
ctypes.CDLL(sys.argv[1]).format(out, ctypes.c_long(12345))
print(out.value.decode())
"""


def extension():
    spec = importlib.util.spec_from_file_location("pq_extension", CSRC / "extension.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def static_only_toolchain(tmp_path):
    """A library folder with libstdc++.a and no libstdc++.so, searched before the usual ones."""
    if shutil.which("g++") is None:
        pytest.skip("needs g++")
    static = subprocess.run(["g++", "-print-file-name=libstdc++.a"], capture_output=True,
                            text=True).stdout.strip()
    if not os.path.isabs(static):
        pytest.skip("g++ has no libstdc++.a here")
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "libstdc++.a").symlink_to(static)
    return lib


def build_and_run(tmp_path, lib, link_args):
    (tmp_path / "format.cpp").write_text(SOURCE)
    so = tmp_path / f"format{len(link_args)}.so"
    subprocess.run(["g++", "-shared", "-fPIC", "-O2", str(tmp_path / "format.cpp"), "-L", str(lib),
                    *link_args, "-o", str(so)], check=True)
    return subprocess.run([sys.executable, "-c", LOAD, str(so)], capture_output=True, text=True,
                          timeout=300)


def test_link_args_name_the_libstdcxx_this_process_runs():
    args = extension().link_args()
    assert len(args) == 1 and os.path.basename(args[0]).startswith("libstdc++.so"), args
    assert os.path.isfile(args[0])


def test_a_static_only_toolchain_links_the_shared_runtime_with_link_args(tmp_path):
    lib = static_only_toolchain(tmp_path)
    alone = build_and_run(tmp_path, lib, [])
    # the hazard itself, so that this test can tell the two links apart: a second copy of
    # the runtime formats no number (here) or crashes (SIGSEGV on the GPU image)
    assert alone.returncode != 0 or alone.stdout.strip() != "x=12345", alone.stdout
    linked = build_and_run(tmp_path, lib, extension().link_args())
    assert linked.returncode == 0, linked.stderr[-2000:]
    assert linked.stdout.strip() == "x=12345"
