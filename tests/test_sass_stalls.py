"""examples/perf/sass_stalls.py: partitions and stall shares from an Nsight Compute source page."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples" / "perf"))

import sass_stalls  # noqa: E402

REASONS = ["stall_long_sb", "stall_wait", "stall_long_sb (Not Issued)"]


def _write(path: Path, body: list[tuple[str, int, int, int]]) -> None:
    header = ["Address", "Source", sass_stalls.SAMPLES, *REASONS]
    with open(path, "w", newline="") as f:
        w = csv.writer(f, quoting=csv.QUOTE_ALL)
        w.writerow(["Kernel Name", "_attn_bwd_sm90", ""])
        w.writerow(header)
        for i, (src, long_sb, wait, not_issued) in enumerate(body):
            w.writerow([hex(i * 16), f"      {src}", long_sb + wait, long_sb, wait, not_issued])


def test_partitions_split_at_register_changes_and_shares_add_up(tmp_path):
    body = [
        ("LDC R1, c[0x0][0x28]", 1, 0, 0),
        ("USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xf0", 0, 2, 0),
        ("HGMMA.64x64x16.F32.BF16 R152, gdesc[UR20], RZ, !UPT", 90, 0, 7),
        ("FADD R1, R2, R3", 0, 10, 0),
        ("USETMAXREG.DEALLOC.CTAPOOL 0x18", 0, 0, 0),
        ("@!P0  BRA 0x7fd5597de960", 300, 0, 0),
    ]
    path = tmp_path / "page.csv"
    _write(path, body)
    ins = sass_stalls.read_source_page(str(path))
    assert [i.samples for i in ins] == [1, 2, 90, 10, 0, 300]
    assert ins[2].stalls == {"long_sb": 90}  # the "(Not Issued)" column is not a reason
    parts = sass_stalls.partitions(ins)
    assert [(name, [i.index for i in part]) for name, part in parts] == [
        ("entry", [0]),
        ("try_alloc.ctapool 0xf0", [1, 2, 3]),
        ("dealloc.ctapool 0x18", [4, 5]),
    ]
    text = sass_stalls.summary(ins, top=1)
    # The consumer stretch: 102 samples, 90 of them long_sb on the HGMMA; the entry (1 sample of
    # 403) is under 2% and left out.
    assert "try_alloc.ctapool 0xf0 (from SASS line 1): 102 samples, 25.3% of the kernel" in text
    assert "long_sb 88.2%" in text and "HGMMA" in text
    assert "dealloc.ctapool 0x18 (from SASS line 4): 300 samples, 74.4%" in text
    assert "entry" not in text
