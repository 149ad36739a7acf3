"""Scoring of the pq_long tasks (eval/long_context.py scores its own runs with ``correct``):
one metric per prompt length, which lm-eval aggregates over the documents of that length."""

import re

TASKS = ("passkey", "multikey", "verbatim")  # pq_long_<task>.yaml each
LENGTHS = (2048, 4096, 8192, 16384, 32768)
VERBATIM_TARGET = 6  # eval/long_context.py's


def correct(task: str, answer: str, output: str) -> bool:
    if task == "verbatim":
        return output.split()[:VERBATIM_TARGET] == answer.split()
    m = re.search(r"\d+", output)
    return m is not None and m.group(0) == answer


def process_results(doc, results):
    ok = float(correct(doc["task"], doc["answer"], results[0]))
    return {str(n): ok if n == doc["length"] else -1.0 for n in LENGTHS}


def mean_of_present(values):
    """Accuracy over the documents of one length (the others carry -1); -1 if none."""
    got = [v for v in values if v >= 0]
    return sum(got) / len(got) if got else -1.0
