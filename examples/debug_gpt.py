"""Layer-by-layer debugging of the GPT: kernels against the reference path, then a planted bug.

    python examples/debug_gpt.py                          # tiny GPT; CUDA if present
    python examples/debug_gpt.py --break-layer 2 --fault nan

1. Compares the healthy model's kernel path with its reference path (`use_reference=True`) on one
   batch, module by module. Without CUDA no kernel runs (the modules take the reference path for
   CPU tensors): both reports then open with `NO KERNEL RAN`, and the healthy one is empty.
2. Plants a fault in one layer's core attention, active only on the kernel path, the way a
   kernel bug would be: `scale` (outputs 10% off), `nan` (one NaN), or `grad` (forward right,
   gradients 50% off). The report must name that module; the script exits non-zero otherwise.
   On a CPU this still exercises the localization: the planted fault is the only difference.
"""

from __future__ import annotations

import argparse
import warnings

import torch
from fusedlayers.models import GPT, GPTConfig, lm_loss

from fusedlayers.debug import NoKernelWarning, compare_with_reference

# TransformerEngine's TransformerLayer test tolerance for low precision, 5e-2 of the reference
# tensor's scale (compare_with_reference's defaults are tighter, for single modules).
TOLERANCES = {torch.bfloat16: (0.0, 5e-2), torch.float16: (0.0, 5e-2)}


class _ScaleGrad(torch.autograd.Function):
    """Identity forward, gradient times 1.5: a backward-only bug."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad * 1.5


def plant_fault(module: torch.nn.Module, fault: str) -> None:
    """Corrupt `module`'s output on its kernel path only (`reference_active` False)."""

    def hook(m, args, out):
        if m.reference_active:
            return out
        if fault == "scale":
            return out * 1.1
        if fault == "nan":
            out = out.clone()
            out.view(-1)[out.numel() // 3] = float("nan")
            return out
        return _ScaleGrad.apply(out)

    module.register_forward_hook(hook)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="tiny")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16", "float16"],
        help="default: bfloat16 on CUDA, float32 on CPU",
    )
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--break-layer", type=int, default=2)
    p.add_argument("--fault", default="scale", choices=["scale", "nan", "grad"])
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        n_layer = GPTConfig.named(args.config).n_layer
    except ValueError as e:
        p.error(f"--config {args.config}: {e}")
    if not 0 <= args.break_layer < n_layer:
        p.error(
            f"--break-layer {args.break_layer} is out of range: the {args.config!r} config has "
            f"{n_layer} layers, so it must be in 0..{n_layer - 1}"
        )
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    dtype = getattr(torch, args.dtype)
    config = GPTConfig.named(args.config, vocab_size=256)
    model = GPT(config, device=args.device, dtype=dtype)
    tokens = torch.randint(0, 256, (args.batch_size, args.seq_len + 1), device=args.device)
    idx, targets = tokens[:, :-1], tokens[:, 1:]

    def loss_fn(logits: torch.Tensor) -> torch.Tensor:
        return lm_loss(logits, targets)

    def compare():
        # Each report says itself when no kernel ran (first line, NO KERNEL RAN): no warning.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", NoKernelWarning)
            return compare_with_reference(
                model, idx, loss_fn=loss_fn, tolerances=TOLERANCES, seed=args.seed
            )

    print(f"== healthy {args.config} GPT on {args.device} ({args.dtype}) ==")
    print(compare())

    target = f"layers.{args.break_layer}.self_attention.core_attention"
    plant_fault(model.get_submodule(target), args.fault)
    print(f"\n== after planting a '{args.fault}' fault in {target} (kernel path only) ==")
    report = compare()
    print(report)
    # A backward-only fault in a module without parameters shows up in the enclosing module
    # that owns the gradients it corrupts (the attention block's QKV projection).
    found = report.first_divergence or ""
    if not (found == target or target.startswith(found + ".")) or found.count(".") < 1:
        raise SystemExit(f"debug helper named {found!r}, expected {target!r} or its parent")
    print(f"\npinpointed: {found}")


if __name__ == "__main__":
    main()
