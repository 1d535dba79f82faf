"""Train a byte-level GPT on the shipped Shakespeare corpus (data/shakespeare.txt.gz).

    python examples/train_gpt.py            # CPU: `tiny`, ~6 min on 2 cores; GPU: `gpt-50m` bf16
    python examples/train_gpt.py --resume           # continue from runs/gpt/last.safetensors
    torchrun --nproc_per_node 2 examples/train_gpt.py --config gpt-50m   # DDP, same global batch
    torchrun --nproc_per_node 4 examples/train_gpt.py --context-parallel 2  # 2 CP x 2 DP ranks
    torchrun --nproc_per_node 2 examples/train_gpt.py --fsdp             # FSDP2 sharding
    python examples/train_gpt.py --fp8 delayed      # FP8 GEMMs (sm_89+ GPU), TE's DelayedScaling

`--batch-size` is the global batch in sequences: under torchrun each rank computes its slice of the
same batch a single process would draw, so loss curves are comparable across world sizes. Batches
are a pure function of (seed, step), which makes `--resume` continue the exact data stream.
`--context-parallel N` splits every sequence over N consecutive ranks (TE's load-balanced
chunks); the remaining factor of the world is data parallel. `--fsdp` shards parameters, gradients
and optimizer state with FSDP2 instead of replicating them with DDP. `--fp8 delayed|current|block`
runs the layers' GEMMs in FP8 inside `fusedlayers.fp8_autocast` with TE's DelayedScaling,
Float8CurrentScaling or Float8BlockScaling (HYBRID format for the first two); it needs an sm_89+
GPU, or `--use-reference` to emulate FP8 (slowly) anywhere.

Writes to `--out-dir`: `last.safetensors` (+ `last.train.safetensors`), `loss.png`, `log.jsonl`.

Ctrl-C (one process) lets the step in progress finish, saves `last.safetensors` at that step and
exits with status 130, saying how to resume; a second Ctrl-C stops at once, without saving. Under
torchrun an interrupt saves nothing (the ranks stop at different points, and a sharded save is a
collective): `--resume` continues from the last periodic checkpoint (`--ckpt-interval`).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import gzip
import json
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import NoReturn

# Spinning OpenMP workers collapse CPU throughput when the cores are shared with anything else
# (measured on 2 busy cores: 370 tokens/s spinning vs 5,000 passive); passive waiting costs
# little on an idle machine. libgomp reads this once, when torch loads it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from fusedlayers.models import (  # noqa: E402
    GPT,
    CheckpointError,
    GPTConfig,
    lm_loss,
    load_train_state,
    load_weights,
    save_checkpoint,
)
from fusedlayers.models.sharded_checkpoint import (  # noqa: E402
    load_sharded_checkpoint,
    save_sharded_checkpoint,
)
from torch.nn.parallel import DistributedDataParallel  # noqa: E402
from tqdm import tqdm  # noqa: E402

import fusedlayers as te  # noqa: E402
from fusedlayers.attention.context_parallel import context_parallel_indices  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "data" / "shakespeare.txt.gz"
VAL_FRACTION = 0.05


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=None, help="tiny | gpt-50m | gpt-125m (default by device)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=None, help="default: 800 on CPU, 1000 on GPU")
    p.add_argument("--batch-size", type=int, default=None, help="global batch in sequences")
    p.add_argument("--context-length", type=int, default=None, help="override the config's")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate")
    p.add_argument("--dropout", type=float, default=None, help="hidden dropout (GPU default 0.1)")
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--eval-interval", type=int, default=100)
    p.add_argument("--eval-batches", type=int, default=8, help="0: no validation")
    p.add_argument("--ckpt-interval", type=int, default=500)
    p.add_argument("--out-dir", type=Path, default=ROOT / "runs" / "gpt")
    p.add_argument("--resume", action="store_true", help="continue from OUT_DIR/last.safetensors")
    p.add_argument("--stop-at", type=int, default=None, help="checkpoint and exit at this step")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--sample-tokens", type=int, default=300)
    p.add_argument("--use-reference", action="store_true", help="pure-PyTorch attention path")
    p.add_argument(
        "--compare-to", type=Path, default=None, help="run dir whose log.jsonl to overlay/diff"
    )
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    p.add_argument("--context-parallel", type=int, default=1, help="ranks that split each sequence")
    p.add_argument("--fsdp", action="store_true", help="shard with FSDP2 instead of DDP")
    p.add_argument(
        "--fp8", choices=sorted(FP8_RECIPES), default=None, help="FP8 GEMMs with this TE recipe"
    )
    return p.parse_args(argv)


# --fp8: TE's recipes, as a TE training script would write them.
FP8_RECIPES = {
    "delayed": lambda: te.recipe.DelayedScaling(
        fp8_format=te.recipe.Format.HYBRID, amax_history_len=16, amax_compute_algo="max"
    ),
    "current": lambda: te.recipe.Float8CurrentScaling(fp8_format=te.recipe.Format.HYBRID),
    "block": te.recipe.Float8BlockScaling,
}


class Precision:
    """The forward's precision, entered once per step (and per evaluation batch): bf16 autocast
    on CUDA, and with `fp8_recipe` the layers' GEMMs in FP8 (`te.fp8_autocast`). The backward runs
    after the block, as in TE's examples."""

    def __init__(self, device_type: str, fp8_recipe=None) -> None:
        self.device_type, self.fp8_recipe = device_type, fp8_recipe

    def __enter__(self) -> Precision:
        self.stack = contextlib.ExitStack()
        if self.device_type == "cuda":
            self.stack.enter_context(torch.autocast("cuda", dtype=torch.bfloat16))
        if self.fp8_recipe is not None:
            self.stack.enter_context(te.fp8_autocast(enabled=True, fp8_recipe=self.fp8_recipe))
        return self

    def __exit__(self, *exc) -> bool | None:
        return self.stack.__exit__(*exc)


def check_fp8(args: argparse.Namespace) -> None:
    """--fp8 needs FP8 GEMMs on this device, or --use-reference to emulate them."""
    if args.fp8 is None or args.use_reference:
        return
    ok, reason = te.is_fp8_available(return_reason=True)
    if not args.device.startswith("cuda") or not ok:
        why = reason if args.device.startswith("cuda") else f"--device {args.device}"
        raise SystemExit(
            f"--fp8 needs a CUDA GPU of compute capability 8.9+ (here: {why}); add "
            "--use-reference to emulate FP8 in PyTorch"
        )


def apply_device_defaults(args: argparse.Namespace) -> None:
    """Fill unset options: `tiny` in fp32 on CPU, `gpt-50m` in bf16 autocast on GPU."""
    gpu = args.device.startswith("cuda")
    # GPU: ~33M tokens, about 7 passes over the corpus, so dropout keeps a 50M model from
    # memorizing it; CPU: ~4M tokens, too few to overfit.
    defaults = (
        dict(config="gpt-50m", steps=1000, batch_size=32, lr=6e-4, dropout=0.1)
        if gpu
        else dict(config="tiny", steps=800, batch_size=16, lr=3e-3, dropout=0.0)
    )
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)


def setup_distributed(device: str) -> tuple[int, int, torch.device]:
    """(rank, world size, this rank's device); initializes the process group under torchrun."""
    if "RANK" not in os.environ:
        return 0, 1, torch.device(device)
    local_rank = int(os.environ["LOCAL_RANK"])
    if device.startswith("cuda"):
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
        return dist.get_rank(), dist.get_world_size(), torch.device("cuda", local_rank)
    dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size(), torch.device(device)


def setup_parallel(args: argparse.Namespace, rank: int, world: int, ctx: int):
    """Data- and context-parallel coordinates, into `args`; returns this rank's CP group.

    Ranks `d*N .. d*N + N-1` form context-parallel group d (N = --context-parallel); group d
    trains data-parallel slice d of the global batch."""
    n = args.context_parallel
    if n < 1 or world % n:
        raise SystemExit(f"--context-parallel {n} must divide the world size {world}")
    if n > 1 and ctx % (2 * n):
        raise SystemExit(f"--context-parallel {n}: context length {ctx} must divide by {2 * n}")
    if args.fsdp and world == 1:
        raise SystemExit("--fsdp needs several processes (torchrun --nproc_per_node N)")
    args.cp_size, args.cp_rank = n, rank % n
    args.dp_size, args.dp_rank = world // n, rank // n
    if args.batch_size % args.dp_size:
        raise SystemExit(
            f"--batch-size {args.batch_size} must be divisible by the {args.dp_size} "
            "data-parallel ranks"
        )
    group = None
    for d in range(args.dp_size):  # every rank takes part in creating every group
        ranks = list(range(d * n, (d + 1) * n))
        new = dist.new_group(ranks) if n > 1 else None
        if d == args.dp_rank:
            group, args.cp_ranks = new, ranks
    return group


def load_corpus(path: Path = CORPUS) -> tuple[torch.Tensor, torch.Tensor]:
    """Byte tokens (vocabulary 256) of the corpus, split into train and held-out tail: uint8 [n]."""
    data = torch.frombuffer(bytearray(gzip.decompress(path.read_bytes())), dtype=torch.uint8)
    n_val = int(len(data) * VAL_FRACTION)
    return data[:-n_val], data[-n_val:]


def check_context_fits(data: tuple[torch.Tensor, torch.Tensor], ctx: int, evaluate: bool) -> None:
    """A sequence and its next-byte targets must fit inside the split they are drawn from: the
    held-out tail is ~5% of the corpus, so long contexts outgrow it first."""
    splits = (("training", data[0], True), ("held-out", data[1], evaluate))
    for name, split, used in splits:
        if used and ctx + 1 >= len(split):
            hint = "; --eval-batches 0 trains without validation" if name == "held-out" else ""
            raise SystemExit(
                f"--context-length {ctx} does not fit the {name} split ({len(split)} bytes){hint}"
            )


def get_batch(
    data: torch.Tensor, batch: int, ctx: int, seed: int, step: int, rank: int, world: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of global batch `step`: inputs and next-byte targets, int64 [b/world, ctx].

    Every rank draws the same global offsets from a generator seeded by (seed, step), so the data
    does not depend on the world size or on where a run was resumed.
    """
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(len(data) - ctx - 1, (batch,), generator=gen)
    per_rank = batch // world
    starts = starts[rank * per_rank : (rank + 1) * per_rank]
    rows = torch.stack([data[i : i + ctx + 1] for i in starts.tolist()]).long()
    return rows[:, :-1], rows[:, 1:]


def local_batch(data, args, ctx: int, seed: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of global batch `step`: its data-parallel slice of the sequences and,
    under context parallelism, its chunks of each (inputs and targets alike, so every target
    stays the byte after its input): int64 [b / dp, ctx / cp]."""
    x, y = get_batch(data, args.batch_size, ctx, seed, step, args.dp_rank, args.dp_size)
    if args.cp_size > 1:
        index = context_parallel_indices([ctx], args.cp_size, args.cp_rank)
        x, y = x[:, index], y[:, index]
    return x, y


def shard(model: GPT, device: torch.device) -> GPT:
    """FSDP2: each TransformerLayer is one shard group, the root (embeddings, final norm) the
    last. On GPU the parameters compute in bf16 and gradients reduce in fp32; on CPU all fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if device.type == "cuda"
        else MixedPrecisionPolicy()
    )
    for layer in model.layers:
        fully_shard(layer, mp_policy=policy)
    return fully_shard(model, mp_policy=policy)


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warmup, then cosine decay to 10% of the peak at the last step."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))


def make_optimizer(model: torch.nn.Module, args: argparse.Namespace) -> torch.optim.AdamW:
    """AdamW; matrices decay, norms, biases and embeddings do not (nanoGPT's split keeps
    embeddings decaying; byte embeddings are few and dense, so we leave them alone)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.dim() >= 2 and "emb" not in name else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": args.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    fused = args.device.startswith("cuda")
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), fused=fused)


@torch.no_grad()
def evaluate(model, data, args, ctx, rank, world, autocast) -> float:
    """Mean loss over `eval_batches` fixed held-out batches (same batches at every eval)."""
    model.eval()
    total = torch.zeros((), device=args.torch_device)
    for i in range(args.eval_batches):
        x, y = local_batch(data, args, ctx, args.seed + 1, i)
        with autocast:
            total += lm_loss(model(x.to(args.torch_device)), y.to(args.torch_device))
    if world > 1:
        dist.all_reduce(total)
    model.train()
    return total.item() / (args.eval_batches * world)


def plot_losses(runs: dict[str, list[dict]], path: Path) -> None:
    """Train and validation loss against step for each named run, to one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, history in runs.items():
        for key, style in (("train_loss", "-"), ("val_loss", "o-")):
            points = [(h["step"], h[key]) for h in history if key in h]
            if points:
                label = f"{name} {key.split('_')[0]}".strip()
                ax.plot(*zip(*points), style, label=label, alpha=0.7, markersize=3)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/byte)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def compare_runs(history: list[dict], other: list[dict]) -> str:
    """Max |loss difference| over the steps both runs logged, for train and validation."""
    parts = []
    for key in ("train_loss", "val_loss"):
        mine = {h["step"]: h[key] for h in history if key in h}
        theirs = {h["step"]: h[key] for h in other if key in h}
        common = sorted(mine.keys() & theirs.keys())
        if common:
            diff = max(abs(mine[s] - theirs[s]) for s in common)
            parts.append(f"{key} max |diff| {diff:.2e} over {len(common)} steps")
    return "; ".join(parts) or "no common steps"


def sample_text(model: GPT, prompt: str, n: int, device: torch.device, seed: int) -> str:
    """Decode `n` bytes after `prompt` (temperature 0.8, top-k 40) with the KV cache."""
    model.set_context_parallel_group(None)  # one process decodes the whole sequence
    n = min(n, model.config.context_length - len(prompt))
    idx = torch.tensor([list(prompt.encode())], device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    out = model.generate(idx, n, temperature=0.8, top_k=40, generator=gen)
    return bytes(out[0].tolist()).decode("utf-8", errors="replace")


def build(args: argparse.Namespace, device: torch.device) -> tuple[GPT, GPTConfig]:
    overrides = {} if args.context_length is None else {"context_length": args.context_length}
    config = GPTConfig.named(args.config, vocab_size=256, hidden_dropout=args.dropout, **overrides)
    torch.manual_seed(args.seed)
    model = GPT(config, use_reference=args.use_reference, device=device)
    return model, config


def resume(args: argparse.Namespace, model: GPT, optimizer, rank: int) -> tuple[int, list]:
    """(step, history) from OUT_DIR/last.safetensors with --resume, else (0, [])."""
    if not args.resume:
        return 0, []
    ckpt = args.out_dir / "last.safetensors"
    try:
        if args.fsdp:
            state = load_sharded_checkpoint(ckpt, model, optimizer)
        else:
            load_weights(ckpt, model)
            state = load_train_state(ckpt, optimizer)
    except CheckpointError as e:
        raise SystemExit(f"--resume: {e}") from e
    if rank == 0:
        print(f"resumed from {ckpt} at step {state['step']}")
    return state["step"], state["extra"].get("history", [])


def train(args: argparse.Namespace) -> None:
    """Set up (distributed, data, model, optimizer, resume), then run the loop."""
    rank, world, device = setup_distributed(args.device)
    args.torch_device = device
    data = load_corpus()
    core, config = build(args, device)
    check_context_fits(data, config.context_length, evaluate=args.eval_batches > 0)
    cp_group = setup_parallel(args, rank, world, config.context_length)
    if cp_group is not None:
        core.set_context_parallel_group(cp_group, args.cp_ranks)
    if args.fsdp:
        core = shard(core, device)  # before the optimizer: it must hold the sharded parameters
    optimizer = make_optimizer(core, args)
    step, history = resume(args, core, optimizer, rank)
    model = core
    if world > 1 and not args.fsdp:
        model = DistributedDataParallel(
            core, device_ids=[device.index] if device.type == "cuda" else None
        )
    if rank == 0:
        print(
            f"{args.config}: {core.num_parameters():,} parameters, format "
            f"{config.attn_input_format}, {world} process(es) on {device} "
            f"({args.dp_size} data x {args.cp_size} context parallel, "
            f"{'FSDP2' if args.fsdp else 'DDP' if world > 1 else 'one process'}), "
            f"global batch {args.batch_size} x {config.context_length} tokens"
            + (f", FP8 GEMMs ({args.fp8} scaling)" if args.fp8 else "")
        )
    loop = dict(model=model, core=core, optimizer=optimizer, data=data, args=args)
    step = run(**loop, step=step, history=history, rank=rank, world=world)
    if device.type == "cuda":
        report_peak_memory(device, rank, world)
    if rank == 0 and step == args.steps:
        if args.fsdp:  # sample from the gathered checkpoint, on one process
            core = GPT(config, use_reference=args.use_reference, device=device)
            load_weights(args.out_dir / "last.safetensors", core)
        finish(core, history, args, device)
    if world > 1:
        # Drop the model first: FSDP's state keeps gloo work objects alive, and a process that
        # exits holding them aborts ("terminate called without an active exception").
        del model, core, optimizer, loop
        gc.collect()
        dist.barrier()  # tearing down while rank 0 still samples can hang the subgroups
        dist.destroy_process_group()


def run(model, core, optimizer, data, args, step, history, rank, world) -> int:
    """Train from `step` to `--steps` (or `--stop-at`), evaluating and checkpointing on the
    way; appends to `history` and returns the step reached. Ctrl-C: see `interrupted`."""
    train_data, val_data = data
    ctx = core.config.context_length
    autocast = Precision(args.torch_device.type, args.fp8 and FP8_RECIPES[args.fp8]())

    def validate() -> None:
        if args.eval_batches == 0:
            return
        val = evaluate(model, val_data, args, ctx, rank, world, autocast)
        history.append({"step": step, "val_loss": val})
        if rank == 0:  # above the progress bar, which tqdm clears and redraws
            tqdm.write(f"step {step}: val loss {val:.4f}", file=sys.stdout)
            sys.stdout.flush()

    start, last = step, min(args.steps, args.stop_at or args.steps)
    saved = step if args.resume else None  # the step `--resume` would continue from now
    stop = StopRequest(enabled=world == 1)
    try:
        with stop:
            if step == 0:
                validate()
            # Step, loss, tokens/s, elapsed and ETA on stderr (rank 0), redrawn at most twice a
            # second so that logs captured from a pipe stay small.
            with tqdm(
                total=args.steps, initial=step, unit="step", mininterval=0.5, disable=rank != 0
            ) as progress:
                while step < last and not stop.requested:
                    t0 = time.perf_counter()
                    loss = train_step(
                        model, optimizer, train_data, args, ctx, step, rank, world, autocast
                    )
                    # train_step ends in .item(): this times finished GPU work (no evals).
                    tokens_per_s = args.batch_size * ctx / (time.perf_counter() - t0)
                    history.append({"step": step, "train_loss": loss})
                    progress.set_postfix_str(
                        f"loss {loss:.3f} {tokens_per_s:,.0f} tok/s", refresh=False
                    )
                    progress.update()
                    step += 1
                    if step % args.eval_interval == 0 or step == args.steps:
                        validate()
                    if step % args.ckpt_interval == 0 or step == last:
                        saved = checkpoint(core, optimizer, args, step, history, rank)
    except KeyboardInterrupt:
        interrupted(core, optimizer, args, step, start, saved, history, rank, world, stop.forced)
    if stop.requested:
        interrupted(core, optimizer, args, step, start, saved, history, rank, world, False)
    return step


class StopRequest:
    """Ctrl-C while training, held until the step in progress ends (`requested`): a step cut
    short could leave the optimizer update half applied, which no checkpoint resumes exactly. A
    second Ctrl-C raises KeyboardInterrupt at once (`forced`). Only in the main thread of a
    single process (`enabled`); elsewhere Ctrl-C raises as usual."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.requested = self.forced = False
        self._previous = None

    def __enter__(self) -> StopRequest:
        if self.enabled:
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self.enabled:  # None: a handler not set from Python; Python's own is the default
            signal.signal(signal.SIGINT, self._previous or signal.default_int_handler)

    def _handle(self, signum, frame) -> None:
        if self.requested:
            self.forced = True
            raise KeyboardInterrupt
        self.requested = True
        # os.write, not print: a signal handler that prints can land inside another print.
        os.write(2, b"\nCtrl-C: finishing this step, then saving (Ctrl-C again: stop now)\n")


def checkpoint(core, optimizer, args, step: int, history: list, rank: int) -> int:
    """Save OUT_DIR/last.safetensors (+ resume state) at `step`; returns `step`."""
    path, extra = args.out_dir / "last.safetensors", {"history": history}
    if args.fsdp:  # every rank takes part in gathering the shards
        save_sharded_checkpoint(path, core, optimizer, step, extra)
    elif rank == 0:
        save_checkpoint(path, core, optimizer, step, extra)
    return step


def interrupted(
    core, optimizer, args, step, start, saved, history, rank, world, forced
) -> NoReturn:
    """After Ctrl-C: one process at a step boundary saves `step` (unless no step ran since the
    start, or it is saved already); then one line says what was saved and how to resume, and
    the process exits with status 130 (no traceback)."""
    path = args.out_dir / "last.safetensors"
    if world == 1 and not forced and step > start:
        if saved != step:
            checkpoint(core, optimizer, args, step, history, rank)
        message = (
            f"interrupted: saved step {step} to {path}; run the same command with --resume to "
            "continue from it"
        )
    else:
        if forced:
            what = "stopped in the middle of the step, without saving"
        elif world > 1:
            what = (
                "not saved (under torch.distributed the ranks stop at different points, so "
                "only the periodic checkpoints are saved)"
            )
        else:
            what = "nothing new to save (no step finished in this run)"
        resume = (
            "no checkpoint was written"
            if saved is None
            else f"--resume continues from step {saved} ({path})"
        )
        message = f"interrupted at step {step}: {what}; {resume}"
    if rank == 0:
        print(message, flush=True)
    raise SystemExit(130)  # 128 + SIGINT, the shell's status for a run stopped by Ctrl-C


def train_step(model, optimizer, data, args, ctx, step, rank, world, autocast) -> float:
    """One optimizer step on global batch `step`; returns the loss averaged over ranks.

    Every rank's loss is the mean over its own tokens, and every rank holds as many, so the
    mean over all ranks is the global batch's loss. DDP and FSDP average gradients over all
    ranks, context-parallel ones included: each of those holds its tokens' share of the
    gradient (the ring brings every dK/dV back to its owner), so the average is the gradient
    of that global mean."""
    for group in optimizer.param_groups:
        group["lr"] = lr_at(step, args)
    x, y = local_batch(data, args, ctx, args.seed, step)
    x, y = x.to(args.torch_device, non_blocking=True), y.to(args.torch_device, non_blocking=True)
    with autocast:
        loss = lm_loss(model(x), y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    loss = loss.detach()
    if world > 1:
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)
    return loss.item()


def report_peak_memory(device: torch.device, rank: int, world: int) -> None:
    """Print the run's peak allocated GPU memory (training, evaluation and checkpointing), the
    largest over all ranks: what decides whether a sequence length or a sharding fits. Every
    rank must call it (a collective when world > 1)."""
    peak = torch.tensor(float(torch.cuda.max_memory_allocated(device)), device=device)
    if world > 1:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(f"peak GPU memory: {peak.item() / 2**30:.2f} GiB per GPU (largest of {world})")


def finish(model: GPT, history: list[dict], args: argparse.Namespace, device) -> None:
    """Loss curve (overlaid on `--compare-to`'s), JSON log and a text sample."""
    runs = {"": history}
    if args.compare_to:
        other = [json.loads(x) for x in (args.compare_to / "log.jsonl").read_text().splitlines()]
        runs = {"this run": history, str(args.compare_to): other}
        print(f"vs {args.compare_to}: {compare_runs(history, other)}")
    plot_losses(runs, args.out_dir / "loss.png")
    with open(args.out_dir / "log.jsonl", "w") as f:
        f.writelines(json.dumps(h) + "\n" for h in history)
    vals = [h["val_loss"] for h in history if "val_loss" in h]
    if vals:
        print(f"validation loss: first {vals[0]:.4f}, last {vals[-1]:.4f}")
    print(f"wrote {args.out_dir / 'loss.png'}, {args.out_dir / 'last.safetensors'}")
    print("sample:\n" + sample_text(model, "ROMEO:\n", args.sample_tokens, device, args.seed))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    apply_device_defaults(args)
    check_fp8(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    train(args)


if __name__ == "__main__":
    main()
