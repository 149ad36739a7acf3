"""Instruction mix and warp stalls of one kernel from Nsight Compute's source page
(``ncu --import R --page source --csv --print-source sass``): executed instructions by
opcode, per 32-token chunk of (KV head, token) work when ``--chunks`` is given, and the
share of each stall reason over all sampled warp states.

    python eval/ncu_summary.py report.csv --chunks 65536
"""

import argparse
import collections
import csv


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("csv")
    p.add_argument("--chunks", type=int, default=0, help="32-token chunks the launch did")
    a = p.parse_args()
    rows = list(csv.reader(open(a.csv)))
    start = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    hdr, data = rows[start], rows[start + 1:]
    ix = {h: i for i, h in enumerate(hdr)}
    stall_cols = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
    ops, stalls = collections.Counter(), collections.Counter()
    for r in data:
        if len(r) < len(hdr) or not r[ix["Source"]].split():
            continue
        words = r[ix["Source"]].split()
        op = (words[1] if words[0].startswith("@") else words[0]).split(".")[0]
        ops[op] += int(r[ix["Instructions Executed"]] or 0)
        for s in stall_cols:
            stalls[s] += int(r[ix[s]] or 0)
    total = sum(ops.values())
    print(f"{a.csv}: {total:,} warp instructions executed"
          + (f", {total / a.chunks:.0f} per 32-token chunk" if a.chunks else ""))
    for op, n in ops.most_common(20):
        per = f"  {n / a.chunks:7.1f} per chunk" if a.chunks else ""
        print(f"  {op:8s} {n:12,d} {100 * n / total:5.1f}%{per}")
    sampled = sum(stalls.values()) or 1
    print("warp stall samples: " + ", ".join(
        f"{k.removeprefix('stall_')} {100 * v / sampled:.1f}%" for k, v in stalls.most_common(10)))


if __name__ == "__main__":
    main()
