"""The report's plots (PNG, matplotlib's Agg backend, so they draw on a machine without a display).

Small on purpose: 100 dpi, a few tens of KB each, no timestamp or software version in the file,
so the same rows and the same matplotlib give the same bytes. matplotlib comes with the
`examples` extra; it is imported only when a plot is drawn.
"""

from __future__ import annotations

import io
from pathlib import Path

from .tables import (
    ATTENTION_NAMES,
    PASS_NAMES,
    decode_best_other,
    dims_order,
    dims_text,
    gpt_model_name,
    gpt_sorted,
    head_dims,
)

DPI = 100
PALETTE = 64
STYLE = {  # provider -> (color, marker), the same in every plot
    "fusedlayers": ("tab:red", "o"),
    "fusedlayers-portable": ("tab:orange", "v"),
    "sdpa-flash": ("tab:blue", "s"),
    "sdpa-cudnn": ("tab:green", "^"),
    "sdpa-efficient": ("tab:gray", "x"),
    "flex": ("tab:purple", "D"),
}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    """PNG at DPI, reduced to a palette of PALETTE colors: a few flat colors and their
    antialiased edges need no more, and it makes the file about a third of the RGBA one."""
    from PIL import Image

    buffer = io.BytesIO()
    fig.savefig(buffer, dpi=DPI, format="png", metadata={"Software": None})
    _pyplot().close(fig)
    image = Image.open(buffer).convert("RGB").quantize(PALETTE, dither=Image.Dither.NONE)
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path, format="png", optimize=True)
    return path


def _seqlen_axis(ax, lengths: list[int]) -> None:
    """A log2 axis ticked at the measured lengths, labelled 1k, 4k, ..."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [f"{n // 1024}k" if n % 1024 == 0 else str(n) for n in lengths])
    ax.minorticks_off()


def attention_plot_name(d: int, d_v: int | None = None) -> str:
    """attention-d128.png; attention-d192x128.png for d_qk 192 with d_v 128."""
    return f"attention-d{d}.png" if d_v in (None, d) else f"attention-d{d}x{d_v}.png"


def attention_plot(rows: list[dict], d: int, path: Path, d_v: int | None = None) -> Path:
    """TFLOP/s against sequence length per provider at head dim `d` (d_qk; values `d_v`, d when
    None): one panel per (causal, pass) of the sweep rows (the first dtype present)."""
    plt = _pyplot()
    dims = (d, d if d_v is None else d_v)
    sweep = [r for r in rows if r["case"] == "sweep" and head_dims(r) == dims]
    dtype = sorted({r["dtype"] for r in sweep})[0]
    sweep = [r for r in sweep if r["dtype"] == dtype]
    panels = sorted({(bool(r["causal"]), r["pass"]) for r in sweep})
    cols = min(2, len(panels))
    nrows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.0 * nrows), squeeze=False)
    names = [n for n in ATTENTION_NAMES if any(n in r["providers"] for r in sweep)]
    for ax, (causal, pass_) in zip(axes.flat, panels):
        here = [r for r in sweep if (bool(r["causal"]), r["pass"]) == (causal, pass_)]
        for name in names:
            points = sorted(
                (r["s_q"], r["providers"][name]["tflops"])
                for r in here
                if r["providers"].get(name, {}).get("status") == "ok"
            )
            if points:
                color, marker = STYLE.get(name, ("black", "."))
                xs, ys = zip(*points)
                ax.plot(xs, ys, color=color, marker=marker, label=ATTENTION_NAMES[name])
        _seqlen_axis(ax, sorted({r["s_q"] for r in here}))
        mask = "causal" if causal else "no mask"
        ax.set_title(f"d={dims_text(*dims)}, {mask}, {PASS_NAMES.get(pass_, pass_)}")
        ax.set_xlabel("sequence length")
        ax.set_ylabel("TFLOP/s")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    heads = {r["hq"] for r in sweep}
    # h = 2048/d where d divides 2048, else the nearest whole head count the run used
    h = "2048/d" if all(r["hq"] * d == 2048 for r in sweep) else "/".join(map(str, sorted(heads)))
    fig.suptitle(f"Attention, {dtype}, b = 16384/s, h = {h}", fontsize=10)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    return _save(fig, path)


def sweep_dims(rows: list[dict]) -> list[tuple[int, int]]:
    """(d_qk, d_v) of every head dim the sweep rows measured, in the tables' order."""
    sweep = sorted((r for r in rows if r["case"] == "sweep"), key=dims_order)
    return list(dict.fromkeys(head_dims(r) for r in sweep))


def attention_plots(rows: list[dict], directory: Path) -> list[Path]:
    """An `attention_plot_name` PNG for every head dim of the sweep rows; [] without any."""
    return [
        attention_plot(rows, d, Path(directory) / attention_plot_name(d, d_v), d_v)
        for d, d_v in sweep_dims(rows)
    ]


def decode_plot(rows: list[dict], path: Path) -> Path:
    """Decode attention: ours' time per call (one token for every sequence) against the cache
    length, a line per batch (solid: graph replays, dashed: eager calls), and beside it the
    best other provider's time over ours on the same cells (> 1: ours is faster)."""
    plt = _pyplot()
    from matplotlib.ticker import FuncFormatter

    fig, (left, right) = plt.subplots(1, 2, figsize=(9.0, 3.4))
    colors = ("tab:red", "tab:blue", "tab:green", "tab:purple", "tab:orange", "tab:gray")
    modes = sorted({r.get("mode", "eager") for r in rows}, key=lambda m: (m != "graph", m))
    for color, b in zip(colors * 4, sorted({r["b"] for r in rows})):
        for mode in modes:
            here = sorted((r for r in rows if r["b"] == b and r.get("mode", "eager") == mode),
                          key=lambda r: r["s"])  # fmt: skip
            here = [r for r in here if "us" in r["providers"].get("ours", {})]
            if not here:
                continue
            xs = [r["s"] for r in here]
            ours = [r["providers"]["ours"]["us"] for r in here]
            best = [(decode_best_other(r) or (None, float("nan")))[1] for r in here]
            line = "-" if mode == "graph" else "--"
            label = f"b={b}, {mode}"
            left.plot(xs, ours, line, color=color, marker="o", label=label)
            right.plot(xs, [o / u for o, u in zip(best, ours)], line, color=color, marker="o")
    cache_lengths = sorted({r["s"] for r in rows})
    for ax in (left, right):
        _seqlen_axis(ax, cache_lengths)
        ax.set_xlabel("cache length (tokens)")
        ax.grid(True, alpha=0.3)
    left.set_yscale("log")
    left.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    left.set_ylabel("us per call (one token per sequence)")
    left.set_title("fusedlayers decode attention", fontsize=10)
    left.legend(fontsize=7)
    right.axhline(1.0, color="black", linewidth=0.8)
    right.set_ylabel("best other / ours (> 1: ours faster)")
    right.set_title("against the best of SDPA's backends and FlexAttention", fontsize=10)
    fig.tight_layout()
    return _save(fig, path)


def gpt_plot(rows: list[dict], path: Path) -> Path:
    """Training step time per model, one bar per recorded (model, mode, batch)."""
    plt = _pyplot()
    ordered = gpt_sorted(rows)
    labels = [
        f"{gpt_model_name(r)}\n{r.get('mode', 'eager')}, batch {r.get('batch_size')}"
        + (", calling thread" if r.get("backward_on_calling_thread") else "")
        for r in ordered
    ]
    values = [r["ms_per_step"] for r in ordered]
    colors = ["tab:blue" if r.get("provider") == "plain" else "tab:red" for r in ordered]
    fig, ax = plt.subplots(figsize=(6.4, 0.55 * len(ordered) + 1.0))
    ax.barh(range(len(values)), values, color=colors)
    ax.set_yticks(range(len(values)), labels, fontsize=7)
    ax.invert_yaxis()
    for i, v in enumerate(values):
        ax.text(v, i, f" {v:.1f}", va="center", fontsize=7)
    ax.set_xlabel("ms per training step (lower is better)")
    ax.set_title("GPT training step time", fontsize=10)
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    return _save(fig, path)
