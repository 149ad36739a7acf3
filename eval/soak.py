"""Serving soak: `vllm serve` on loopback under a mixed, adversarial load, for each backend.

    python eval/soak.py --model eval/data/smollm2 --backends CUSTOM FLASH_ATTN --minutes 10
    python eval/soak.py ... --parallel   # both servers at once, each on its own share of one GPU

Every server gets the same KV cache (--kv-cache-gib, vLLM's --kv-cache-memory-bytes), so
that neither is limited by memory the other took. For each backend: start the server;
record GPU memory and its KV capacity; take the greedy output of each
reference prompt sent alone; then for --minutes keep --clients concurrent clients busy
with prompts of mixed lengths up to max_model_len, streaming and non-streaming, a share
cancelled by the client mid-stream (or by a short timeout), a few malformed requests
(expecting HTTP 400), and the reference prompts again (greedy, compared token text to
the alone outputs); afterwards check /health and GPU memory again (the server's processes'
own use where nvidia-smi can tell, else the whole GPU's), also sampled every
--memory-every seconds during the load. Writes
eval/results/soak.json: errors (anything other than the deliberate cancellations and the
expected 400s), whether the server exited, memory before/after, the share of reference
outputs identical to alone, request counts.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import os
import random
import subprocess
import sys
import threading
import time

from common import codebook_meta, gpu_apps, provenance, wait_healthy

REFERENCE = [f"Write a short note about {t}." for t in (
    "the water cycle", "binary search", "the French revolution", "photosynthesis",
    "hash tables", "the moon landing", "compilers", "volcanoes", "TCP handshakes",
    "the printing press", "prime numbers", "glaciers", "the Roman road network", "recursion",
    "coral reefs", "public-key cryptography")]
WORDS = ("the of and to in is was for on that with as by at from it an be this which or "
         "kernel memory page cache token model request server client stream").split()


def random_prompt(rng: random.Random, longest: int) -> str:
    """A load prompt of about a token a word: up to ``longest`` words (a third of the
    time), else up to 512."""
    n = rng.randint(16, longest) if rng.random() < 0.3 else rng.randint(16, 512)
    return " ".join(rng.choice(WORDS) for _ in range(n))


def first_difference(a, b) -> int | None:
    """Where sequences ``a`` and ``b`` part (the shorter one's length if one is a prefix
    of the other), None if equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def gpu_memory_mib(root_pid: int) -> tuple[int, str]:
    """(MiB, scope): the GPU memory of the process tree under ``root_pid`` (the server and
    its engine core), or of the whole GPU where nvidia-smi does not show their pids."""
    import psutil

    root = psutil.Process(root_pid)
    pids = {root_pid, *(c.pid for c in root.children(recursive=True))}
    mine = [m for pid, m in (gpu_apps() or {}).items() if pid in pids]
    if mine:
        return sum(mine), "server processes"
    whole = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, check=True).stdout
    return int(whole.split()[0]), "whole GPU"


def codebook_file(args) -> str | None:
    """CUSTOM's codebook file: --additional-config's pq.codebooks in --serve-args, else the
    default next to the model (as the backend resolves it)."""
    from vllm_pq_backend.config import PQConfig

    extra = args.serve_args
    cfg = next((json.loads(extra[i + 1]) for i, a in enumerate(extra[:-1])
                if a == "--additional-config"), None)
    with open(os.path.join(args.model, "config.json")) as f:
        hf = json.load(f)
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    path = PQConfig.from_sources(cfg, args.model).codebook_file(head_dim)
    return path if os.path.isfile(path) else None


def capacity_lines(log_path: str) -> list[str]:
    """The server's own account of what it can hold: vLLM's KV cache size and concurrency,
    and (CUSTOM) the window store's admission limit."""
    keys = ("KV cache size:", "vllm_pq_backend:")
    with open(log_path, errors="replace") as f:
        return [line.split("] ", 1)[-1].strip() for line in f if any(k in line for k in keys)][:4]


async def complete(session, url, model, prompt, max_tokens, stream, temperature=0.0,
                   cancel_after=None, timeout=None):
    """(status, text, note): note is 'cancelled' when the client gave up on purpose."""
    import aiohttp

    body = dict(model=model, prompt=prompt, max_tokens=max_tokens, temperature=temperature,
                stream=stream)
    try:
        async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            if r.status != 200:
                return r.status, await r.text(), None
            if not stream:
                return 200, (await r.json())["choices"][0]["text"], None
            text, chunks = [], 0
            async for line in r.content:
                line = line.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                text.append(json.loads(line[5:])["choices"][0]["text"])
                chunks += 1
                if cancel_after is not None and chunks >= cancel_after:
                    return 200, "".join(text), "cancelled"  # leaving the block closes it
            return 200, "".join(text), None
    except asyncio.TimeoutError:
        return None, "", "cancelled" if timeout else "timeout"
    except Exception as e:  # noqa: BLE001  (recorded as an error)
        return None, f"{type(e).__name__}: {e}", None


async def load(args, port, alone, deadline) -> dict:
    import aiohttp

    url = f"http://127.0.0.1:{port}/v1/completions"
    stats = dict(requests=0, ok=0, cancelled=0, bad_rejected=0, errors=[], reference=0,
                 reference_identical=0, reference_differs=[])
    rng = random.Random(0)

    async def client(i):
        async with aiohttp.ClientSession() as s:
            while time.time() < deadline:
                kind = rng.random()
                stats["requests"] += 1
                if kind < 0.03:  # malformed: must be refused with 400, not crash anything
                    bad = rng.choice([dict(max_tokens=-5), dict(max_tokens=10 ** 9),
                                      dict(prompt=" ".join(WORDS) * 2000)])
                    body = dict(dict(model=args.model, prompt="hello", max_tokens=8), **bad)
                    async with s.post(url, json=body) as r:
                        if r.status == 400:
                            stats["bad_rejected"] += 1
                        else:
                            stats["errors"].append(f"malformed request answered {r.status}")
                    continue
                if kind < 0.25:  # a reference prompt: greedy, compared to alone
                    j = rng.randrange(len(REFERENCE))
                    st, text, note = await complete(s, url, args.model, REFERENCE[j], args.ref_tokens,
                                                    stream=rng.random() < 0.5)
                    if st == 200:
                        stats["reference"] += 1
                        stats["reference_identical"] += text == alone[j]
                        if text != alone[j] and len(stats["reference_differs"]) < 20:
                            # where they part: a tie-like late flip or garbage from the start
                            at = first_difference(text, alone[j])
                            stats["reference_differs"].append(dict(
                                prompt=j, first_char_differing=at, alone=alone[j], loaded=text))
                    else:
                        stats["errors"].append(f"reference: {st} {text[:200]}")
                    continue
                prompt = random_prompt(rng, args.max_model_len - 64)
                stream = rng.random() < 0.5
                cancel = rng.randint(1, 16) if stream and rng.random() < 0.2 else None
                timeout = 0.5 if not stream and rng.random() < 0.05 else None
                st, text, note = await complete(s, url, args.model, prompt, rng.randint(1, 48), stream,
                                                temperature=rng.choice([0.0, 0.8]),
                                                cancel_after=cancel, timeout=timeout)
                if note == "cancelled":
                    stats["cancelled"] += 1
                elif st == 200:
                    stats["ok"] += 1
                elif st == 400 and len(prompt.split()) > args.max_model_len // 2 and "length" in text:
                    stats["bad_rejected"] += 1  # the words came to more tokens than fit
                else:
                    stats["errors"].append(f"{st} {text[:200]}")

    await asyncio.gather(*(client(i) for i in range(args.clients)))
    return stats


async def alone_outputs(args, port) -> list[str]:
    import aiohttp

    url = f"http://127.0.0.1:{port}/v1/completions"
    out = []
    async with aiohttp.ClientSession() as s:
        for p in REFERENCE:
            st, text, _ = await complete(s, url, args.model, p, args.ref_tokens, stream=False)
            if st != 200:
                raise RuntimeError(f"reference prompt alone failed: {st} {text[:300]}")
            out.append(text)
    return out


def soak(args, backend: str, port: int) -> dict:
    log_path = os.path.join(os.path.dirname(args.out) or ".", f"soak_{backend}.log")
    log = open(log_path, "w")
    share = 0.4 if args.parallel else 0.5
    # The same KV cache bytes for every backend. Sized by --gpu-memory-utilization instead,
    # two servers starting together on one GPU each count the other's allocations made
    # during their memory profile as their own use, and one gets a fraction of the cache.
    cmd = ["vllm", "serve", args.model, "--attention-backend", backend, "--port", str(port),
           "--max-model-len", str(args.max_model_len), "--gpu-memory-utilization", str(share),
           "--kv-cache-memory-bytes", str(int(args.kv_cache_gib * 2**30)), *args.serve_args]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    row = dict(backend=backend, command=" ".join(cmd))
    try:
        if wait_healthy(port, proc, 600) is None:
            return dict(row, error="server did not become healthy", exited=proc.poll())
        row["capacity"] = capacity_lines(log_path)
        alone = asyncio.run(alone_outputs(args, port))
        row["gpu_mib_before"], row["gpu_mib_scope"] = gpu_memory_mib(proc.pid)
        start = time.time()
        series, done = [], threading.Event()

        def sample():  # GPU memory through the run: a leak keeps rising, a cache levels off
            while not done.wait(args.memory_every):
                series.append((round(time.time() - start), gpu_memory_mib(proc.pid)[0]))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            stats = asyncio.run(load(args, port, alone, start + 60 * args.minutes))
        finally:
            done.set()
            sampler.join()
        row["seconds"] = round(time.time() - start, 1)
        row["healthy_after"] = wait_healthy(port, proc, 30) is not None
        row["gpu_mib_after"] = gpu_memory_mib(proc.pid)[0]
        row["gpu_mib_series"] = series
        # growth over the second half: the first fills vLLM's and PyTorch's caches
        # (prompt lengths and batch shapes not seen yet); a leak grows in both
        half = [m for t, m in series if t >= 30 * args.minutes]
        row["gpu_mib_growth_second_half"] = half[-1] - half[0] if len(half) > 1 else None
        row["server_exited"] = proc.poll() is not None
        row.update(stats, errors_count=len(stats["errors"]), errors=stats["errors"][:50],
                   reference_identical_share=round(stats["reference_identical"] / max(1, stats["reference"]), 4))
        return row
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--backends", nargs="+", default=["CUSTOM", "FLASH_ATTN"])
    p.add_argument("--minutes", type=float, default=10)
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--ref-tokens", type=int, default=48)
    p.add_argument("--port", type=int, default=8190)
    p.add_argument("--parallel", action="store_true",
                   help="run the backends' servers at the same time (0.4 of the GPU each)")
    p.add_argument("--kv-cache-gib", type=float, default=8,
                   help="KV cache of every server (--kv-cache-memory-bytes), the same for each")
    p.add_argument("--memory-every", type=float, default=30,
                   help="seconds between GPU memory samples during the load")
    p.add_argument("--serve-args", nargs=argparse.REMAINDER, default=[],
                   help="passed to vllm serve (last on the command line)")
    p.add_argument("--out", default="eval/results/soak.json")
    args = p.parse_args()
    rows = []

    def record(row):
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("errors", "reference_differs")}), flush=True)
        with open(args.out, "w") as f:
            json.dump(dict(provenance(), model=args.model, minutes=args.minutes, clients=args.clients,
                           max_model_len=args.max_model_len, parallel=args.parallel,
                           kv_cache_gib=args.kv_cache_gib, codebooks=meta, rows=rows),
                      f, indent=1)

    books = codebook_file(args)
    meta = codebook_meta(books) if books else {}

    if args.parallel:
        with concurrent.futures.ThreadPoolExecutor(len(args.backends)) as pool:
            runs = [pool.submit(soak, args, b, args.port + i) for i, b in enumerate(args.backends)]
            for run in runs:
                record(run.result())
    else:
        for i, backend in enumerate(args.backends):
            record(soak(args, backend, args.port + i))
    return 0


if __name__ == "__main__":
    sys.exit(main())
