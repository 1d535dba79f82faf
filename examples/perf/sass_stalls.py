"""Where a kernel's warps wait, per warp-specialized partition and per SASS instruction, from
Nsight Compute's source page.

    ncu --profile-from-start off --kernel-name regex:_attn_bwd_sm90 --launch-count 1 \\
        --section SourceCounters --export bwd python examples/perf/ncu_sm90_backward.py
    ncu --import bwd.ncu-rep --page source --csv --print-source sass > bwd-sass.csv
    python examples/perf/sass_stalls.py bwd-sass.csv [--top 20]

The Gluon kernels split their warps into partitions that each set their register count
(`setmaxnreg`, `USETMAXREG` in SASS), so the stretches between those instructions are the
partitions' code (in the order the compiler laid them out; the first stretch after the entry is
the default partition). For each stretch the script prints the share of warp samples per stall
reason and the instructions with the most samples, so a stall can be traced to its instruction
(a `DEPBAR` on a scoreboard, an mbarrier wait's branch, a fence) and from there to the source.
"""

from __future__ import annotations

import argparse
import csv
from collections import Counter
from dataclasses import dataclass, field

SAMPLES = "Warp Stall Sampling (All Samples)"


@dataclass
class Instruction:
    index: int
    source: str
    samples: int
    stalls: dict[str, int] = field(default_factory=dict)


def read_source_page(path: str) -> list[Instruction]:
    """The instructions of the first kernel in an `ncu --page source --csv` export."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    header_at = next(i for i, row in enumerate(rows) if "Source" in row and SAMPLES in row)
    header = rows[header_at]
    col = {name: i for i, name in enumerate(header)}
    reasons = [h for h in header if h.startswith("stall_") and "(Not Issued)" not in h]
    out = []
    for row in rows[header_at + 1 :]:
        if len(row) < len(header):
            break  # the next kernel's block, or the end
        stalls = {r[len("stall_") :]: int(row[col[r]] or 0) for r in reasons}
        out.append(
            Instruction(
                index=len(out),
                source=row[col["Source"]].strip(),
                samples=int(row[col[SAMPLES]] or 0),
                stalls={k: v for k, v in stalls.items() if v},
            )
        )
    return out


def partitions(instructions: list[Instruction]) -> list[tuple[str, list[Instruction]]]:
    """Stretches of code between register-count changes, named by the count they set."""
    out, start, name = [], 0, "entry"
    for ins in instructions:
        if "SETMAXREG" in ins.source:
            if ins.index > start:
                out.append((name, instructions[start : ins.index]))
            start = ins.index
            name = f"{ins.source.split()[0].split('.', 1)[-1].lower()} {ins.source.split()[-1]}"
    out.append((name, instructions[start:]))
    return out


def summary(instructions: list[Instruction], top: int) -> str:
    lines = []
    total = sum(i.samples for i in instructions) or 1
    for name, part in partitions(instructions):
        samples = sum(i.samples for i in part)
        if samples * 50 < total:  # under 2% of the kernel's samples: skip
            continue
        reasons = Counter()
        for ins in part:
            reasons.update(ins.stalls)
        shares = ", ".join(f"{r} {100 * v / samples:.1f}%" for r, v in reasons.most_common(6))
        lines.append(f"== {name} (from SASS line {part[0].index}): {samples} samples, "
                     f"{100 * samples / total:.1f}% of the kernel; {shares}")  # fmt: skip
        for ins in sorted(sorted(part, key=lambda i: -i.samples)[:top], key=lambda i: i.index):
            main = ", ".join(f"{r} {v}" for r, v in Counter(ins.stalls).most_common(2))
            lines.append(f"{ins.index:6d} {100 * ins.samples / samples:5.1f}%  "
                         f"{ins.source[:64]:64s} {main}")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("csv", help="ncu --page source --csv --print-source sass output")
    p.add_argument("--top", type=int, default=20, help="instructions listed per partition")
    args = p.parse_args()
    print(summary(read_source_page(args.csv), args.top))


if __name__ == "__main__":
    main()
