"""The report's markdown tables: pure functions of a benchmark's rows, one set per kind.

Every number is formatted with a fixed precision and every row and column comes in a fixed
order, so the same rows always give the same text (BENCHMARKS.md is checked byte for byte
against a fresh render). Ratios are computed here from the times, one convention throughout:
`vs X` = time of X / time of fusedlayers for the same job, so > 1 means fusedlayers is faster.
"""

from __future__ import annotations

import math

# Attention providers in column order, with the names the page uses.
ATTENTION_NAMES = {
    "fusedlayers": "fusedlayers",
    "fusedlayers-portable": "portable kernels",
    "sdpa-flash": "SDPA-flash",
    "sdpa-cudnn": "cuDNN",
    "sdpa-efficient": "SDPA-efficient",
    "flex": "FlexAttention",
}
ANCHORS = ("sdpa-cudnn", "sdpa-flash", "flex")  # the summary's columns, in its order
SUMMARY_MIN_S = 4096  # the summary reads the cells at s >= 4k, where kernels, not hosts, rule
PASS_NAMES = {"fwd": "forward", "fwdbwd": "forward+backward"}
# Each fusedlayers generation provider against the plain model in the same mode.
GENERATE_PLAIN = {"ours-eager": "plain-eager", "ours-graph": "plain-compiled"}
GENERATE_NAMES = {
    "ours-eager": "fusedlayers, eager",
    "ours-graph": "fusedlayers, CUDA graph",
    "plain-eager": "plain, eager",
    "plain-compiled": "plain, compiled",
}
DECODE_OURS = ("ours", "ours-paged")
DECODE_NAMES = {
    "sdpa": "SDPA",
    "sdpa-flash": "SDPA-flash",
    "sdpa-efficient": "SDPA-efficient",
    "sdpa-cudnn": "cuDNN",
    "flex": "FlexAttention",
}


def table(head: list[str], body: list[list[str]]) -> list[str]:
    """A markdown table's lines."""
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return lines + ["| " + " | ".join(cells) + " |" for cells in body]


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def spread(values: list[float]) -> str:
    """Geometric mean and range of ratios: `1.10x (1.07-1.12)`; `-` when there are none."""
    if not values:
        return "-"
    return f"{geomean(values):.2f}x ({min(values):.2f}-{max(values):.2f})"


def _ok(result: dict | None) -> bool:
    return bool(result) and result.get("status", "ok") == "ok" and "ms" in result


# ----------------------------------------------------------------------------- attention


def head_dims(row: dict) -> tuple[int, int]:
    """(d_qk, d_v) of an attention row; rows written before d_v was recorded have d_v = d."""
    return row["d"], row.get("d_v", row["d"])


def dims_text(d: int, d_v: int) -> str:
    """`128`, or `192/128` for d_qk 192 with d_v 128."""
    return str(d) if d_v == d else f"{d}/{d_v}"


def dims_label(row: dict) -> str:
    """The row's head dims as `dims_text` writes them."""
    return dims_text(*head_dims(row))


def dims_order(row: dict) -> tuple[int, bool, int]:
    """Sort key: by d_qk, a split pair (192/128) after the plain head dim (192)."""
    d, d_v = head_dims(row)
    return d, d_v != d, d_v


def has_split_dims(rows: list[dict]) -> bool:
    """Whether any row's values have another head dim than its queries and keys."""
    return any(len(set(head_dims(r))) > 1 for r in rows)


def heads_vary(rows: list[dict]) -> bool:
    """Whether the rows' h*d_qk differ (head dims that do not divide the hidden size run the
    nearest whole head count): the sweep table then shows h."""
    return len({r["hq"] * r["d"] for r in rows}) > 1


def attention_ratio(row: dict, name: str) -> float | None:
    """Time of provider `name` / time of the row's subject, both measured; else None."""
    subject, other = row["providers"].get(row["subject"]), row["providers"].get(name)
    if name == row["subject"] or not (_ok(subject) and _ok(other)):
        return None
    return other["ms"] / subject["ms"]


def _sweep_rows(rows: list[dict]) -> list[dict]:
    order = {p: i for i, p in enumerate(PASS_NAMES)}
    sweep = [r for r in rows if r["case"] == "sweep"]

    def key(r: dict) -> tuple:
        return r["dtype"], dims_order(r), r["s_q"], bool(r["causal"]), order.get(r["pass"], 9)

    return sorted(sweep, key=key)


# A summary group: (dtype, dims_order, heads, pass), heads () for the sweep (as many K/V heads as
# query heads) and (hq, hkv) for a GQA case.
SummaryKey = tuple[str, tuple[int, bool, int], tuple[int, ...], str]


def _summary_key(row: dict) -> SummaryKey | None:
    """The summary group of a row, None for a row the summary does not read: s < 4k, another
    subject, or a case other than the sweep and GQA."""
    if row["s_q"] < SUMMARY_MIN_S or row["subject"] != "fusedlayers":
        return None
    if row["case"] == "sweep":
        heads: tuple[int, ...] = ()
    elif row["case"] == "gqa" and not row.get("window"):
        heads = (row["hq"], row["hkv"])
    else:
        return None
    return row["dtype"], dims_order(row), heads, row["pass"]


def summary_ratios(rows: list[dict]) -> dict[SummaryKey, dict[str, list[float]]]:
    """{(dtype, (d_qk, split, d_v), heads, pass): {anchor: [ratio per cell at s >= 4k]}}, causal
    and not, in the summary's order: by dtype and head dim (a split pair after the plain one),
    the sweep then GQA (more KV heads first), forward then forward+backward."""
    order = {p: i for i, p in enumerate(PASS_NAMES)}
    out: dict[SummaryKey, dict[str, list[float]]] = {}
    for row in rows:
        key = _summary_key(row)
        if key is None:
            continue
        cell = out.setdefault(key, {a: [] for a in ANCHORS})
        for anchor in ANCHORS:
            ratio = attention_ratio(row, anchor)
            if ratio is not None:
                cell[anchor].append(ratio)
    by = lambda k: (k[0], k[1], len(k[2]), tuple(-n for n in k[2]), order.get(k[3], 9), k[3])
    return {key: out[key] for key in sorted(out, key=by)}


def _summary_label(key: SummaryKey) -> str:
    """`d=128 forward`, `d=192/128 forward+backward`, `d=128 GQA 32/8 forward`."""
    _, (d, _, d_v), heads, pass_ = key
    label = f"d={dims_text(d, d_v)}"
    if heads:
        label += f" GQA {heads[0]}/{heads[1]}"
    return f"{label} {PASS_NAMES.get(pass_, pass_)}"


def attention_summary(rows: list[dict]) -> list[str]:
    """fusedlayers against each anchor per head dim (and GQA shape) and pass: geometric mean
    (range) of the s >= 4k cells."""
    ratios = summary_ratios(rows)
    if not ratios:
        return [f"No attention sweep cells at s >= {SUMMARY_MIN_S} in the recorded runs."]
    dtypes = {key[0] for key in ratios}
    head = ["attention", *(f"vs {ATTENTION_NAMES[a]}" for a in ANCHORS)]
    body = []
    for key, cell in ratios.items():
        label = _summary_label(key)
        label = f"{key[0]} {label}" if len(dtypes) > 1 else label
        body.append([label, *(spread(cell[a]) for a in ANCHORS)])
    return table(head, body)


def _attention_cell(result: dict | None) -> str:
    if not result:
        return ""
    status = result.get("status", "ok")
    if status == "ok":
        return f"{result['tflops']:.0f}"
    return {"wrong": "WRONG", "skipped": "skip", "unsupported": "unsupported"}.get(status, "error")


def _providers(rows: list[dict]) -> list[str]:
    """Provider names in the rows: the known ones in column order, then any others sorted."""
    seen = {name for row in rows for name in row["providers"]}
    return [p for p in ATTENTION_NAMES if p in seen] + sorted(seen - set(ATTENTION_NAMES))


def attention_sweep(rows: list[dict]) -> list[str]:
    """TFLOP/s per provider and cell, fusedlayers' ratios to the anchors, memory."""
    sweep = _sweep_rows(rows)
    if not sweep:
        return []
    names, dtypes = _providers(sweep), {r["dtype"] for r in sweep}
    anchors = [a for a in ANCHORS if a in names]
    show_heads = heads_vary(sweep)
    head = ["dtype"] if len(dtypes) > 1 else []
    head += ["d", *(["h"] if show_heads else []), "s", "causal", "pass"]
    head += [ATTENTION_NAMES.get(n, n) for n in names]
    head += [f"vs {ATTENTION_NAMES[a]}" for a in anchors] + ["MiB, ours / SDPA-flash"]
    body = []
    for row in sweep:
        cells = [row["dtype"]] if len(dtypes) > 1 else []
        cells += [dims_label(row), *([str(row["hq"])] if show_heads else [])]
        cells += [str(row["s_q"]), str(int(bool(row["causal"]))), row["pass"]]
        cells += [_attention_cell(row["providers"].get(n)) for n in names]
        ratios = [attention_ratio(row, a) for a in anchors]
        cells += ["" if r is None else f"{r:.2f}" for r in ratios]
        mems = [row["providers"].get(n, {}).get("mem_mib") for n in (row["subject"], "sdpa-flash")]
        cells.append(" / ".join("-" if m is None else f"{m:.0f}" for m in mems))
        body.append(cells)
    return table(head, body)


def _shape(row: dict) -> str:
    if row["case"] == "varlen":
        return f"{row['tokens']} tokens in {row['seqs']} sequences"
    shape = f"s={row['s_q']}, b={row['b']}, h={row['hq']}"
    if row["hkv"] != row["hq"]:
        shape += f":{row['hkv']}"
    if row.get("window"):
        shape += f", window ({row['window'][0]}, {row['window'][1]})"
    return shape + (", causal" if row["causal"] and not row.get("window") else "")


def attention_other(rows: list[dict]) -> list[str]:
    """The cases beyond the sweep (GQA, varlen, packed, window), one row per case and shape with
    a column pair per pass: the subject's TFLOP/s and its time ratio to every other provider."""
    passes = [p for p in PASS_NAMES if any(r["pass"] == p for r in rows if r["case"] != "sweep")]
    cells: dict[tuple, dict[str, dict]] = {}
    for row in rows:
        if row["case"] != "sweep":
            key = (row["case"], row["dtype"], dims_order(row), _shape(row), row["subject"])
            cells.setdefault(key, {"row": row})[row["pass"]] = row
    body = []
    for key in sorted(cells):
        first = cells[key]["row"]
        line = [first["case"], first["dtype"], dims_label(first), _shape(first), first["subject"]]
        for name in passes:
            row = cells[key].get(name)
            if row is None:
                line += ["-", "-"]
                continue
            others = sorted(n for n in row["providers"] if n != row["subject"])
            ratios = [(n, attention_ratio(row, n)) for n in others]
            vs = ", ".join(
                f"{ATTENTION_NAMES.get(n, n)} {r:.2f}" for n, r in ratios if r is not None
            )
            line += [_attention_cell(row["providers"].get(row["subject"])), vs or "-"]
        body.append(line)
    head = ["case", "dtype", "d", "shape", "subject"]
    for name in passes:
        head += [f"{PASS_NAMES[name]} TFLOP/s", "vs (time ratio)"]
    return table(head, body) if body else []


# ----------------------------------------------------------------------------- GPT training


def gpt_group(row: dict) -> tuple:
    """What a row is compared within: mode, model size, batch and thread."""
    return (
        row.get("mode", "eager"),
        row.get("config", ""),
        row.get("batch_size"),
        row.get("context_length"),
        bool(row.get("backward_on_calling_thread")),
    )


def _gpt_plain(rows: list[dict], row: dict) -> dict | None:
    same = [r for r in rows if r.get("provider") == "plain" and gpt_group(r) == gpt_group(row)]
    return same[0] if same else None


def gpt_sorted(rows: list[dict]) -> list[dict]:
    modes = {"eager": 0, "compiled": 1}
    key = lambda r: (modes.get(r.get("mode"), 2), *gpt_group(r)[1:], r.get("provider") == "plain")
    return sorted(rows, key=key)


def _gpt_mode(row: dict) -> str:
    mode = row.get("mode", "eager")
    return mode + (
        ", backward on the calling thread" if row.get("backward_on_calling_thread") else ""
    )


def gpt_model_name(row: dict) -> str:
    return "plain PyTorch + SDPA cuDNN" if row.get("provider") == "plain" else row["model"]


def gpt_table(rows: list[dict]) -> list[str]:
    """ms/step, tokens/s, MFU, the plain model's time over ours, memory and losses per model."""
    head = ["model", "mode", "size, batch", "ms/step", "tokens/s", "MFU", "vs plain", "peak GiB"]
    head += ["first loss", "final loss"]
    body = []
    for row in gpt_sorted(rows):
        plain = _gpt_plain(rows, row)
        vs = f"{plain['ms_per_step'] / row['ms_per_step']:.2f}x" if plain else "-"
        batch = f"{row.get('config', '?')}, {row.get('batch_size')} x {row.get('context_length')}"
        body.append(
            [gpt_model_name(row), _gpt_mode(row), batch, f"{row['ms_per_step']:.1f}"]
            + [f"{row['tokens_per_s']:,.0f}", f"{row['mfu']:.1%}", vs]
            + [f"{row['peak_mem_gib']:.1f}", f"{row['first_loss']:.4f}"]
            + [f"{row['final_loss']:.4f}"]
        )
    return table(head, body)


def gpt_summary(rows: list[dict]) -> list[list[str]]:
    """Summary rows: per mode (eager, compiled) and batch, fusedlayers' ms/step against the
    plain model's; a mode with no recorded run says so."""
    out = []
    for mode in ("eager", "compiled"):
        ours = [r for r in gpt_sorted(rows) if r.get("provider") != "plain"]
        ours = [r for r in ours if r.get("mode") == mode and "+" not in r["model"]]
        pairs = [(r, _gpt_plain(rows, r)) for r in ours]
        pairs = [(r, p) for r, p in pairs if p is not None]
        if not pairs:
            out.append([f"GPT training, {mode}, ms/step", "-", "-", "no run recorded"])
        for row, plain in pairs:
            label = f"{row.get('config', 'GPT')} training, {_gpt_mode(row)}, ms/step"
            label += f" (batch {row.get('batch_size')} x {row.get('context_length')})"
            ratio = f"{plain['ms_per_step'] / row['ms_per_step']:.2f}x"
            out.append([label, f"{row['ms_per_step']:.1f}", f"{plain['ms_per_step']:.1f}", ratio])
    return out


# ----------------------------------------------------------------------------- generation


def _generate_sorted(rows: list[dict]) -> list[dict]:
    order = {p: i for i, p in enumerate(GENERATE_NAMES)}
    return sorted(rows, key=lambda r: (r["batch"], order.get(r["provider"], 9), r["provider"]))


def _generate_row(rows: list[dict], batch: int, provider: str) -> dict | None:
    found = [r for r in rows if r["batch"] == batch and r["provider"] == provider]
    return found[0] if found and "ms_per_token" in found[0] else None


def generate_table(rows: list[dict]) -> list[str]:
    """Prefill, decode ms/token, tokens/s, setup (warm-up compilation + capture), agreement with
    ours-eager's greedy tokens, and the plain model's ms/token in the same mode (eager against
    eager, the CUDA graph against compiled) over ours, per batch and provider."""
    head = ["batch", "model", "prefill ms", "decode ms/token", "tokens/s", "setup s"]
    head += ["tokens equal to ours-eager", "vs plain"]
    body = []
    for row in _generate_sorted(rows):
        name = GENERATE_NAMES.get(row["provider"], row["provider"])
        if "ms_per_token" not in row:
            reason = row.get("skipped", "not run")
            body.append([str(row["batch"]), name, f"skipped: {reason}", "", "", "", "", ""])
            continue
        plain = _generate_row(rows, row["batch"], GENERATE_PLAIN.get(row["provider"], ""))
        vs = f"{plain['ms_per_token'] / row['ms_per_token']:.2f}x" if plain else ""
        agree = row.get("agree_with_ours_eager")
        setup_s = row.get("warmup_s", 0.0) + row.get("setup_ms", 0.0) / 1e3
        body.append(
            [str(row["batch"]), name, f"{row['prefill_ms']:.1f}", f"{row['ms_per_token']:.3f}"]
            + [f"{row['tokens_per_s']:,.0f}", f"{setup_s:.1f}"]
            + ["-" if agree is None else f"{agree:.1%}", vs]
        )
    return table(head, body)


def generate_summary(rows: list[dict]) -> list[list[str]]:
    """Per batch: ours with its decode step in a CUDA graph against the compiled plain model."""
    out = []
    for batch in sorted({r["batch"] for r in rows}):
        ours = _generate_row(rows, batch, "ours-graph")
        plain = _generate_row(rows, batch, "plain-compiled")
        if ours and plain:
            config = ours.get("config", "GPT")
            label = f"{config} decode, batch {batch}, ms/token (CUDA graph vs compiled)"
            ratio = f"{plain['ms_per_token'] / ours['ms_per_token']:.2f}x"
            out.append(
                [label, f"{ours['ms_per_token']:.3f}", f"{plain['ms_per_token']:.3f}", ratio]
            )
    return out or [["GPT decode against the compiled plain model", "-", "-", "no run recorded"]]


# ----------------------------------------------------------------------------- decode attention


def decode_best_other(row: dict) -> tuple[str, float] | None:
    """The fastest provider that is not ours, (name, us); None if none ran."""
    others = [
        (r["us"], n) for n, r in row["providers"].items() if n not in DECODE_OURS and "us" in r
    ]
    if not others:
        return None
    us, name = min(others)
    return name, us


def decode_table(rows: list[dict], mode: str) -> list[str]:
    """One mode's grid: ours (and paged), the best other provider, and best other / ours."""
    body = []
    for row in sorted((r for r in rows if r.get("mode") == mode), key=lambda r: (r["b"], r["s"])):
        ours, paged = (row["providers"].get(n, {}) for n in DECODE_OURS)
        best = decode_best_other(row)
        cells = [str(row["b"]), str(row["s"])]
        if "us" in ours:
            cells += [f"{ours['us']:.1f}", f"{row['bytes'] / (ours['us'] * 1e3):.0f}"]
        else:
            cells += ["failed" if ours else "-", "-"]
        if "us" in paged and "us" in ours:
            cells.append(f"{paged['us']:.1f} ({paged['us'] / ours['us']:.3f})")
        else:
            cells.append(f"{paged['us']:.1f}" if "us" in paged else "-")
        if best:
            cells.append(f"{best[1]:.1f} ({DECODE_NAMES.get(best[0], best[0])})")
            cells.append(f"{best[1] / ours['us']:.2f}x" if "us" in ours else "-")
        else:
            cells += ["-", "-"]
        body.append(cells)
    head = ["b", "cache", "ours us", "ours GB/s", "paged us (paged/contig)", "best other us"]
    return table(head + ["vs best"], body)


# ----------------------------------------------------------------------------- context parallel


def context_parallel_table(rows: list[dict]) -> list[str]:
    """CP over the GPUs against one GPU with the same attention work per GPU, per sequence
    length and input policy (the same tensors every call, or new ones)."""
    head = ["tokens", "batch", "heads (KV)", "inputs", "pass", "CP ms", "CP TFLOP/s per GPU",
            "one GPU ms", "one GPU TFLOP/s", "CP / one GPU"]  # fmt: skip
    body = []
    order = lambda r: (r.get("seqlen") or 0, bool(r.get("fresh_inputs")), r["pass"] != "fwd")
    for row in sorted(rows, key=order):
        cp, one = row["cp_tflops_per_gpu"], row["single_tflops"]
        seqlen = row.get("seqlen")
        body.append([
            f"{seqlen // 1024}k" if seqlen else "-", str(row.get("batch", "-")),
            f"{row['heads']} ({row['kv_heads']})" if "heads" in row else "-",
            "new" if row.get("fresh_inputs") else "same", row["pass"],
            f"{row['cp_ms']:.2f}", f"{cp:.1f}", f"{row['single_ms']:.2f}", f"{one:.1f}",
            f"{cp / one:.2f}",
        ])  # fmt: skip
    return table(head, body)


def dynamic_shapes_table(rows: list[dict]) -> list[str]:
    """Per loop and provider: the total, the first call, the median after the fifth call and
    the stalls (calls after the fifth over 5x that median)."""
    head = ["loop", "provider", "calls", "total s", "first call s", "median ms", "stalls"]
    body = [
        [row["loop"], row["provider"], str(row["calls"]), f"{row['total_s']:.2f}",
         f"{row['first_s']:.2f}", f"{row['median_ms']:.2f}", str(row["stalls"])]
        for row in rows
    ]  # fmt: skip
    return table(head, body)


def transformers_table(rows: list[dict]) -> list[str]:
    """Per run of the Llama training benchmark: ms/step, tokens/s, peak memory, and the step
    time against the first sdpa run of the same mode and padding."""
    base = {(r["mode"], r["padding"]): r["ms_per_step_median"] for r in reversed(rows)
            if r["run"] == "sdpa"}  # fmt: skip
    head = ["run", "mode", "padding", "ms/step (median)", "tokens/s", "peak GiB", "vs sdpa"]
    body = []
    for row in rows:
        ref = base.get((row["mode"], row["padding"]))
        ratio = f"{ref / row['ms_per_step_median']:.3f}x" if ref else "-"
        body.append([row["run"], row["mode"], "yes" if row["padding"] else "no",
                     f"{row['ms_per_step_median']:.1f}", f"{row['tokens_per_s']:,.0f}",
                     f"{row['peak_mem_gib']:.1f}", ratio])  # fmt: skip
    return table(head, body)


def transformers_generate_table(rows: list[dict]) -> list[str]:
    """Per batch size and attention: seconds per generate, new tokens/s against sdpa's, the
    graph breaks of the compiled step, the share of tokens equal to sdpa's."""
    head = ["batch", "attention", "s (median)", "new tokens/s", "vs sdpa", "graph breaks",
            "same tokens"]  # fmt: skip
    body = [[str(r["batch_size"]), r["attn_implementation"], f"{r['seconds_median']:.3f}",
             f"{r['new_tokens_per_s']:,.0f}", f"{r['speedup_vs_sdpa']:.3f}x",
             str(r["graph_breaks"]), f"{r['same_tokens_as_sdpa']:.0%}"] for r in rows]  # fmt: skip
    return table(head, body)
