"""Faults while serving, recorded: what `vllm serve` with the CUSTOM backend does when its
engine core dies under load, and when the window store cannot fit.

  kill   start the server, take greedy reference outputs of a fixed prompt set one at a
         time, start concurrent load, SIGKILL the engine core process (VLLM::EngineCore)
         and record how long the API server takes to exit, its exit code (vLLM's choice,
         not this backend's: vLLM 0.32 exits with 0), the log lines naming the failure, how
         the in-flight requests ended and whether a process of the killed tree still holds
         GPU memory; then restart the server and check that the reference prompts give
         identical outputs.
  nofit  start the server asking for far more window store rows than the memory holds and
         record whether it exits within the bounded time, its exit code and the one-line
         error.

    CUDA_VISIBLE_DEVICES=1 python3 eval/faults.py --model eval/data/smollm2 \\
        --codebooks eval/data/smollm2/pq/b4.safetensors --out eval/results/faults.json

Whole server logs go to --log-dir (NAME.kill.log, ...); the JSON keeps excerpts.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import psutil
import requests

from common import codebook_meta, gpu_apps, provenance, wait_healthy, write_result

PROMPTS = [
    "The capital of France is", "Water boils at a temperature of", "The first law of motion says",
    "Once upon a time, in a small village,", "A good recipe for bread needs",
    "The largest planet in the solar system is", "In 1969, the first people to walk on the Moon",
    "Photosynthesis is the process by which", "The quick brown fox", "def fibonacci(n):\n",
    "The three primary colors are", "A haiku about autumn:\n", "The stock market fell today because",
    "To solve a quadratic equation, you", "The human heart has four chambers:",
    "My favourite book is",
]
NOFIT_MSG = "the window store cannot fit"
FAILURE = re.compile(r"error|exception|died|dead|killed|traceback|shutdown|terminat", re.I)
# what vLLM's API server logs when its engine core dies (vllm/v1/engine/core_client.py,
# vllm/v1/engine/exceptions.py)
DEATH = re.compile(r"EngineDeadError|engine core exited unexpectedly")
HTTP_500 = re.compile(r'" 500 ')  # an access line: ... "POST /v1/completions HTTP/1.1" 500 ...


def serve(a, log_path, extra=()):
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", a.model,
           "--attention-backend", "CUSTOM", "--enforce-eager", "--port", str(a.port),
           "--max-model-len", str(a.max_model_len),
           "--additional-config", json.dumps({"pq": {"codebooks": a.codebooks}}),
           *shlex.split(a.serve_args), *extra]
    print("$", shlex.join(cmd), flush=True)
    log = open(log_path, "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def healthy(a, proc) -> float:
    """Seconds until the server is healthy; an error naming why it is not."""
    seconds = wait_healthy(a.port, proc, a.start_timeout)
    if seconds is None:
        raise RuntimeError(f"the server exited with {proc.returncode} before /health was OK"
                           if proc.poll() is not None else f"/health not OK within {a.start_timeout} s")
    return seconds


def url(a) -> str:
    return f"http://127.0.0.1:{a.port}"


def complete(a, prompt, max_tokens, timeout, ignore_eos=False):
    r = requests.post(f"{url(a)}/v1/completions", timeout=timeout, json=dict(
        model=a.model, prompt=prompt, max_tokens=max_tokens, temperature=0,
        ignore_eos=ignore_eos))
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


def references(a):
    """Greedy outputs, one request at a time (the same batches on every run)."""
    return [complete(a, p, a.max_tokens, a.exit_timeout) for p in PROMPTS]


def stop(proc, timeout=30):
    """SIGTERM the server's process group, then SIGKILL what is left."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def running(pid) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def log_excerpt(path, pattern, last=15):
    lines = [l.rstrip() for l in open(path, errors="replace") if pattern.search(l)]
    return lines[-last:]


def failure_lines(lines: list[str], last: int = 15, deaths: int = 5) -> list[str]:
    """The log lines that tell how the server failed: the first ``deaths`` distinct lines
    naming the engine core's death, then the HTTP 500 access lines (one per failed request)
    as one line with their count, then the last ``last`` other failure lines."""
    death = list(dict.fromkeys(l for l in lines if DEATH.search(l)))[:deaths]
    errors = [l for l in lines if HTTP_500.search(l) and not DEATH.search(l)]
    rest = [l for l in lines
            if FAILURE.search(l) and not DEATH.search(l) and not HTTP_500.search(l)]
    summary = [f"{len(errors)} HTTP 500 access lines, the first: {errors[0]}"] if errors else []
    return death + summary + rest[-last:]


def score_kill(res: dict, log_lines: list[str]) -> dict:
    """The kill case's checks, excerpt and verdict from what case_kill recorded in ``res``
    and the API server's log. The exit code is vLLM's choice and is not checked."""
    outcomes = res["requests"]
    same, total = res["restart_identical"].split("/")
    checks = dict(
        exited_by_itself=isinstance(res["server_exit_seconds"], (int, float)),
        engine_death_logged=any(DEATH.search(l) for l in log_lines),
        # a client timeout is a request that hung
        in_flight_requests_ended=(any(k.startswith("after_kill:") for k in outcomes)
                                  and not any(k.endswith("Timeout") for k in outcomes)),
        killed_tree_gone=(res["tree_alive_after_exit"] == []
                          and res["orphaned_gpu_pids"] == []),  # None: not known
        restart_identical=same == total)
    return {"log_failure_lines": failure_lines(log_lines), "checks": checks,
            "pass": all(checks.values())}


def request_outcome(a, i, kill_time):
    t0 = time.time()
    try:
        complete(a, PROMPTS[i % len(PROMPTS)], a.load_tokens, a.exit_timeout + 60, ignore_eos=True)
        kind = "ok"
    except requests.HTTPError as e:
        kind = f"http_{e.response.status_code}"
    except requests.RequestException as e:
        kind = type(e).__name__
    end = time.time()
    when = "before_kill" if kill_time[0] is None or end < kill_time[0] else "after_kill"
    return dict(kind=kind, ended=when, seconds=round(end - t0, 2))


def case_kill(a, base) -> dict:
    res = dict(criteria=f"the API server exits by itself within {a.exit_timeout} s of the "
                        "engine core's SIGKILL (any exit code, recorded: vLLM chooses it), "
                        "its log names the engine core's death (EngineDeadError or 'engine "
                        "core exited unexpectedly'), requests are in flight at the kill and "
                        "every one ends (none hangs), no process of the killed tree is left "
                        "alive or holding GPU memory, and after a restart all reference "
                        "prompts give identical greedy outputs")
    proc = serve(a, base + ".kill.log")
    try:
        res["start_seconds"] = round(healthy(a, proc), 1)
        print(f"healthy after {res['start_seconds']} s; reference outputs", flush=True)
        ref = references(a)
        tree = [proc.pid] + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        cores = [c for c in psutil.Process(proc.pid).children(recursive=True)
                 if "EngineCore" in " ".join(c.cmdline()) or "EngineCor" in c.name()]
        if not cores:
            raise RuntimeError("no VLLM::EngineCore process among the server's children")
        res["engine_core"] = " ".join(cores[0].cmdline())
        kill_time = [None]
        pool = ThreadPoolExecutor(a.concurrency)
        futures = [pool.submit(request_outcome, a, i, kill_time) for i in range(a.requests)]
        time.sleep(a.kill_after)
        print(f"SIGKILL engine core {cores[0].pid} under load", flush=True)
        kill_time[0] = time.time()
        os.kill(cores[0].pid, signal.SIGKILL)
        try:
            proc.wait(a.exit_timeout)
            res["server_exit_seconds"] = round(time.time() - kill_time[0], 1)
            res["server_exit_code"] = proc.returncode
        except subprocess.TimeoutExpired:
            res["server_exit_seconds"], res["server_exit_code"] = "hang", None
            stop(proc)
        outcomes = [f.result() for f in futures]
        pool.shutdown()
        res["requests"] = dict(Counter(f"{o['ended']}:{o['kind']}" for o in outcomes))
        alive = [p for p in tree if running(p)]
        res["tree_alive_after_exit"] = alive
        gpu = gpu_apps()
        for _ in range(10):  # the driver lets go of a dead process's memory shortly after
            if not gpu or not set(gpu) & set(tree):
                break
            time.sleep(1)
            gpu = gpu_apps()
        res["gpu_apps_after_exit"] = gpu if gpu is None else {str(k): v for k, v in gpu.items()}
        res["orphaned_gpu_pids"] = None if gpu is None else sorted(set(gpu) & set(tree))
        for p in alive:  # ours: leave nothing behind for the restart
            try:
                psutil.Process(p).kill()
            except psutil.NoSuchProcess:
                pass
    finally:
        stop(proc)
    print("restart", flush=True)
    proc = serve(a, base + ".restart.log")
    try:
        res["restart_seconds"] = round(healthy(a, proc), 1)
        again = references(a)
    finally:
        stop(proc)
    same = sum(x == y for x, y in zip(ref, again))
    res["restart_identical"] = f"{same}/{len(PROMPTS)}"
    res["restart_differing"] = [dict(prompt=p, before=x, after=y)
                                for p, x, y in zip(PROMPTS, ref, again) if x != y][:3]
    with open(base + ".kill.log", errors="replace") as f:
        res.update(score_kill(res, [l.rstrip() for l in f]))
    return res


def case_nofit(a, base) -> dict:
    res = dict(criteria=f"the server exits within {a.start_timeout} s with a non-zero code "
                        f"and its log has the one-line error ('{NOFIT_MSG}')",
               serve_args=a.nofit_args)
    t0 = time.time()
    proc = serve(a, base + ".nofit.log", shlex.split(a.nofit_args))
    try:
        proc.wait(a.start_timeout)
        res["exit_seconds"], res["exit_code"] = round(time.time() - t0, 1), proc.returncode
    except subprocess.TimeoutExpired:
        res["exit_seconds"], res["exit_code"] = "hang", None
    finally:
        stop(proc)
    lines = log_excerpt(base + ".nofit.log", re.compile(re.escape(NOFIT_MSG)), last=1)
    res["error"] = lines[0][lines[0].index("vllm_pq_backend"):] if lines else None
    res["log_failure_lines"] = log_excerpt(base + ".nofit.log", FAILURE, last=8)
    res["pass"] = res["exit_code"] not in (None, 0) and res["error"] is not None
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--codebooks", required=True)
    p.add_argument("--port", type=int, default=8123)
    p.add_argument("--out", default="eval/results/faults.json")
    p.add_argument("--cases", nargs="+", default=["kill", "nofit"], choices=("kill", "nofit"))
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--serve-args", default="", help="more `vllm serve` flags, one string")
    p.add_argument("--nofit-args", default="--max-num-seqs 1024 --max-num-active-seqs 1024 "
                   "--gpu-memory-utilization 0.015",
                   help="flags that ask for more window store rows than the memory holds")
    p.add_argument("--max-tokens", type=int, default=64, help="reference outputs' tokens")
    p.add_argument("--load-tokens", type=int, default=512, help="tokens of each load request")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--kill-after", type=float, default=5.0, help="seconds of load before")
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--exit-timeout", type=float, default=120.0)
    p.add_argument("--device-name", help="a description for runs off the GPU")
    p.add_argument("--log-dir", default="/tmp/faults_logs",
                   help="where the whole server logs go (the JSON keeps excerpts)")
    a = p.parse_args()
    a.codebooks = os.path.abspath(a.codebooks)
    for path in (a.model, a.codebooks):
        if not os.path.exists(path):
            p.error(f"{path} does not exist")
    os.makedirs(a.log_dir, exist_ok=True)
    base = os.path.join(a.log_dir, os.path.splitext(os.path.basename(a.out))[0])
    result = dict(provenance(a.device_name), **codebook_meta(a.codebooks), model=a.model)
    for case, run in (("kill", case_kill), ("nofit", case_nofit)):
        if case in a.cases:
            print(f"== {case}", flush=True)
            try:
                result[case] = run(a, base)
            except Exception as e:  # a case that could not run is recorded as failed
                result[case] = {"error": f"{type(e).__name__}: {e}", "pass": False}
            print(json.dumps(result[case], indent=1)[:3000], flush=True)
    write_result(a.out, result)
    print(f"server logs in {a.log_dir}")
    return 0 if all(result[c]["pass"] for c in a.cases) else 1


if __name__ == "__main__":
    sys.exit(main())
