"""GPT-125M steps of the working tree against another revision, beside the plain model, in one
process: host-bound training at batch 1 and eager greedy decoding at batch 1.

At batch 1 both are bound by the host, whose Python speed moves by up to 2x within a minute
(BENCHMARKS.md, "Host time per attention call"), so only interleaved rounds in one process can
tell a 5-10% change. REV's package is built from `git archive` under another name
(`host_ab.build_package`) and gets the working tree's weights. Each round times every model in
turn; the tables give each model's best round, its median and every round.

- train: one step (bf16 autocast forward, loss, backward on autograd's thread, fused AdamW) on
  a [1, context] batch; ms per step over `--steps` steps. The plain model is
  `benchmark_gpt.PlainGPT` (torch.nn modules and SDPA-cuDNN).
- decode: a 1,024-token prompt, then `--tokens` greedy tokens, each step feeding the last
  token through an `InferenceParams` cache; ms per token after the prompt. The plain model is
  `benchmark_generate.CachedPlainGPT`, eager. The two packages' tokens must be equal.

    python examples/perf/gpt_ab.py --against 93c98d3
    python examples/perf/gpt_ab.py --against HEAD --dry-run    # CPU, the tiny config, one round
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
import benchmark_generate  # noqa: E402
import benchmark_gpt  # noqa: E402
from fusedlayers.models import GPT, GPTConfig, lm_loss  # noqa: E402
from host_ab import OLD_NAME, build_package  # noqa: E402

import fusedlayers  # noqa: E402

PROMPT = 1024


def train_steps(models: dict, config, device: str, steps: int) -> dict[str, Callable[[], tuple]]:
    """Per model, a run of `steps` training steps on one fixed batch; each run returns
    (ms per step, None)."""
    idx = torch.randint(0, config.vocab_size, (1, config.context_length + 1), device=device)
    x, y = idx[:, :-1], idx[:, 1:]
    autocast_dtype = torch.bfloat16 if device == "cuda" else torch.float32

    def stepper(model) -> Callable[[], tuple]:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")

        def run() -> tuple:
            benchmark_generate._sync(device)
            start = time.perf_counter()
            for _ in range(steps):
                with torch.autocast(device, dtype=autocast_dtype, enabled=device == "cuda"):
                    loss = lm_loss(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            benchmark_generate._sync(device)
            return (time.perf_counter() - start) * 1e3 / steps, None

        return run

    return {name: stepper(model) for name, model in models.items()}


def decode_runs(models: dict, packages: dict, plain, config, device: str, tokens: int) -> dict:
    """Per model, a run that prefills the prompt and decodes `tokens` greedy tokens; each run
    returns (ms per token after the prompt, the tokens)."""
    prompt = torch.randint(0, config.vocab_size, (1, PROMPT), device=device)

    def ours(model, package) -> Callable[[], tuple]:
        def run() -> tuple:
            result = benchmark_generate.generate_ours(
                model, prompt, tokens, graph=False, cache_class=package.InferenceParams
            )
            return result["ms_per_token"], result["tokens"]

        return run

    def plain_run() -> tuple:
        result = benchmark_generate.generate_plain(plain, prompt, tokens, plain)
        return result["ms_per_token"], result["tokens"]

    runs = {name: ours(model, packages[name]) for name, model in models.items()}
    runs["plain, eager"] = plain_run
    return runs


def rounds_of(calls: dict[str, Callable], rounds: int) -> dict[str, list[float]]:
    """Per call (each returning (ms per step or token, anything)), its reading in each round:
    the calls in turn, round after round."""
    spent: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            spent[name].append(call()[0])
    return spent


def table(spent: dict[str, list[float]], unit: str) -> str:
    rows = [f"| model | best {unit} | median | rounds |", "|---|---|---|---|"]
    for name, values in spent.items():
        rounds = " / ".join(f"{v:.2f}" for v in values)
        rows.append(f"| {name} | {min(values):.2f} | {statistics.median(values):.2f} | {rounds} |")
    return "\n".join(rows)


def main(args: argparse.Namespace) -> None:
    device = "cpu" if args.dry_run else "cuda"
    folder = tempfile.mkdtemp()
    commit = build_package(args.against, Path(folder))
    sys.path.insert(0, folder)
    old = importlib.import_module(OLD_NAME)
    old_models = importlib.import_module(f"{OLD_NAME}.models")
    name = "tiny" if args.dry_run else "gpt-125m"
    context = 64 if args.dry_run else 2048
    config = GPTConfig.named(name, context_length=max(context, PROMPT + args.tokens))
    torch.manual_seed(0)
    new = GPT(config).to(device)
    old_config = old_models.GPTConfig.named(name, context_length=config.context_length)
    previous = old_models.GPT(old_config).to(device)
    previous.load_state_dict(new.state_dict())
    tag = commit[:7]
    models = {tag: previous, "working tree": new}
    packages = {tag: old, "working tree": fusedlayers}
    where = "CPU" if args.dry_run else torch.cuda.get_device_name()
    print(f"{tag} against the working tree; {where}, torch {torch.__version__}", flush=True)
    if "train" in args.cases:
        # SDPA's cuDNN backend on the GPU, its math one on the CPU (a dry run)
        backend = SDPBackend.CUDNN_ATTENTION if device == "cuda" else SDPBackend.MATH
        plain = benchmark_gpt.PlainGPT(config, backend).to(device)
        benchmark_gpt.copy_from_fused(plain, new)
        steps = train_steps({**models, "plain": plain}, config, device, args.steps)
        for run in steps.values():  # warm-up: compilation and autotuning
            run()
        benchmark_generate._sync(device)
        spent = rounds_of(steps, args.rounds)
        print(
            f"\nGPT {name} training, batch 1 x {config.context_length}, backward on autograd's "
            f"thread; ms/step, {args.rounds} interleaved rounds of {args.steps} steps"
        )
        print(table(spent, "ms"), flush=True)
        del plain
    if "decode" in args.cases:
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        for model in models.values():
            model.to(dtype).eval()
        plain = benchmark_generate.CachedPlainGPT(config).to(device).eval()
        benchmark_gpt.copy_from_fused(plain, new)
        plain.to(dtype)
        runs = decode_runs(models, packages, plain, config, device, args.tokens)
        produced = {run_name: run()[1] for run_name, run in runs.items()}  # warm-up
        if not torch.equal(produced[tag], produced["working tree"]):
            raise AssertionError(f"{tag} and the working tree decoded different tokens")
        spent = rounds_of(runs, args.rounds)
        print(
            f"\nGPT {name} eager greedy decoding, batch 1, {PROMPT}-token prompt, {args.tokens} "
            f"tokens; ms/token, {args.rounds} interleaved rounds (tokens of both packages equal)"
        )
        print(table(spent, "ms/token"), flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", required=True, help="a git revision, e.g. HEAD~1 or a hash")
    parser.add_argument("--cases", default="train,decode", help="comma-separated: train,decode")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5, help="training steps per round")
    parser.add_argument("--tokens", type=int, default=64, help="greedy tokens per decode run")
    parser.add_argument("--dry-run", action="store_true", help="CPU, the tiny config, one round")
    args = parser.parse_args(argv)
    args.cases = args.cases.split(",")
    if args.dry_run:
        args.rounds, args.steps, args.tokens = 1, 1, 3
    return args


if __name__ == "__main__":
    main(parse_args())
