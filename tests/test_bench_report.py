"""The benchmark report (fusedlayers.bench.report): BENCHMARKS.md rendered from run JSON.

Synthetic runs in tests/fixtures/bench cover every kind but context parallelism (the missing
kind) and one file that is not a run; their numbers are chosen so that the ratios, geometric
means and ranges below are worked out by hand. Then the committed page: BENCHMARKS.md must be
exactly what the committed bench/*.json render, within the size limits the page promises.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from fusedlayers.bench import report, tables
from fusedlayers.bench.record import KINDS, read_run, write_run

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).resolve().parent / "fixtures" / "bench"
# A newer attention run of d=96 (21 heads) and d_qk 192 with d_v 128 (11 heads) cells, kept out
# of FIXTURES so the page above stays what the other tests read.
HEAD_DIMS_RUN = FIXTURES.parent / "bench-head-dims" / "attention-head-dims.json"
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    """The fixture runs rendered into a fresh directory laid out like the repository."""
    root = tmp_path_factory.mktemp("page")
    shutil.copytree(FIXTURES, root / "bench")
    text, plots = report.render(root / "bench", root / "BENCHMARKS.md", root / "docs" / "img")
    return root, text, plots


def _section(text: str, title: str) -> list[str]:
    """The lines of one `## title` section."""
    lines = text.splitlines()
    start = lines.index(f"## {title}")
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), None)
    return lines[start:end]


def test_summary_geometric_means_and_ranges(page):
    # d=64 forward at s >= 4k, two cells (causal and not), fusedlayers 1 ms in both:
    # cuDNN 1.21 and 1.0 ms -> geometric mean sqrt(1.21) = 1.10; SDPA-flash 2.0 and 0.5 -> 1.00;
    # Flex 4.0 and 1.0 -> 2.00. The s = 1k cells stay out of it.
    summary = _section(page[1], "Summary")
    assert "| d=64 forward | 1.10x (1.00-1.21) | 1.00x (0.50-2.00) | 2.00x (1.00-4.00) |" in summary
    # forward+backward: cuDNN 0.81 and 1.0 -> 0.90; Flex failed in both cells -> no ratio.
    assert "| d=64 forward+backward | 0.90x (0.81-1.00) | 1.00x (1.00-1.00) | - |" in summary
    # d=128, one cell at 2 ms: cuDNN 1.8 / 2 = 0.90, SDPA-flash 4 / 2, Flex 3 / 2.
    d128 = "| d=128 forward | 0.90x (0.90-0.90) | 2.00x (2.00-2.00) | 1.50x (1.50-1.50) |"
    assert d128 in summary
    # GQA 16/8 at d=128, s=4k, after the sweep's d=128 rows: SDPA-flash 1.5 ms / ours 1 ms.
    gqa = "| d=128 GQA 16/8 forward | - | 1.50x (1.50-1.50) | - |"
    assert summary.index(gqa) == summary.index(d128) + 1
    # GPT: plain 60 ms / ours 50 ms eager, 45 / 45 compiled (from a second run of the kind);
    # decode: plain compiled 0.6 / ours' graph 0.5 ms per token at batch 1, 0.9 / 1.0 at 4.
    rows = [line for line in summary if line.startswith("| gpt-test")]
    assert rows == [
        "| gpt-test training, eager, ms/step (batch 8 x 2048) | 50.0 | 60.0 | 1.20x |",
        "| gpt-test training, compiled, ms/step (batch 8 x 2048) | 45.0 | 45.0 | 1.00x |",
        "| gpt-test decode, batch 1, ms/token (CUDA graph vs compiled) | 0.500 | 0.600 | 1.20x |",
        "| gpt-test decode, batch 4, ms/token (CUDA graph vs compiled) | 1.000 | 0.900 | 0.90x |",
    ]


def test_attention_table_takes_newer_cells_and_keeps_the_rest(page):
    section = _section(page[1], "Attention")
    head = next(line for line in section if line.startswith("| d | s |"))
    assert head == (
        "| d | s | causal | pass | fusedlayers | SDPA-flash | cuDNN | FlexAttention | vs cuDNN | "
        "vs SDPA-flash | vs FlexAttention | MiB, ours / SDPA-flash |"
    )
    rows = [line for line in section if line.startswith(("| 64 |", "| 128 |"))]
    assert len(rows) == 8  # 9 rows in the older run, one replaced by the newer run's cell
    assert rows[:4] == [
        # The newer run's d=64 s=1k cell: 4e11 FLOPs in 0.5 ms = 800 TFLOP/s, the others 1 ms.
        "| 64 | 1024 | 0 | fwd | 800 | 400 | 400 | 400 | 2.00 | 2.00 | 2.00 | 120 / 200 |",
        "| 64 | 1024 | 1 | fwd | 400 | 400 | 400 | 400 | 1.00 | 1.00 | 1.00 | 120 / 200 |",
        # 4e11 / 1.21 ms = 331 TFLOP/s; Flex raised in the fwdbwd rows: "error", no ratio.
        "| 64 | 4096 | 0 | fwd | 400 | 200 | 331 | 100 | 1.21 | 2.00 | 4.00 | 120 / 200 |",
        "| 64 | 4096 | 0 | fwdbwd | 400 | 400 | 494 | error | 0.81 | 1.00 |  | 120 / 200 |",
    ]
    # One row per case and shape, a column pair per pass the cases have (forward only here).
    gqa = "| gqa | bf16 | 128 | s=4096, b=4, h=16:8 | fusedlayers | 400 | SDPA-flash 1.50 |"
    assert gqa in section
    setups = [line for line in section if line.startswith("- Setup: ")]
    assert len(setups) == 2  # a list, oldest first; each names the cells it supplies
    assert setups[0].startswith(
        "- Setup: 2026-01-01 00:00 UTC; Test GPU 80GB (driver 555.55); torch 2.0.0, Triton 3.0.0, "
        "cuDNN 90000, Python 3.12.0; fusedlayers 0.1.0 at abc1234; bf16 8192^3 matmul 700 TFLOP/s"
    )
    assert setups[0].endswith(
        "[attention.json](bench/attention.json) (cells: s = 1024, 4096; gqa)."
    )
    assert "at def5678-dirty" in setups[1] and setups[1].endswith("(cells: s = 1024).")


def _table_after(lines: list[str], head_start: str) -> list[list[str]]:
    """The cells of the markdown table whose head row starts with `head_start`, head included,
    the |---| row left out."""
    start = next(i for i, line in enumerate(lines) if line.startswith(head_start))
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        if not line.startswith("|---"):
            rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


@pytest.fixture(scope="module")
def head_dims_page(tmp_path_factory):
    """The fixture runs plus HEAD_DIMS_RUN, rendered like `page`."""
    root = tmp_path_factory.mktemp("head-dims-page")
    shutil.copytree(FIXTURES, root / "bench")
    shutil.copy(HEAD_DIMS_RUN, root / "bench")
    bench, out, img = root / "bench", root / "BENCHMARKS.md", root / "docs" / "img"
    return report.render(bench, out, img, draw=False)


def test_head_dims_and_split_pairs_add_their_rows_and_change_nothing_else(page, head_dims_page):
    before, after = page[1], head_dims_page[0]
    # The summary gains a row per (head dims, pass), sorted by head dim, the split pair labelled
    # d_qk/d_v. d=96 forward, ours 1 ms in both cells: cuDNN 1.1 and 0.9 ms -> sqrt(0.99) =
    # 0.99; d=192/128, one cell: cuDNN 2.4 / 2.0 ms, Flex 3 / 2, SDPA-flash unsupported.
    old = _section(before, "Summary")
    expected = list(old)
    d96 = "| d=96 forward | 0.99x (0.90-1.10) | 2.00x (2.00-2.00) | 1.50x (1.50-1.50) |"
    expected.insert(old.index(next(line for line in old if line.startswith("| d=128 "))), d96)
    after_gqa = expected.index("| d=128 GQA 16/8 forward | - | 1.50x (1.50-1.50) | - |") + 1
    expected[after_gqa:after_gqa] = [
        "| d=192/128 forward | 1.20x (1.20-1.20) | - | 1.50x (1.50-1.50) |",
        "| d=192/128 forward+backward | 0.80x (0.80-0.80) | - | 2.00x (2.00-2.00) |",
    ]
    assert _section(after, "Summary") == expected
    assert after.split("## Summary")[0] == before.split("## Summary")[0]
    for title in ("GPT training", "Generation", "Decode attention"):
        assert _section(after, title) == _section(before, title)
    assert _section(after, "Method") == _section(before, "Method")

    # The page's cell table keeps to d = 64 and 128 (`report.TABLE_DIMS`): unchanged.
    old_table = _table_after(_section(before, "Attention"), "| d | s |")
    assert _table_after(_section(after, "Attention"), "| d | s |") == old_table
    # The new dims' cells as `tables.attention_sweep` renders them: an h column (h*d differs
    # between rows). TFLOP/s count each matmul at its head dim: the split pair's forward is
    # 2*4*11*4096^2*(192 + 128) FLOPs in 2 ms = 236 TFLOP/s, its forward+backward 3.6 times that
    # in 5 ms = 340.
    cells = _table_after(tables.attention_sweep(read_run(HEAD_DIMS_RUN)["rows"]), "| d | h | s |")
    assert cells[0] == [old_table[0][0], "h", *old_table[0][1:]]
    assert [row[:5] for row in cells[1:]] == [
        ["96", "21", "4096", "0", "fwd"],
        ["96", "21", "4096", "1", "fwd"],
        ["192/128", "11", "4096", "0", "fwd"],
        ["192/128", "11", "4096", "0", "fwdbwd"],
    ]
    assert cells[3][5:] == ["236", "unsupported", "197", "157", "1.20", "", "1.50", "120 / -"]
    assert cells[4][5:7] == ["340", "unsupported"]

    # Besides the summary, the section gains the head-dim notes, the note on what the table
    # lists, the new run's Setup line, and the plots' line gains the new dims' plots.
    def rest(lines: list[str]) -> list[str]:
        return [line for line in lines if line.strip() and not line.startswith(("|", "!["))]

    gained = rest(_section(after, "Attention"))
    for line in rest(_section(before, "Attention")):
        gained.remove(line)
    assert gained[0].startswith("Head dims that do not divide 2048 run h = round(2048/d) heads")
    assert gained[1].startswith("d = A/B: q and k have head dim A, v and the output B;")
    setup = next(line for line in gained if line.startswith("- Setup: 2026-01-03 00:00 UTC;"))
    assert setup.endswith(
        "[attention-head-dims.json](bench/attention-head-dims.json) (cells: s = 4096)."
    )
    assert gained[-1].startswith("The table lists d = 64 and 128;")
    assert len(gained) == 5, gained
    images = [line for line in _section(after, "Attention") if line.startswith("![")]
    assert images == [
        " ".join(
            f"![attention TFLOP/s, d={d}](docs/img/attention-d{name}.png)"
            for d, name in (("64", "64"), ("96", "96"), ("128", "128"), ("192/128", "192x128"))
        )
    ]
    assert [p.name for p in head_dims_page[1]][:4] == [
        "attention-d64.png",
        "attention-d96.png",
        "attention-d128.png",
        "attention-d192x128.png",
    ]


def test_row_keys_tell_a_split_pair_from_its_query_head_dim():
    """ROW_KEYS: a d_qk 192 / d_v 128 row never replaces a d=192 row of an older run; a row
    written before d_v was recorded reads as d_v = d, so a newer d=192 row replaces it."""
    base = dict(case="sweep", dtype="bf16", s_q=4096, s_k=4096, hq=11, hkv=11, tokens=16384)
    base |= {"pass": "fwd", "causal": False, "window": None}
    old_192, split, new_192 = (
        {**base, "d": 192},
        {**base, "d": 192, "d_v": 128},
        {**base, "d": 192, "d_v": 192},
    )
    key = report.ROW_KEYS["attention"]
    runs = [report.Run(Path("old.json"), {}, [old_192]), report.Run(Path("new.json"), {}, [split])]
    assert [(run.path.name, rows) for run, rows in report.overlay(runs, key)] == [
        ("old.json", [old_192]),
        ("new.json", [split]),
    ]
    runs[1] = report.Run(Path("new.json"), {}, [new_192])
    used = report.overlay(runs, key)
    assert [(run.path.name, rows) for run, rows in used] == [("new.json", [new_192])]


def test_other_sections_and_a_kind_without_runs(page):
    text = page[1]
    gpt = _section(text, "GPT training")
    assert (
        "| fusedlayers[bshd] | eager | gpt-test, 8 x 2048 | 50.0 | 327,680 | 25.0% | 1.20x | "
        "17.5 | 10.9713 | 7.5000 |"
    ) in gpt
    generate = _section(text, "Generation")
    # vs plain in the same mode: eager 4.0 / 5.0, the graph against compiled 0.6 / 0.5.
    assert "| 1 | fusedlayers, eager | 10.0 | 5.000 | 200 | 1.1 | 100.0% | 0.80x |" in generate
    assert "| 1 | fusedlayers, CUDA graph | 10.0 | 0.500 | 2,000 | 1.1 | 100.0% | 1.20x |" in (
        generate
    )
    assert "| 4 | fusedlayers, eager | skipped: needs CUDA |  |  |  |  |  |" in generate
    decode = _section(text, "Decode attention")
    # b=1, 1k tokens: 2*1*1024*8*128*2 bytes in 10 us = 419 GB/s; cuDNN 12 us of the others.
    assert "| 1 | 1024 | 10.0 | 419 | 11.0 (1.100) | 12.0 (cuDNN) | 1.20x |" in decode
    assert "| 8 | 8192 | 1280.0 | 210 | 1408.0 (1.100) | 1536.0 (cuDNN) | 1.20x |" in decode
    titles = [line for line in decode if line.startswith("**")]
    assert titles == [
        "**graph** (device copy 3000 GB/s, read + write; timing floor 4.5 us):",
        "**eager** (device copy 3000 GB/s, read + write; timing floor 4.5 us):",
    ]
    # A table section with no run is left out (this page has no context_parallel run).
    assert "## Context parallelism" not in text.splitlines()


def test_plots_are_small_pngs(page):
    root, text, plots = page
    names = ["attention-d64.png", "attention-d128.png", "gpt.png", "decode.png"]
    assert [p.name for p in plots] == names
    for path in plots:
        data = path.read_bytes()
        assert data[:8] == PNG and 2_000 < len(data) < 100_000, (path.name, len(data))
        assert f"](docs/img/{path.name})" in text  # linked relative to the page


def test_render_is_deterministic_and_the_command_writes_and_checks(page, tmp_path):
    root, text, _ = page
    again, _ = report.render(root / "bench", root / "BENCHMARKS.md", root / "docs/img", draw=False)
    assert again == text
    shutil.copytree(FIXTURES, tmp_path / "bench")  # the same layout: the same links
    out, plots = tmp_path / "BENCHMARKS.md", tmp_path / "docs" / "img"
    argv = ["--bench-dir", str(tmp_path / "bench"), "--out", str(out), "--plots", str(plots)]
    assert report.main([*argv, "--check"]) == 1  # nothing written yet: stale
    assert report.main(argv) == 0
    assert out.read_text() == text and (plots / "decode.png").exists()
    assert report.main([*argv, "--check"]) == 0


def test_overlay_prefers_the_newest_run_per_row(tmp_path):
    row = lambda s, ms: {"batch": s, "provider": "ours-graph", "ms_per_token": ms}
    write_run(tmp_path / "b.json", "generate", {"date": "2026-01-02 00:00 UTC"}, [row(1, 2.0)])
    write_run(tmp_path / "a.json", "generate", {"date": "2026-01-03 00:00 UTC"}, [row(4, 3.0)])
    write_run(tmp_path / "c.json", "generate", {"date": "2026-01-01 00:00 UTC"},
              [row(1, 9.0), row(4, 9.0)])  # fmt: skip
    runs = report.load_runs(tmp_path)["generate"]
    assert [r.path.name for r in runs] == ["c.json", "b.json", "a.json"]  # by date
    used = report.overlay(runs, report.ROW_KEYS["generate"])
    assert [(run.path.name, rows) for run, rows in used] == [
        ("b.json", [row(1, 2.0)]),
        ("a.json", [row(4, 3.0)]),
    ]  # c.json supplies nothing any more: no Setup line for it


def test_write_run_refuses_unknown_kinds_and_reads_back(tmp_path):
    with pytest.raises(ValueError, match="kind 'training'"):
        write_run(tmp_path / "x.json", "training", {}, [])
    run = write_run(tmp_path / "x.json", "decode", {"gpu": "g"}, [{"b": 1}])
    assert read_run(tmp_path / "x.json") == run and set(KINDS) == set(report.ROW_KEYS)
    (tmp_path / "y.json").write_text('{"rows": []}')
    with pytest.raises(ValueError, match="not a benchmark run"):
        read_run(tmp_path / "y.json")


def test_geometric_mean_by_hand():
    assert tables.geomean([2.0, 8.0]) == pytest.approx(4.0)
    assert tables.spread([2.0, 8.0, 4.0]) == "4.00x (2.00-8.00)"
    assert tables.spread([]) == "-"


def test_committed_page_is_current_and_small(tmp_path):
    """BENCHMARKS.md is exactly what `python -m fusedlayers.bench report` renders from the
    committed bench/*.json (rendered here into a copy laid out the same way), at most 250
    lines, and bench/ holds at most 1 MB. Stale? Run the command and commit the result."""
    shutil.copytree(ROOT / "bench", tmp_path / "bench")
    text, plots = report.render(
        tmp_path / "bench", tmp_path / "BENCHMARKS.md", tmp_path / "docs" / "img", draw=False
    )
    committed = (ROOT / "BENCHMARKS.md").read_text()
    assert committed == text, "BENCHMARKS.md is stale: run `python -m fusedlayers.bench report`"
    assert len(committed.splitlines()) <= 250
    assert sum(p.stat().st_size for p in (ROOT / "bench").rglob("*") if p.is_file()) <= 2**20
    for plot in plots:  # the committed page's plots are committed beside it
        assert (ROOT / "docs" / "img" / plot.name).read_bytes()[:8] == PNG


def test_dynamic_shapes_section_from_a_run(tmp_path):
    """The loops' run renders as one row per loop and provider, numbers as recorded."""
    shutil.copytree(FIXTURES, tmp_path / "bench")
    rows = [
        dict(loop="dense", provider="fusedlayers", calls=150, total_s=46.25, first_s=9.5,
             median_ms=2.8, max_after_fifth_ms=4100.0, stalls=6, stall_calls=[89]),
        dict(loop="dense", provider="sdpa", calls=150, total_s=0.31, first_s=0.05,
             median_ms=1.75, max_after_fifth_ms=2.5, stalls=0, stall_calls=[]),
    ]  # fmt: skip
    write_run(tmp_path / "bench" / "dynamic.json", "dynamic_shapes", {"date": "2026-11-28"}, rows)
    text, _ = report.render(tmp_path / "bench", tmp_path / "B.md", tmp_path / "img", draw=False)
    section = _section(text, "Shapes that change every call")
    assert "| dense | fusedlayers | 150 | 46.25 | 9.50 | 2.80 | 6 |" in section
    assert "| dense | sdpa | 150 | 0.31 | 0.05 | 1.75 | 0 |" in section
    assert not any(line.startswith("No dynamic_shapes run") for line in section)


def test_transformers_section_from_a_run(tmp_path):
    """The Llama training run renders one row per run, each timed against the first sdpa run of
    its mode and padding: 100 ms against 80 ms is 1.250x, the repeated sdpa run 100 / 125."""
    shutil.copytree(FIXTURES, tmp_path / "bench")
    common = dict(mode="eager", padding=False, tokens_per_s=1000.0, peak_mem_gib=10.0)
    rows = [
        dict(run="sdpa", ms_per_step_median=100.0, **common),
        dict(run="fusedlayers", ms_per_step_median=80.0, **common),
        dict(run="sdpa-repeat", ms_per_step_median=125.0, **common),
    ]
    write_run(tmp_path / "bench" / "hf.json", "transformers", {"date": "2026-11-28"}, rows)
    text, _ = report.render(tmp_path / "bench", tmp_path / "B.md", tmp_path / "img", draw=False)
    section = _section(text, "Hugging Face transformers training")
    assert "| sdpa | eager | no | 100.0 | 1,000 | 10.0 | 1.000x |" in section
    assert "| fusedlayers | eager | no | 80.0 | 1,000 | 10.0 | 1.250x |" in section
    assert "| sdpa-repeat | eager | no | 125.0 | 1,000 | 10.0 | 0.800x |" in section


def test_gpt_rows_compare_within_their_model_size():
    """Two model sizes at one batch and mode: each fusedlayers row's `vs plain` is against the
    plain model of its own size (the 1.3b row paired with the 125m plain row would read 0.17x)."""

    def row(config, provider, ms):
        model = "fusedlayers[bshd]" if provider == "fusedlayers" else "pytorch_sdpa_cudnn"
        return dict(model=model, provider=provider, config=config, mode="eager", batch_size=8,
                    context_length=2048, ms_per_step=ms, tokens_per_s=1.0, mfu=0.1,
                    peak_mem_gib=1.0, first_loss=11.0, final_loss=5.0)  # fmt: skip

    rows = [row("gpt-125m", "plain", 60.0), row("gpt-125m", "fusedlayers", 50.0),
            row("gpt-1.3b", "plain", 372.0), row("gpt-1.3b", "fusedlayers", 310.0)]  # fmt: skip
    lines = tables.gpt_table(rows)
    assert any("| gpt-125m, 8 x 2048 | 50.0 |" in line and "| 1.20x |" in line for line in lines)
    assert any("| gpt-1.3b, 8 x 2048 | 310.0 |" in line and "| 1.20x |" in line for line in lines)
