"""Kernels built just in time are loaded only from a directory that is this user's alone:
the cache when it is safe, else a fresh private directory (said in one log line). The
build itself is replaced by a stand-in that records where it was asked to build, so this
runs without CUDA."""

import os
import stat
from pathlib import Path

import pytest
import torch.utils.cpp_extension

from vllm_pq_backend import kernels


@pytest.fixture
def build(monkeypatch, tmp_path):
    """Runs kernels._build with XDG_CACHE_HOME = tmp_path/cache; returns (the directory the
    build was asked to use, the warnings logged)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    warned = []
    monkeypatch.setattr(kernels.logger, "warning", lambda msg, *a: warned.append(msg % a))
    monkeypatch.setattr(kernels.logger, "info", lambda *a: None)

    def run():
        asked = {}

        def fake_load(name, sources, build_directory, **kwargs):
            asked["dir"] = Path(build_directory)
            so = asked["dir"] / f"{name}.so"
            so.write_bytes(b"")
            return type("Module", (), {"__file__": str(so)})

        monkeypatch.setattr(torch.utils.cpp_extension, "load", fake_load)
        kernels._build()
        return asked["dir"], list(warned)

    return run


def cache_root(tmp_path):
    return tmp_path / "cache" / "vllm_pq_backend"


def test_a_fresh_cache_is_made_private_and_used(build, tmp_path):
    where, warned = build()
    assert where.parent == cache_root(tmp_path) and warned == []
    for d in (cache_root(tmp_path), where):
        assert stat.S_IMODE(d.stat().st_mode) & 0o077 == 0, oct(d.stat().st_mode)
    assert (where / "units").is_dir() and (where / "vllm_pq_backend_C.so").is_file()
    assert build()[0] == where  # and used again


@pytest.mark.parametrize("mode", [0o775, 0o757, 0o777], ids=oct)
def test_a_cache_others_can_write_to_is_not_used(build, tmp_path, mode):
    root = cache_root(tmp_path)
    root.mkdir(parents=True)
    root.chmod(mode)
    where, warned = build()
    assert root not in where.parents and where != root
    assert not where.exists()  # a private build is removed once loaded
    assert len(warned) == 1 and f"{root} is writable by others" in warned[0]
    assert "private directory" in warned[0]


def test_a_cache_someone_else_owns_is_not_used(build, tmp_path, monkeypatch):
    root = cache_root(tmp_path)
    root.mkdir(parents=True, mode=0o700)
    me = os.geteuid()
    if me == 0:
        os.chown(root, 12345, -1)
    else:  # no chown without root: be someone else instead
        monkeypatch.setattr(os, "geteuid", lambda: me + 1)
    where, warned = build()
    assert root not in where.parents
    assert len(warned) == 1 and "belongs to uid" in warned[0]


def test_a_planted_file_in_the_build_directory_is_refused(build, tmp_path):
    where, _ = build()
    planted = where / "units" / "extra.cu"
    planted.write_text("// anyone's code")
    planted.chmod(0o666)
    again, warned = build()
    assert again != where and len(warned) == 1 and f"{planted} is writable by others" in warned[0]


def test_a_cache_in_a_directory_others_can_write_to(build, tmp_path):
    """Without the sticky bit, others could rename the cache away and put theirs there;
    with it (as /tmp), they cannot."""
    cache = tmp_path / "cache"
    cache.mkdir()
    cache.chmod(0o777)
    where, warned = build()
    assert cache not in where.parents and f"{cache} is writable by others" in warned[0]
    cache.chmod(0o1777)
    where, warned = build()
    assert where.parent == cache_root(tmp_path) and len(warned) == 1  # no new warning


def test_a_group_writable_umask_does_not_lock_the_cache_out(build, tmp_path):
    """Files a build leaves under umask 002 are group-writable; the build takes that off,
    so the next start uses the cache instead of refusing it."""
    old = os.umask(0o002)
    try:
        where, warned = build()
    finally:
        os.umask(old)
    so = where / "vllm_pq_backend_C.so"
    assert stat.S_IMODE(so.stat().st_mode) & 0o022 == 0 and warned == []
    assert build() == (where, [])
