"""One results file and plot from a `vllm bench sweep serve` experiment directory: per
server setting and request rate, output throughput, TTFT and TPOT (median, p99).

    python eval/serve_bench/collect.py EXPERIMENT_DIR --out eval/results/serve_bench.json \
        --command "vllm bench sweep serve ..."

Writes OUT (rows as `vllm bench serve` measured them, with provenance) and OUT's .png.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from provenance import provenance  # noqa: E402

KEEP = ("completed", "failed", "duration", "request_throughput", "output_throughput",
        "total_token_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
        "p99_tpot_ms", "median_itl_ms", "p99_itl_ms")


def rows_of(exp: Path) -> list[dict]:
    rows = []
    for path in sorted(exp.glob("*/run=*.json")):
        m = re.match(r"SERVE--(.+?)-BENCH-", path.parent.name)
        data = json.loads(path.read_text())
        rows.append(dict(setting=m.group(1) if m else path.parent.name,
                         request_rate=data.get("request_rate"),  # a number, or "inf": all at once
                         **{k: data.get(k) for k in KEEP}))
    return sorted(rows, key=lambda r: (r["setting"], float(r["request_rate"])))


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for setting in sorted({r["setting"] for r in rows}):
        mine = [r for r in rows if r["setting"] == setting]
        rates = [float(r["request_rate"]) for r in mine]
        finite = max((x for x in rates if x != float("inf")), default=1)
        xs = [x if x != float("inf") else 2 * finite for x in rates]
        axes[0].plot(xs, [r["output_throughput"] for r in mine], "o-", label=setting)
        axes[1].plot(xs, [r["p99_tpot_ms"] for r in mine], "o-", label=setting)
    for ax, what in zip(axes, ("output tokens/s", "p99 TPOT (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("request rate (req/s; rightmost: all at once)")
        ax.set_ylabel(what)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("experiment_dir")
    p.add_argument("--out", required=True)
    p.add_argument("--command", required=True, help="the sweep command, recorded as run")
    p.add_argument("--note", default="", help="what the settings hold (model, codebooks)")
    a = p.parse_args()
    rows = rows_of(Path(a.experiment_dir))
    if not rows:
        print(f"no run=*.json under {a.experiment_dir}", file=sys.stderr)
        return 1
    prov = provenance()
    prov["command"] = a.command
    with open(a.out, "w") as f:
        json.dump(dict(prov, note=a.note, rows=rows), f, indent=1)
    plot(rows, os.path.splitext(a.out)[0] + ".png")
    for r in rows:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
