"""eval/faults.py's verdict on the engine-core kill, off the GPU: from a synthetic server
log and recorded outcomes, shaped as vLLM 0.32 writes them when its engine core is
SIGKILLed under load (the death named, an HTTP 500 per in-flight request, a clean
shutdown with exit code 0)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "eval"))
import faults  # noqa: E402

DEATH = [
    "(APIServer pid=23700) WARNING 11-28 18:12:40 [core_client.py:817] [shutdown] MPClient: "
    "engine core exited unexpectedly; starting cleanup",
    "(APIServer pid=23700) ERROR 11-28 18:12:40 [serving.py:311] "
    "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack "
    "trace (above) for the root cause.",
]
ACCESS_500 = [f'INFO:     127.0.0.1:{53700 + i} - "POST /v1/completions HTTP/1.1" 500 '
              "Internal Server Error" for i in range(40)]
SHUTDOWN = ["INFO:     Shutting down", "INFO:     Waiting for application shutdown.",
            "INFO:     Application shutdown complete.", "INFO:     Finished server process [23700]"]
BEFORE = ["(APIServer pid=23700) INFO 11-28 18:11:30 [api_server.py:1200] Starting vLLM API server",
          'INFO:     127.0.0.1:53600 - "POST /v1/completions HTTP/1.1" 200 OK']


def log(death=True):
    """The API server's log: each in-flight request logs the death (repeated) then its 500."""
    lines = list(BEFORE)
    if death:
        lines += DEATH
    for line in ACCESS_500:
        lines += DEATH[1:] * death + [line]
    return lines + SHUTDOWN


def recorded(**changes):
    """What case_kill records before scoring, as the GPU run did (exit code 0)."""
    res = dict(server_exit_seconds=0.8, server_exit_code=0,
               requests={"after_kill:http_500": 40, "after_kill:ConnectionError": 24},
               tree_alive_after_exit=[], orphaned_gpu_pids=[], restart_identical="16/16")
    return dict(res, **changes)


def test_the_excerpt_puts_the_death_first_and_counts_the_500s():
    lines = faults.failure_lines(log())
    assert lines[:2] == DEATH
    assert lines[2] == f"40 HTTP 500 access lines, the first: {ACCESS_500[0]}"
    assert lines[3:] == ["INFO:     Waiting for application shutdown.",
                         "INFO:     Application shutdown complete."]
    assert not any(line in lines for line in ACCESS_500)


@pytest.mark.parametrize("code", [0, 1, -9])
def test_a_clean_exit_after_the_death_passes_whatever_the_exit_code(code):
    verdict = faults.score_kill(recorded(server_exit_code=code), log())
    assert verdict["pass"] is True and all(verdict["checks"].values()), verdict["checks"]
    assert verdict["log_failure_lines"][:2] == DEATH


def test_without_the_death_in_the_log_it_fails():
    verdict = faults.score_kill(recorded(), log(death=False))
    assert verdict["pass"] is False
    assert [k for k, ok in verdict["checks"].items() if not ok] == ["engine_death_logged"]
    assert verdict["log_failure_lines"][0].startswith("40 HTTP 500 access lines")


@pytest.mark.parametrize("changes, failed", [
    (dict(server_exit_seconds="hang"), "exited_by_itself"),
    (dict(requests={"after_kill:http_500": 40, "after_kill:ReadTimeout": 1}),
     "in_flight_requests_ended"),
    (dict(requests={"before_kill:ok": 64}), "in_flight_requests_ended"),
    (dict(tree_alive_after_exit=[23701]), "killed_tree_gone"),
    (dict(orphaned_gpu_pids=[23701]), "killed_tree_gone"),
    (dict(orphaned_gpu_pids=None), "killed_tree_gone"),
    (dict(restart_identical="15/16"), "restart_identical"),
])
def test_each_criterion_can_fail_alone(changes, failed):
    verdict = faults.score_kill(recorded(**changes), log())
    assert verdict["pass"] is False
    assert [k for k, ok in verdict["checks"].items() if not ok] == [failed]
