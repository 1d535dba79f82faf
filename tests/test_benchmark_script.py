"""The attention benchmark's CPU-checkable parts: FLOP counts, presets, writers, the pipeline.

The benchmark (fusedlayers.bench.attention, also run as examples/benchmark_attention.py) needs
a CUDA GPU; here its counting and reporting are checked against brute force and synthetic
results, and its whole case/check/report pipeline runs on tiny CPU shapes with stand-ins for
the GPU-only pieces (timing, memory, the Triton kernels).
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from attention_testing import KernelSpy
from fusedlayers.kernels import _flash_bwd, _flash_fwd

from fusedlayers.bench import attention as ba
from fusedlayers.bench import attention_cases as cases
from fusedlayers.bench import common as bu
from fusedlayers.bench.record import read_run

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
sys.path[:0] = [str(EXAMPLES), str(EXAMPLES / "perf")]  # the wrapper script; tune_attention


def brute_force_pairs(s_q: int, s_k: int, window: tuple[int, int]) -> int:
    """Visible (i, j) pairs by testing each one against the bottom-right window rule."""
    left, right = window
    off = s_k - s_q
    count = 0
    for i in range(s_q):
        for j in range(s_k):
            ok_left = left < 0 or j >= i + off - left
            ok_right = right < 0 or j <= i + off + right
            count += ok_left and ok_right
    return count


WINDOWS = [(-1, -1), (-1, 0), (0, 0), (2, 0), (3, 1), (-1, 2), (5, -1), (0, 3), (40, 0)]
SHAPES = [(1, 1), (7, 7), (5, 9), (9, 5), (16, 3), (3, 16), (33, 33)]


@pytest.mark.parametrize("s_q,s_k", SHAPES)
@pytest.mark.parametrize("window", WINDOWS)
def test_visible_pairs_matches_brute_force(s_q, s_k, window):
    assert bu.visible_pairs(s_q, s_k, window) == brute_force_pairs(s_q, s_k, window)


def test_top_left_alignment_shifts_the_diagonal():
    # Top-left causal with s_q < s_k: query i sees keys 0..i.
    assert bu.visible_pairs(3, 8, (-1, 0), bottom_right=False) == 1 + 2 + 3


@pytest.mark.parametrize("s_q,s_k", SHAPES)
@pytest.mark.parametrize("window", WINDOWS)
def test_flops_count_visible_pairs(s_q, s_k, window):
    b, h, d = 3, 5, 16
    flops = bu.attention_flops(b, h, s_q, s_k, d, window=window)
    square_causal = window == (-1, 0) and s_q == s_k
    pairs = s_q * s_k / 2 if square_causal else brute_force_pairs(s_q, s_k, window)
    assert flops == 4 * b * h * d * pairs
    assert bu.attention_flops(b, h, s_q, s_k, d, window=window, pass_="fwdbwd") == 3.5 * flops


def test_flops_paper_conventions():
    # The anchors' numbers: dense 4*b*h*s*s*d, causal exactly half of it.
    dense = bu.attention_flops(4, 16, 4096, 4096, 128)
    assert dense == 4 * 4 * 16 * 4096 * 4096 * 128
    assert bu.attention_flops(4, 16, 4096, 4096, 128, causal=True) == dense / 2
    # Half differs from the exact causal count only by the diagonal: s/2 pairs.
    assert brute_force_pairs(64, 64, (-1, 0)) - 64 * 64 / 2 == 32
    # Causal with s_q != s_k is not "half": bottom-right, 2 queries over 5 keys see 4 + 5.
    assert bu.attention_flops(1, 1, 2, 5, 1, causal=True) == 4 * 9


def test_flops_count_each_matmul_over_its_head_dim():
    """d_qk 3 with d_v 2, 2 queries over 3 keys, no mask: 6 pairs. Forward: QK^T 2*6*3 = 36 and
    PV 2*6*2 = 24. Backward: S again, dQ and dK over d_qk (3 * 36) and dP, dV over d_v
    (2 * 24): 156 more."""
    assert bu.attention_flops(1, 1, 2, 3, 3, d_v=2) == 60
    assert bu.attention_flops(1, 1, 2, 3, 3, d_v=2, pass_="fwdbwd") == 60 + 156
    # b and h multiply; square causal halves both passes, as with one head dim.
    assert bu.attention_flops(2, 5, 4, 4, 3, d_v=2, causal=True) == 2 * 5 * (2 * 8 * 3 + 2 * 8 * 2)
    # The benchmark's split pair: d_qk 192, d_v 128 on 11 heads, fwdbwd 1 + 832/320 = 3.6x.
    fwd = bu.attention_flops(4, 11, 4096, 4096, 192, d_v=128)
    assert fwd == 2 * 4 * 11 * 4096 * 4096 * (192 + 128)
    assert bu.attention_flops(4, 11, 4096, 4096, 192, d_v=128, pass_="fwdbwd") == 3.6 * fwd
    # d_v == d is the papers' count, whether d_v is given or not.
    same = bu.attention_flops(4, 16, 4096, 4096, 128, d_v=128, pass_="fwdbwd")
    assert same == bu.attention_flops(4, 16, 4096, 4096, 128, pass_="fwdbwd")
    assert same == 3.5 * 4 * 4 * 16 * 4096 * 4096 * 128
    assert bu.attention_work(1, 1, 2, 3, 3, d_v=2) == {"fwd": 60, "fwdbwd": 216}


def test_sliding_window_flops_closed_form():
    s, left = 16384, 4096
    pairs = sum(min(i, left) + 1 for i in range(s))
    assert pairs == (left + 1) * s - left * (left + 1) // 2
    assert (
        bu.attention_flops(1, 16, s, s, 128, causal=True, window=(left, 0)) == 4 * 16 * 128 * pairs
    )


def test_rel_err_never_passes_nan():
    ref = torch.ones(4)
    assert bu.rel_err(ref * 1.01, ref) == pytest.approx(0.01, rel=1e-4)
    assert bu.rel_err(torch.tensor([1.0, float("nan"), 1, 1]), ref) == float("inf")


def test_presets_and_overrides():
    standard = ba.parse_args([])
    assert (standard.preset, standard.dtypes) == ("standard", ["bf16"])
    assert standard.dims == [(64, 64), (128, 128)]  # (d_qk, d_v)
    assert standard.seqlens == [1024, 4096, 16384]
    assert standard.passes == ["fwd", "fwdbwd"] and standard.causal == [False, True]
    assert standard.cases == list(ba.CASES) and standard.providers == list(ba.PROVIDERS)
    assert (standard.warmup, standard.rep, standard.time_limit) == (25, 100, 480)
    full = ba.parse_args(["--full"])
    assert (full.dtypes, full.dims) == (["bf16", "fp16"], [(64, 64), (128, 128), (256, 256)])
    assert full.seqlens == [512, 1024, 2048, 4096, 8192, 16384]
    picked = ba.parse_args(
        [
            "--full",
            "--dtypes",
            "fp16",
            "--dims",
            "256",
            "--providers",
            "fusedlayers,flex",
            "--passes",
            "fwd",
            "--causal",
            "1",
            "--cases",
            "sweep,window",
        ]
    )
    assert (picked.dtypes, picked.dims, picked.seqlens) == (["fp16"], [(256, 256)], full.seqlens)
    assert picked.providers == ["fusedlayers", "flex"] and picked.passes == ["fwd"]
    assert picked.causal == [True] and picked.cases == ["sweep", "window"]


@pytest.mark.parametrize(
    "argv",
    [
        ["--quick", "--full"],
        ["--quick", "--head-dims"],
        ["--seqlens", "3000"],
        ["--dims", "0"],
        ["--dims", "192x"],
        ["--dims", "192x0"],
        ["--dims", "64x64x64"],
        ["--dims", "d128"],
        ["--gqa-seqlens", "5000"],
        ["--gqa-kv-heads", "3"],
        ["--providers", "fa3"],
        ["--dtypes", "fp8"],
        ["--passes", "bwd"],
        ["--extra-seqlen", "5000"],
    ],
)
def test_bad_arguments_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        ba.parse_args(argv)


def test_quick_preset_is_the_summary_cells_against_the_anchors():
    """--quick (two minutes or less on an H100): the cells the summary reads, s >= 4k at both
    head dims, causal and not, both passes, against cuDNN, SDPA-flash and FlexAttention, with a
    shorter do_bench and a time limit; explicit flags still win over it."""
    quick = ba.parse_args(["--quick"])
    assert quick.preset == "quick"
    assert quick.providers == ["fusedlayers", "sdpa-flash", "sdpa-cudnn", "flex"]
    assert (quick.warmup, quick.rep, quick.time_limit) == (10, 30, 90)
    assert quick.passes == ["fwd", "fwdbwd"]
    cells = [(c.kind, c.dtype, c.d, c.s, c.causal) for c in ba.build_cases(quick)]
    assert cells == [
        ("sweep", "bf16", d, s, causal)
        for d in (64, 128)
        for s in (4096, 16384)
        for causal in (False, True)
    ]
    with_1k = ba.parse_args(["--quick", "--seqlens", "1024,4096,16384", "--rep", "50"])
    assert len(ba.build_cases(with_1k)) == 12 and with_1k.rep == 50
    assert with_1k.providers == quick.providers


def test_help_runs_as_a_module():
    """`python -m fusedlayers.bench attention --help` works without a GPU and names the quick
    preset's estimate; the old script path answers the same."""
    run = subprocess.run(
        [sys.executable, "-m", "fusedlayers.bench", "attention", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    help_text = " ".join(run.stdout.split())
    assert "--quick" in run.stdout and "107 s wall on a fresh H200" in help_text
    assert "--head-dims" in run.stdout and "192x128" in help_text
    script = subprocess.run(
        [sys.executable, str(EXAMPLES / "benchmark_attention.py"), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert script.returncode == 0 and script.stdout == run.stdout


def test_standard_cases_keep_tokens_and_hidden_fixed():
    cases = ba.build_cases(ba.parse_args([]))
    kinds = [c.kind for c in cases]
    assert kinds.count("sweep") == 2 * 3 * 2
    assert (kinds.count("gqa"), kinds.count("varlen"), kinds.count("packed")) == (4, 2, 2)
    assert kinds.count("window") == 1
    for c in cases:
        tokens = sum(c.lengths) if c.lengths else c.b * c.s
        assert tokens == 16384
        if c.kind == "sweep":
            assert c.hq * c.d == 2048 and c.hkv == c.hq
    assert {(c.hq, c.hkv) for c in cases if c.kind == "gqa"} == {(32, 8), (32, 1)}


def test_dims_name_split_pairs_and_round_the_head_count():
    """`AxB` is d_qk A with d_v B; a head dim that does not divide 2048 runs round(2048/d_qk)
    heads (80 -> 25.6 -> 26, 192 -> 10.7 -> 11), every shape b*s = 16384 tokens."""
    args = ba.parse_args(["--dims", "64,80,192x128", "--seqlens", "4096", "--cases", "sweep"])
    assert args.dims == [(64, 64), (80, 80), (192, 128)]
    shapes = [(c.d, c.d_v, c.hq, c.hkv, c.b, c.s, c.causal) for c in ba.build_cases(args)]
    assert shapes == [
        (64, 64, 32, 32, 4, 4096, False),
        (64, 64, 32, 32, 4, 4096, True),
        (80, 80, 26, 26, 4, 4096, False),
        (80, 80, 26, 26, 4, 4096, True),
        (192, 128, 11, 11, 4, 4096, False),
        (192, 128, 11, 11, 4, 4096, True),
    ]
    assert ba.build_cases(args)[-1].label == "sweep bf16 d=192/128 s=4096 b=4 h=11 causal=1"
    assert ba.heads_for(4096) == 1 and ba.heads_for(8192) == 1  # at least one head


def test_head_dims_preset_is_the_head_dim_and_gqa_cells():
    """--head-dims: d 64..256 and (192, 128) at 4k, 8k, 16k, causal and not, and GQA 32/8 at
    d = 128 at the same lengths, against the three anchors with --quick's do_bench; the
    standard preset keeps its GQA cases (32/8 and 32/1 at --extra-seqlen)."""
    args = ba.parse_args(["--head-dims"])
    assert (args.preset, args.dtypes, args.passes) == ("head-dims", ["bf16"], ["fwd", "fwdbwd"])
    assert args.providers == ["fusedlayers", "sdpa-flash", "sdpa-cudnn", "flex"]
    assert (args.warmup, args.rep, args.time_limit) == (10, 30, 420)
    cases = ba.build_cases(args)
    dims = [(64, 64), (80, 80), (96, 96), (128, 128), (160, 160), (192, 192), (256, 256)]
    lengths, causal = (4096, 8192, 16384), (False, True)
    sweep = [(c.d, c.d_v, c.s, c.causal) for c in cases if c.kind == "sweep"]
    assert sweep == [
        (d, dv, s, c) for d, dv in [*dims, (192, 128)] for s in lengths for c in causal
    ]
    gqa = [(c.d, c.d_v, c.hq, c.hkv, c.s, c.causal) for c in cases if c.kind == "gqa"]
    assert sorted(gqa) == sorted((128, 128, 32, 8, s, c) for s in lengths for c in causal)
    assert len(cases) == len(sweep) + len(gqa) == 54
    assert all(c.b * c.s == 16384 and c.hq == round(2048 / c.d) for c in cases if c.kind == "sweep")
    standard = ba.parse_args([])
    assert (standard.gqa_seqlens, standard.gqa_kv_heads) == ([4096], [8, 1])
    picked = ba.parse_args(["--head-dims", "--gqa-kv-heads", "1", "--cases", "gqa"])
    assert {(c.hkv, c.s) for c in ba.build_cases(picked)} == {(1, s) for s in lengths}


def test_random_lengths_sum_to_total():
    lengths = bu.random_lengths(16384, random.Random(0))
    assert sum(lengths) == 16384 and min(lengths) > 0 and max(lengths) <= 4096


def _result(ms, flops=1e12, mem=100.0, status="ok"):
    if status != "ok":
        return {"status": status, "error": "RuntimeError: no kernel"}
    return {
        "status": "ok",
        "ms": ms,
        "flops": flops,
        "tflops": bu.tflops(flops, ms),
        "mem_mib": mem,
        "relerr": {"out": 1e-3},
    }


def _row(**providers):
    row = {
        "case": "sweep",
        "dtype": "bf16",
        "d": 128,
        "b": 4,
        "hq": 16,
        "hkv": 16,
        "s_q": 4096,
        "s_k": 4096,
        "causal": True,
        "window": None,
        "pass": "fwd",
        "tokens": 16384,
        "seqs": 4,
        "subject": "fusedlayers",
        "mem_baseline": "sdpa-flash",
        "notes": ["n1"],
        "providers": providers,
    }
    return bu.finish_row(row)


def test_ratios_and_memory_flag():
    row = _row(
        fusedlayers=_result(2.0, mem=120),
        **{"sdpa-flash": _result(3.0, mem=100)},
        flex=_result(1.0),
        **{"sdpa-cudnn": _result(0, status="error")},
    )
    assert row["ratios"] == {"sdpa-flash": 1.5, "flex": 0.5}
    assert row["mem_flag"]  # 120 > 1.1 * 100
    ok = _row(fusedlayers=_result(2.0, mem=109), **{"sdpa-flash": _result(3.0, mem=100)})
    assert not ok["mem_flag"]


def test_finish_writes_the_run_and_plots_and_prints_the_summary(tmp_path):
    rows = [
        _row(
            fusedlayers=_result(2.0),
            **{"sdpa-flash": _result(4.0)},
            **{"sdpa-cudnn": _result(0, status="error")},
        ),
        _row(fusedlayers=_result(0, status="wrong"), **{"sdpa-flash": _result(4.0)}),
    ]
    header = {"date": "2026-11-22 10:00 UTC", "gpu": "test", "command": "python x.py"}
    args = ba.parse_args(["--out", str(tmp_path)])
    text = ba.finish(args, header, rows)
    run = read_run(tmp_path / "attention.json")
    assert (run["kind"], run["header"], run["rows"]) == ("attention", header, rows)
    lines = text.splitlines()
    table = [line for line in lines if line.startswith("| 128 | 4096 | 1 | fwd |")]
    assert len(table) == 2
    # 1e12 FLOPs in 2 ms and 4 ms: 500 and 250 TFLOP/s, SDPA-flash's time / ours = 2.00;
    # cuDNN raised (error, no ratio); the second row's subject was wrong (no ratio at all).
    assert table[0] == "| 128 | 4096 | 1 | fwd | 500 | 250 | error |  | 2.00 | 100 / 100 |"
    assert table[1] == "| 128 | 4096 | 1 | fwd | WRONG | 250 |  |  |  | - / 100 |"
    assert "| d=128 forward | - | 2.00x (2.00-2.00) | - |" in lines
    png = tmp_path / "attention-d128.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {png}" in lines


def test_merge_joins_runs(tmp_path):
    for i, name in enumerate(("a", "b")):
        header = {"date": "d", "command": f"run {name}"}
        rows = [_row(fusedlayers=_result(1.0 + i))]
        ba.write_run(tmp_path / f"{name}.json", "attention", header, rows)
    header, rows = ba.merge_runs([str(tmp_path / "a.json"), str(tmp_path / "b.json")])
    assert header["command"] == "run a ; run b" and len(rows) == 2
    assert [r["providers"]["fusedlayers"]["ms"] for r in rows] == [1.0, 2.0]


def _fake_flash_attn_func(q, k, v, causal=False, window_size=(-1, -1)):
    left, right = window_size
    ws = (left, 0) if causal else (left, right)
    return bu_reference()(q, k, v, window_size=ws, bottom_right=True)


def _fake_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=False, window_size=(-1, -1)):
    ws = (window_size[0], 0) if causal else window_size
    return bu_reference()(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_k, window_size=ws)


def bu_reference():
    from fusedlayers.attention.reference import attention_reference

    return attention_reference


def _call(fn, value: float) -> float:
    fn()  # runs the provider's pass, so a failing backward still fails here
    return value


@pytest.fixture
def cpu_pipeline(monkeypatch):
    """Tiny shapes on the CPU: the reference stands in for the kernels, a call for the timer."""
    import fusedlayers

    for name, value in (
        ("TOKENS", 64),
        ("HIDDEN", 32),
        ("EXTRA_DIM", 8),
        ("GQA_HEADS", (4, (2, 1))),
        ("WINDOW_SEQLEN", 64),
        ("WINDOW", (8, 0)),
    ):
        monkeypatch.setattr(ba, name, value)
    monkeypatch.setattr(cases, "DEVICE", "cpu")
    monkeypatch.setattr(cases, "MASK_REF_BACKENDS", ("MATH",))
    monkeypatch.setattr(bu, "bench_ms", lambda fn, *args, **kwargs: _call(fn, 1.0))
    monkeypatch.setattr(bu, "peak_extra_mib", lambda fn, leaves: _call(fn, 10.0))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(fusedlayers, "flash_attn_func", _fake_flash_attn_func, raising=False)
    monkeypatch.setattr(fusedlayers, "flash_attn_varlen_func", _fake_varlen, raising=False)
    return fusedlayers


def _tiny_run(tmp_path, flags: str) -> list[dict]:
    """run_all on the tiny CPU shapes; `flags` is the command line after the common part.
    The run it wrote after its last case holds the rows it returns."""
    common = f"--dims 8 --extra-seqlen 32 --out {tmp_path} "
    rows = ba.run_all(ba.parse_args((common + flags).split()), {"command": "test"})
    assert read_run(tmp_path / "attention.json")["rows"] == json.loads(json.dumps(rows))
    return rows


def test_pipeline_runs_checks_and_reports_on_cpu(cpu_pipeline, tmp_path):
    rows = _tiny_run(tmp_path, "--seqlens 32 --providers fusedlayers,sdpa-flash,sdpa-cudnn")
    assert {r["case"] for r in rows} == set(ba.CASES)
    for row in rows:
        subject = row["providers"][row["subject"]]
        assert subject["status"] == "ok", (row["case"], subject)
        assert max(subject["relerr"].values()) < ba.TOLERANCE["bf16"]
        assert "dq" in subject["relerr"]
    sweep = [r for r in rows if r["case"] == "sweep"]
    for row in sweep:  # no CPU cuDNN: reported unsupported with SDPA's reason, never timed
        cudnn = row["providers"]["sdpa-cudnn"]
        assert cudnn["status"] == "unsupported" and cudnn["error"]
    varlen = [r for r in rows if r["case"] == "varlen"][0]
    assert "fusedlayers-dense" in varlen["providers"] and varlen["seqs"] > 1
    # The equal-length dense batch is checked against its own reference before it is timed.
    assert varlen["providers"]["fusedlayers-dense-equal"]["status"] == "ok"
    text = ba.finish(SimpleNamespace(out=str(tmp_path), no_plot=True), {"command": "test"}, rows)
    # The cases beyond the sweep: one table, a row per case and shape with both passes' columns.
    assert "| forward TFLOP/s | vs (time ratio) | forward+backward TFLOP/s |" in text
    for case in ("gqa", "varlen", "packed", "window"):
        case_rows = [
            line for line in text.splitlines() if line.startswith(f"| {case} | bf16 | 8 |")
        ]
        assert case_rows and all(line.count("|") == 10 for line in case_rows), case_rows
    assert "| 8 | 32 | 0 | fwdbwd |" in text  # the sweep table


def test_a_wrong_provider_is_reported_not_timed(cpu_pipeline, monkeypatch, tmp_path):
    wrong = lambda *a, **kw: _fake_flash_attn_func(*a, **kw) * 1.5
    monkeypatch.setattr(cpu_pipeline, "flash_attn_func", wrong)
    timed = []
    monkeypatch.setattr(bu, "bench_ms", lambda fn, *a, **kw: timed.append(fn) or 1.0)
    flags = "--seqlens 64 --cases sweep --causal 1 --providers fusedlayers,sdpa-flash"
    rows = _tiny_run(tmp_path, flags)
    assert [r["providers"]["fusedlayers"]["status"] for r in rows] == ["wrong", "wrong"]
    assert len(timed) == 2  # sdpa-flash's two passes only
    text = ba.finish(SimpleNamespace(out=str(tmp_path), no_plot=True), {}, rows)
    table = [line for line in text.splitlines() if line.startswith("| 8 | 64 | 1 |")]
    assert [line.split(" | ")[4] for line in table] == ["WRONG", "WRONG"]


class _NoBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("backward not supported for this head dim")


def test_a_failing_backward_still_times_the_forward(cpu_pipeline, monkeypatch, tmp_path):
    no_bwd = lambda *a, **kw: _NoBackward.apply(_fake_flash_attn_func(*a, **kw))
    monkeypatch.setattr(cpu_pipeline, "flash_attn_func", no_bwd)
    rows = _tiny_run(tmp_path, "--seqlens 64 --cases sweep --causal 0 --providers fusedlayers")
    fwd, fwdbwd = (r["providers"]["fusedlayers"] for r in rows)
    assert fwd["status"] == "ok"
    assert fwdbwd["status"] == "error" and "head dim" in fwdbwd["error"]


def test_pipeline_runs_a_split_head_dim_pair_on_cpu(cpu_pipeline, monkeypatch, tmp_path):
    """d_qk 12 with d_v 8 (h = round(32/12) = 3): fusedlayers gets v and dout at d_v, is checked
    against SDPA's math backend (SDPA-flash refuses d_v != d_qk) and timed with the FLOPs of
    each matmul at its head dim; SDPA-flash is reported unsupported with SDPA's reason and never
    timed."""
    seen = []

    def fused(q, k, v, **kwargs):
        seen.append((q.shape[-1], k.shape[-1], v.shape[-1]))
        return _fake_flash_attn_func(q, k, v, **kwargs)

    monkeypatch.setattr(cpu_pipeline, "flash_attn_func", fused)
    timed = []
    monkeypatch.setattr(bu, "bench_ms", lambda fn, *a, **kw: timed.append(fn) or 1.0)
    flags = "--dims 12x8 --seqlens 32 --cases sweep --causal 1 --providers fusedlayers,sdpa-flash"
    rows = _tiny_run(tmp_path, flags)
    shapes = [(r["d"], r["d_v"], r["hq"], r["b"], r["pass"]) for r in rows]
    assert shapes == [(12, 8, 3, 2, "fwd"), (12, 8, 3, 2, "fwdbwd")]
    assert set(seen) == {(12, 12, 8)}
    # 2 sequences x 3 heads x 32*32/2 causal pairs: forward 2*(12 + 8) FLOPs a pair, the
    # backward 2*(3*12 + 2*8) more.
    pairs = 2 * 3 * 32 * 32 // 2
    work = {"fwd": 2 * 20 * pairs, "fwdbwd": 2 * 20 * pairs + 2 * 52 * pairs}
    for row in rows:
        ours = row["providers"]["fusedlayers"]
        assert ours["status"] == "ok" and ours["flops"] == work[row["pass"]]
        assert set(ours["relerr"]) == {"out", "dq", "dk", "dv"}
        assert max(ours["relerr"].values()) < ba.TOLERANCE["bf16"]
        assert "checked against sdpa-math" in row["notes"]
        flash = row["providers"]["sdpa-flash"]
        assert flash["status"] == "unsupported" and "same last dimension" in flash["error"]
    assert len(timed) == 2  # fusedlayers' two passes only
    text = ba.finish(SimpleNamespace(out=str(tmp_path), no_plot=True), {}, rows)
    table = [line for line in text.splitlines() if line.startswith("| 12/8 | 32 | 1 |")]
    assert [line.split(" | ")[3:6] for line in table] == [
        ["fwd", "0", "unsupported"],
        ["fwdbwd", "0", "unsupported"],
    ]


def test_sdpa_refusal_reads_the_reason_and_raises_other_errors():
    from fusedlayers.bench.common import Unsupported

    q, k = torch.randn(1, 2, 16, 24), torch.randn(1, 2, 16, 24)
    v = torch.randn(1, 2, 16, 8)
    flash = lambda: cases._sdpa_call("FLASH_ATTENTION", [q, k, v], False, None, False)
    reason = cases._sdpa_refusal(flash)
    assert reason and "Triggered internally" not in reason and not reason.endswith(":")
    math = lambda: cases._sdpa_call("MATH", [q, k, v], False, None, False)
    assert cases._sdpa_refusal(math) is None

    def broken():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    with pytest.raises(RuntimeError, match="illegal memory access"):
        cases._sdpa_refusal(broken)
    data = (q, k, v, torch.randn(1, 2, 16, 8))
    with pytest.raises(Unsupported, match="same last dimension"):
        cases._sdpa_runner("sdpa-flash", "FLASH_ATTENTION", data, {}, False)


def test_repeated_kv_grads_sum_over_each_group_at_their_own_head_dims():
    """SDPA runs that repeat k/v for GQA: dk [.., d_qk] and dv [.., d_v] each fold back."""
    dq, dk = torch.zeros(1, 4, 3, 6), torch.ones(1, 4, 3, 6)
    dv = torch.arange(4.0).view(1, 4, 1, 1).expand(1, 4, 3, 2).contiguous()
    _, (_, gk, gv) = cases._canon_repeated(2, None, [dq, dk, dv])
    assert gk.shape == (1, 2, 3, 6) and bool((gk == 2).all())
    assert gv.shape == (1, 2, 3, 2) and gv[0, :, 0, 0].tolist() == [1.0, 5.0]


def test_tuning_sweep_jobs_and_best_per_pass():
    """tune_attention: each backward candidate keeps the other pass at its table entry, and the
    best candidate per pass is the least total over causal and not (inf = failed a check)."""
    import tune_attention as ta
    from fusedlayers.kernels import _flash_bwd

    jobs = ta.sweep_jobs([128], 4096, fwd=True, bwd=True)
    table = _flash_bwd.BWD_CONFIGS[128]
    dkdv = [j for j in jobs if j.get("half") == "dkdv"]
    dq = [j for j in jobs if j.get("half") == "dq"]
    assert len(dkdv) == 2 * len(ta.BWD_SWEEP[128]["dkdv"])
    assert all(tuple(j["cfg"][4:]) == table[4:] for j in dkdv)
    assert all(tuple(j["cfg"][:4]) == table[:4] for j in dq)
    assert sum(j["kind"] == "fwd" for j in jobs) == 2 * len(ta.FWD_SWEEP[128])
    # A head dim between the table's entries tunes the entry serving it (160: 256's).
    wide = [j for j in ta.sweep_jobs([160], 4096, fwd=False, bwd=True) if j["half"] == "dkdv"]
    assert len(wide) == 2 * len(ta.BWD_SWEEP[256]["dkdv"])
    assert all(tuple(j["cfg"][4:]) == _flash_bwd.BWD_CONFIGS[256][4:] for j in wide)

    def row(cfg, causal, ms, half="dkdv"):
        return dict(kind="bwd", d=128, half=half, causal=causal, cfg=cfg, ms=ms)

    a, b = (1, 2, 3, 4, 9, 9, 9, 9), (5, 6, 7, 8, 9, 9, 9, 9)
    rows = [row(a, False, 1.0), row(a, True, 3.0), row(b, False, 2.0), row(b, True, 1.5)]
    assert ta.best_per_pass(rows) == {("bwd", 128, "dkdv"): (5, 6, 7, 8)}
    rows[2]["ms"] = float("inf")  # b failed its check once: never the best
    assert ta.best_per_pass(rows) == {("bwd", 128, "dkdv"): (1, 2, 3, 4)}


def test_tuning_atomic_jobs():
    """tune_attention --atomic: every candidate, causal and not, best over both (whole launch)."""
    import tune_attention as ta

    jobs = ta.sweep_jobs([64], 4096, fwd=False, bwd=False, atomic=True)
    assert {j["kind"] for j in jobs} == {"atomic"}
    assert sorted(tuple(j["cfg"]) for j in jobs) == sorted(2 * ta.ATOMIC_SWEEP[64])
    rows = [dict(j, ms=float(i)) for i, j in enumerate(jobs)]
    assert ta.best_per_pass(rows) == {("atomic", 64, "dkdv"): tuple(jobs[0]["cfg"])}


@pytest.mark.parametrize("causal", [False, True])
def test_tuning_runners_launch_the_kernels(device, causal, monkeypatch):
    """tune_attention's forward, two-pass and atomic runners launch the kernels with a swept
    config and return what the reference computes (on the interpreter the backward runs its own
    tiles; the runners still swap the table entry of d=64, a table key)."""
    import tune_attention as ta

    from fusedlayers.attention.reference import attention_reference

    g = torch.Generator().manual_seed(7)
    q, k, v, dout = (torch.randn(1, 40, 2, 64, generator=g).to(device) for _ in range(4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    window = (-1, 0) if causal else (-1, -1)
    ref = attention_reference(*leaves, softmax_scale=64**-0.5, window_size=window)
    ref_grads = torch.autograd.grad(ref, leaves, dout)
    out = ta.forward_runner(q, k, v, causal, (32, 16, 4, 1))()
    assert torch.allclose(out, ref, atol=2e-5)
    # The interpreter takes unknown keywords that a CUDA launch refuses: check the names too.
    jit = _flash_fwd._attn_fwd.fn
    with pytest.MonkeyPatch.context() as patch:  # only around the direct launch
        patch.setattr(_flash_fwd._attn_fwd, "fn", spy := KernelSpy(jit))
        ta.forward_runner(q, k, v, causal, (32, 16, 4, 1))()
    assert set(spy.launches[0]) <= set(jit.arg_names) | {"num_warps", "num_stages"}
    grads = ta.backward_runner(q, k, v, dout, causal, (16, 16, 4, 1, 16, 16, 4, 1))()
    spy = KernelSpy(_flash_bwd._flash_bwd_dkdv_kernel)
    monkeypatch.setattr(_flash_bwd, "_flash_bwd_dkdv_kernel", spy)
    atomic = ta.backward_runner(q, k, v, dout, causal, (16, 16, 4, 1), atomic=True)()
    assert [launch["ATOMIC_DQ"] for launch in spy.launches] == [True]
    for got in (grads, atomic):
        for a, r in zip(got, ref_grads):
            assert torch.allclose(a, r, atol=1e-4)


def test_tuning_backward_candidates_each_get_their_own_plan(device, monkeypatch):
    """tune_attention's two-pass runner reads the swapped table entry for every candidate: the
    backward's plan per call signature does not key on the table, so a plan kept from the first
    candidate would run its tiles for all the others (an H200 sweep timed 14 alike)."""
    import tune_attention as ta

    read = []
    real = _flash_bwd.bwd_config
    monkeypatch.setattr(_flash_bwd, "bwd_config", lambda *a, **kw: read.append(a) or real(*a, **kw))
    g = torch.Generator().manual_seed(3)
    q, k, v, dout = (torch.randn(1, 24, 2, 64, generator=g).to(device) for _ in range(4))
    for cfg in ((16, 16, 4, 1, 16, 16, 4, 1), (32, 16, 4, 1, 16, 32, 4, 1)):
        ta.backward_runner(q, k, v, dout, False, cfg)()
    assert len(read) == 2
    assert not _flash_bwd._PLANS  # no candidate's plan is left for later calls


def test_autotune_note_names_new_picks_and_their_timings(monkeypatch):
    """A provider whose first call autotuned the forward gets a note with the pick and the
    candidates' measured times; one that reused earlier picks gets none; a pick answered from the
    autotuner's cache is named as such, without the previous tuning's times."""
    import triton

    fast, slow = (triton.Config({"BLOCK_M": m, "BLOCK_N": 64}, num_warps=4, num_stages=3)
                  for m in (64, 128))  # fmt: skip
    before = ba._forward_picks()
    assert ba.autotune_note("fusedlayers", before) == ""
    monkeypatch.setitem(_flash_fwd._PICKED, ("new signature",), fast)
    monkeypatch.setattr(_flash_fwd._attn_fwd, "configs_timings", {fast: [0.25], slow: [0.4]},
                        raising=False)  # fmt: skip
    note = ba.autotune_note("fusedlayers", before)
    assert note.startswith("fusedlayers: forward autotuned here to (64, 64, 4, 3)")
    assert "(64, 64, 4, 3) 0.250 ms" in note and "(128, 64, 4, 3) 0.400 ms" in note
    assert ba.autotune_note("fusedlayers", ba._forward_picks()) == ""
    # A new pick with no new timings came from the autotuner's cache: no stale times are shown.
    cached = ba.autotune_note("fusedlayers", before, ba._forward_timings())
    assert (
        cached
        == "fusedlayers: forward picked (64, 64, 4, 3) from the autotuner's cache (no new timing)"
    )
    # A config the note cannot read is reported, never raised into the provider's results.
    monkeypatch.setitem(_flash_fwd._PICKED, ("odd signature",), object())
    assert ba.autotune_note("fusedlayers", before).startswith("fusedlayers: no autotune note (")
