"""The backend driven as vLLM's model runner drives it, step by step, against digests
recorded from a known-good build (tests/golden_steps.json): the outputs, the KV pages and
the window store after every step, bit for bit.

Each scenario runs one schedule (prefills, chunked continuations, decodes, two requests
on another request's cached blocks) through one execution path: the path without the
CUDA kernels (the one CPU serving takes), and the GPU prefill paths with PyTorch
stand-ins for FlashAttention and vLLM's Triton attention (dequantized pages, window
segments, the codes kernel in Triton's interpreter with its LSE merge, batch-invariant).

K and V are coded at 4 bits per element with head_dim 64 (2-D subspaces): a code is the
argmin of one addition per centroid, the same on any x86 CPU, so the pages and the
window store must match everywhere. Outputs go through softmax and matmuls whose last
bits depend on the CPU's vector unit and the BLAS build: they must match bit for bit on
the platform the digests were recorded on (``platform`` in the file), and elsewhere agree
with the dense check within the tolerance of tests/test_attention.py.

Re-record (only for an intended change of results): ``PQ_RECORD_GOLDEN=1 python -m
pytest -q tests/test_golden_steps.py``.
"""

import base64
import hashlib
import json
import os
import platform

import pytest
import torch

from helpers import INTERPRETED, Sim, use_gpu_paths, vllm_config

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden_steps.json")
RECORD = os.environ.get("PQ_RECORD_GOLDEN") == "1"

# name: (path, window, batch_invariant, the plan type its prefills must include)
SCENARIOS = {
    "cpu_w32": ("cpu", 32, False, "FallbackPlan"),
    "cpu_w32_bi": ("cpu", 32, True, "FallbackPlan"),
    "cpu_w0": ("cpu", 0, False, "FallbackPlan"),
    "pages_w0": ("flash", 0, False, "PagesPlan"),
    "segments_w32": ("flash", 32, False, "SegmentsPlan"),
    "codes_w32": ("codes", 32, False, "CodesPlan"),
    "codes_w0": ("codes", 0, False, "CodesPlan"),
    "bi_w32": ("flash", 32, True, "BatchInvariantPlan"),
    "bi_w0": ("flash", 0, True, "BatchInvariantPlan"),
}


def platform_id() -> str:
    vendor = ""
    if os.path.exists("/proc/cpuinfo"):
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                vendor = line.split(":", 1)[1].strip()
                break
    return (f"torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}, "
            f"{platform.machine()} {vendor}")


def digest(t: torch.Tensor) -> str:
    """120 bits of the tensor's SHA-256, in URL-safe base64."""
    raw = hashlib.sha256(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return base64.urlsafe_b64encode(raw.digest()[:15]).decode()


def run(sim):
    """The schedule; yields (step name, outputs in the step's row order)."""
    for rid in range(3):
        sim.add(rid)
    yield "prefill", sim.step([(0, 100), (1, 7)])
    yield "continuations", sim.step([(0, 1), (1, 60), (2, 129)])
    yield "chunk+verify", sim.step([(2, 70), (0, 2)])
    yield "decode", sim.step([(0, 1), (1, 1), (2, 1)])
    # two prefix-cache hits on request 2's first two blocks, prefilled in one step
    a = sim.reqs[2]
    shared = sim.finish(2, keep_blocks=2)
    for rid in (3, 4):
        b = sim.add(rid, shared_blocks=shared)
        b.q, b.k, b.v = ([torch.cat(x)[: 2 * sim.B]] for x in (a.q, a.k, a.v))
    yield "prefix hits", sim.step([(0, 1), (3, 40), (4, 9)])
    for i in range(3):  # decode across a window boundary
        yield f"decode {i}", sim.step([(0, 1), (1, 1), (3, 1), (4, 1)])
    yield "mixed", sim.step([(1, 1), (4, 33), (3, 1), (0, 5)])


def scenario_digests(model_factory, monkeypatch, name):
    path, window, bi, _ = SCENARIOS[name]
    model = model_factory(64, 4, 2)
    vc = vllm_config(model, block_size=64, pq={"window": window, "m": 32})
    # the codes kernel's products are 16-bit (Triton's interpreter too)
    dtype = torch.float16 if path == "codes" else torch.float32
    sim = Sim(vc, seed=13, dtype=dtype)
    sim.builder.batch_invariant = bi
    if path != "cpu":
        use_gpu_paths(monkeypatch, sim, path)
    plans, build = set(), sim.builder.build

    def spy(*args, **kwargs):  # the plan types the steps ran
        md = build(*args, **kwargs)
        plans.update(type(g.plan).__name__ for g in md.prefills)
        return md

    sim.builder.build = spy
    steps = []
    for step, outs in run(sim):
        out = torch.cat(list(outs.values()))
        assert not torch.isnan(out).any(), f"{name}, {step}: unwritten output rows"
        st = sim.impl._state
        window_store = (torch.cat([st.win_k.flatten(), st.win_v.flatten()]) if window
                        else torch.zeros(0))
        steps.append(dict(step=step, out=digest(out), pages=digest(sim.kv_cache),
                          window=digest(window_store)))
    return sim, steps, outs, plans


@pytest.fixture(scope="module")
def golden():
    if RECORD:
        data = {"platform": platform_id(), "scenarios": {}}
        yield data
        with open(GOLDEN, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
            f.write("\n")
        return
    with open(GOLDEN) as f:
        yield json.load(f)




@pytest.mark.parametrize("name", [pytest.param(n, marks=INTERPRETED) if SCENARIOS[n][0] == "codes"
                                  else n for n in SCENARIOS])
def test_steps_match_the_recorded_digests(model_factory, monkeypatch, golden, name):
    sim, got, outs, plans = scenario_digests(model_factory, monkeypatch, name)
    assert SCENARIOS[name][3] in plans, plans
    if RECORD:
        golden["scenarios"][name] = got
        return
    want = golden["scenarios"][name]
    assert [s["step"] for s in got] == [s["step"] for s in want]
    for g, w in zip(got, want):
        assert g["pages"] == w["pages"], f"{name}, step {g['step']}: KV pages differ"
        assert g["window"] == w["window"], f"{name}, step {g['step']}: window store differs"
    if golden["platform"] == platform_id():
        for g, w in zip(got, want):
            assert g["out"] == w["out"], f"{name}, step {g['step']}: outputs differ"
    else:  # another CPU: the last step's outputs within the dense check's tolerance
        window = SCENARIOS[name][1]
        tol = 5e-3 if SCENARIOS[name][0] == "codes" else 2e-5
        for rid, out in outs.items():
            ref = sim.dense_reference(rid, window)[-out.shape[0]:]
            err = (out.float() - ref).norm(dim=-1) / ref.norm(dim=-1)
            assert err.max() < tol, f"{name}, request {rid}: relative error {err.max():.2e}"
