"""Host time per call of the working tree against another revision, both in one process.

The benchmark host's Python speed moves by up to 2x within a minute (BENCHMARKS.md, "Host time
per attention call"), so two processes cannot tell a 10% host-time change from the host's
drift. This script builds REV's package from `git archive` under another name
(`fusedlayers_rev`: its imports and its custom ops' namespace renamed) and imports it beside the
working tree's. Each round times every call once, as the best of `--repeats` runs of `--calls`
calls (`launch_overhead.host_us_per_call`), in an order that starts one call later each round;
the table gives each call's best round, its median and every round. On CUDA, SDPA's rows sit
beside ours. Before anything is timed, the two packages' outputs and gradients must agree (to 2%
relative L2 error each).

Cells (`--cells`):
- tiny: b=1, s=128, 4 heads, d=64, causal (the portable kernels): the forward without grad, with
  inputs that require grad, and forward+backward;
- sm90: on an sm_90 GPU, b=1, s=2k, one head, d=128, causal, both packages pinned to the sm_90
  kernels: the same three calls;
- decode: one query, 4 query heads over 2 KV heads, d=64, a 1k cache holding 700 rows, through
  `flash_attn_with_kvcache`; on CUDA also SDPA given the cache cut to its filled rows and given
  the whole cache with a boolean mask;
- layers: a two-layer GPT of each package with the same weights (d_model 256, 4 heads of 64,
  RMSNorm, RoPE, SwiGLU: every kernel of a layer), a forward+backward at b=1, s=128 (gradients
  of every parameter; s=16 and fp32 with `--stubbed`, where the CPU's own matmuls would
  outweigh the host work) and one decode step over a cache holding 700 tokens.

`--one-thread` runs every backward on the calling thread (autograd's multithreading off, for
both packages and SDPA alike): a forward+backward then no longer includes the handoff to
autograd's device thread and back, whose wake-ups spread the rounds of this host by up to 2x.

    python examples/perf/host_ab.py --against 3d43fa8
    python examples/perf/host_ab.py --against HEAD~1 --stubbed     # CPU, Triton launches no-ops
"""

from __future__ import annotations

import argparse
import importlib
import io
import os
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

# launch_overhead lives here, bench_utils one folder up, in examples/.
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench_utils import rel_err  # noqa: E402
from launch_overhead import (  # noqa: E402
    DECODE_FILLED,
    decode_step,
    host_us_per_call,
    sdpa_decode_calls,
    stub_launches,
)

REPO = Path(__file__).resolve().parents[2]
OLD_NAME = "fusedlayers_rev"
# Source folders as the distribution maps them (pyproject.toml, package-dir).
PACKAGE_DIRS = {"fusedlayers": "", "kernels": "kernels", "models": "models"}
CELLS = ("tiny", "sm90", "decode", "layers")
# Outputs of the two packages must agree to this relative L2 error (`_check_agreement`).
AGREEMENT = 2e-2


def build_package(rev: str, dest: Path, name: str = OLD_NAME) -> str:
    """Write `rev`'s package under `dest/name` with every `fusedlayers` name renamed to `name`
    (imports and the custom ops' namespace, so both packages register their ops); returns the
    commit it resolved to."""
    commit = subprocess.run(
        ["git", "rev-parse", "--verify", f"{rev}^{{commit}}"],
        cwd=REPO, check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    archive = subprocess.run(
        ["git", "archive", commit, *PACKAGE_DIRS], cwd=REPO, check=True, capture_output=True
    ).stdout
    word = re.compile(r"\bfusedlayers\b")
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        for member in tar.getmembers():
            if not member.isfile():
                continue
            top, _, rest = member.name.partition("/")
            target = dest / name / PACKAGE_DIRS[top] / rest
            target.parent.mkdir(parents=True, exist_ok=True)
            data = tar.extractfile(member).read()
            if target.suffix == ".py":
                data = word.sub(name, data.decode()).encode()
            target.write_bytes(data)
    return commit


def _attention_calls(packages: dict, shape: tuple, tag: str, device: str, dtype) -> dict:
    torch.manual_seed(0)
    q, k, v = (torch.randn(*shape, device=device, dtype=dtype).requires_grad_() for _ in range(3))
    dout = torch.randn_like(q)
    calls = {}
    for name, package in packages.items():

        def no_grad(package=package):
            with torch.no_grad():
                return package.flash_attn_func(q, k, v, causal=True)

        def with_grad(package=package):
            return package.flash_attn_func(q, k, v, causal=True)

        def forward_backward(package=package):
            return torch.autograd.grad(
                package.flash_attn_func(q, k, v, causal=True), (q, k, v), dout
            )

        calls[f"{tag}: {name}, forward, no grad"] = no_grad
        calls[f"{tag}: {name}, forward, inputs require grad"] = with_grad
        calls[f"{tag}: {name}, forward+backward"] = forward_backward
    if device == "cuda":
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        heads_first = [t.transpose(1, 2) for t in (q, k, v)]

        def sdpa(grad: bool):
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION), torch.set_grad_enabled(grad):
                return F.scaled_dot_product_attention(*heads_first, is_causal=True)

        calls[f"{tag}: sdpa-flash, forward, no grad"] = lambda: sdpa(False)
        calls[f"{tag}: sdpa-flash, forward, inputs require grad"] = lambda: sdpa(True)
        calls[f"{tag}: sdpa-flash, forward+backward"] = lambda: torch.autograd.grad(
            sdpa(True), (q, k, v), dout.transpose(1, 2)
        )
    return calls


def _decode_calls(packages: dict, device: str, dtype) -> dict:
    torch.manual_seed(0)
    q, k_cache, v_cache, lengths = decode_step(device, dtype)
    calls = {
        f"decode: {name}, flash_attn_with_kvcache": (
            lambda package=package: package.flash_attn_with_kvcache(
                q, k_cache, v_cache, cache_seqlens=lengths, causal=True
            )
        )
        for name, package in packages.items()
    }
    if device == "cuda":
        cut, masked = sdpa_decode_calls(q, k_cache, v_cache)
        calls["decode: sdpa, cache cut to its filled rows"] = cut
        calls["decode: sdpa, whole cache and a boolean mask"] = masked
    return calls


def _kernels_on_cpu(package) -> None:
    """Send `package`'s CPU tensors to its (stubbed) kernels where `backend="auto"` would take
    the reference path on CPU: every module's
    `choose_backend` (norm, RoPE, activation, cache)."""
    backends = importlib.import_module(f"{package.__name__}._backend")
    choose = backends.choose_backend

    def choose_kernel(backend, x, name, blocker="", not_worth=""):
        if backend == "auto" and not blocker and not not_worth:
            backend = "kernel"
        return choose(backend, x, name, blocker, not_worth)

    for name, module in list(sys.modules.items()):
        if name.startswith(package.__name__) and getattr(module, "choose_backend", None) is choose:
            module.choose_backend = choose_kernel


def _layer_calls(packages: dict, device: str, dtype) -> dict:
    torch.manual_seed(0)
    seqlen = 128
    if device == "cpu":  # the CPU's own matmuls would outweigh the host work measured
        dtype, seqlen = torch.float32, 16
    models = {}
    for name, package in packages.items():
        gpt = importlib.import_module(f"{package.__name__}.models")
        config = gpt.GPTConfig(
            n_layer=2, n_head=4, d_model=256, context_length=1024, vocab_size=256
        )
        models[name] = gpt.GPT(config).to(device, dtype)
    first, *rest = models.values()
    for model in rest:
        model.load_state_dict(first.state_dict())
    tokens = torch.randint(0, 256, (1, seqlen), device=device)
    prompt = torch.randint(0, 256, (1, DECODE_FILLED), device=device)
    grad_out = torch.randn(1, seqlen, 256, device=device, dtype=torch.float32)  # logits' shape
    calls = {}
    for name, model in models.items():
        package = packages[name]
        params = list(model.parameters())
        cache = package.InferenceParams(1, 1024)
        with torch.no_grad():
            model(prompt, inference_params=cache)
        cache.advance(DECODE_FILLED)

        def forward_backward(model=model, params=params):
            return torch.autograd.grad(model(tokens), params, grad_out)

        def decode_step(model=model, cache=cache):
            # The cache is not advanced: every call writes and attends at the same position.
            with torch.no_grad():
                return model(prompt[:, -1:], inference_params=cache)

        calls[f"layers: {name}, GPT 2 layers forward+backward"] = forward_backward
        calls[f"layers: {name}, GPT 2 layers decode step"] = decode_step
    return calls


def _check_agreement(calls: dict, names: tuple[str, str]) -> None:
    """Each call of the two packages gives the same outputs: every output tensor within
    `AGREEMENT` relative L2 error of the other's. Not elementwise: two correct bf16 computations
    that round differently (one forward tile for another) put the two-layer GPT's gradients
    0.6-0.8% from fp64 each, yet up to 11% of a gradient's elements apart by more than 2e-2
    (absolute and relative) on the H100, while a wrong kernel is off by far more than 2% in
    norm."""
    for key, call in calls.items():
        if not key.split(": ", 1)[1].startswith(names[0]):
            continue
        other_key = key.replace(f": {names[0]},", f": {names[1]},", 1)
        for index, (a, b) in enumerate(zip(_flat(call()), _flat(calls[other_key]()))):
            if a.shape != b.shape or rel_err(a, b) > AGREEMENT:
                raise AssertionError(
                    f"{key} and {other_key} disagree in output {index}: shapes "
                    f"{tuple(a.shape)} and {tuple(b.shape)}, relative L2 error "
                    f"{rel_err(a, b) if a.shape == b.shape else float('nan'):.3g} (at most "
                    f"{AGREEMENT})"
                )


def _flat(result) -> list[torch.Tensor]:
    if isinstance(result, torch.Tensor):
        return [result]
    return [t for t in result if isinstance(t, torch.Tensor)]


def rounds_of(calls: dict[str, Callable], rounds: int, calls_per_run: int, repeats: int) -> dict:
    """Per call, its host us in each round; round r starts with the r-th call."""
    names = list(calls)
    spent: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        start = r % len(names)
        for name in names[start:] + names[:start]:
            spent[name].append(host_us_per_call(calls[name], calls_per_run, repeats))
    return spent


def table(spent: dict[str, list[float]]) -> str:
    lines = ["| call | best | median | rounds |", "|---|---|---|---|"]
    for name, us in spent.items():
        every = " / ".join(f"{u:.1f}" for u in us)
        lines.append(f"| {name} | {min(us):.1f} | {statistics.median(us):.1f} | {every} |")
    return "\n".join(lines)


def main(
    against: str, cells: list[str], rounds: int, calls: int, repeats: int, stubbed: bool,
    one_thread: bool = False,
):  # fmt: skip
    with torch.autograd.set_multithreading_enabled(not one_thread):
        _main(against, cells, rounds, calls, repeats, stubbed, one_thread)


def _main(against, cells, rounds, calls, repeats, stubbed, one_thread):
    import fusedlayers

    with tempfile.TemporaryDirectory() as folder:
        commit = build_package(against, Path(folder))
        sys.path.insert(0, folder)
        try:
            old = importlib.import_module(OLD_NAME)
        finally:
            sys.path.remove(folder)
        if stubbed:
            for package in (fusedlayers, old):
                stub_launches(package.kernels)
                _kernels_on_cpu(package)
        device = "cpu" if stubbed else "cuda"
        dtype = torch.float16 if stubbed else torch.bfloat16
        names = (commit[:7], "working tree")
        packages = {names[0]: old, names[1]: fusedlayers}
        sm90 = not stubbed and torch.cuda.get_device_capability() == (9, 0)
        where = "CPU, launches stubbed" if stubbed else torch.cuda.get_device_name()
        where += ", backward on the calling thread" if one_thread else ""
        print(
            f"host us per call, {names[0]} against the working tree, {rounds} rounds of "
            f"{repeats} runs of {calls} calls ({where})"
        )
        for cell in cells:
            if cell == "tiny":
                group = _attention_calls(packages, (1, 128, 4, 64), "tiny", device, dtype)
            elif cell == "sm90":
                if not sm90:
                    print("sm90: skipped (needs an sm_90 GPU)")
                    continue
                for package in packages.values():
                    package.kernels.set_forward_path("sm90")
                    package.kernels.set_backward_path("sm90")
                group = _attention_calls(packages, (1, 2048, 1, 128), "sm90", device, dtype)
            elif cell == "decode":
                group = _decode_calls(packages, device, dtype)
            else:
                group = _layer_calls(packages, device, dtype)
            if not stubbed:
                _check_agreement(group, names)
            print(table(rounds_of(group, rounds, calls, repeats)), flush=True)
            for package in packages.values():
                package.kernels.set_forward_path("auto")
                package.kernels.set_backward_path("auto")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", required=True, help="a git revision, e.g. HEAD~1 or a hash")
    parser.add_argument("--cells", default=",".join(CELLS), help=f"comma-separated: {CELLS}")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=200, help="calls per timed run")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per round (best kept)")
    parser.add_argument("--stubbed", action="store_true", help="CPU, Triton launches as no-ops")
    parser.add_argument(
        "--one-thread", action="store_true", help="backward on the calling thread (module doc)"
    )
    args = parser.parse_args()
    if args.stubbed:
        # Read when triton.jit decorates the kernels, i.e. at the first fusedlayers import.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    cells = args.cells.split(",")
    unknown = sorted(set(cells) - set(CELLS))
    if unknown:
        parser.error(f"--cells: unknown {unknown}; choose from {CELLS}")
    main(args.against, cells, args.rounds, args.calls, args.repeats, args.stubbed, args.one_thread)
