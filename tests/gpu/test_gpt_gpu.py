"""The GPT on CUDA: kernels against the reference path through the whole model, and a short bf16
training run through the Triton kernels.

Tolerance: TransformerEngine's TransformerLayer test tolerance, 5e-2 relative to the reference
tensor's max magnitude, applied by `compare_with_reference` to every module's output, incoming
gradient and parameter gradients.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from fusedlayers.models import GPT, GPTConfig, lm_loss

from fusedlayers.debug import compare_with_reference

pytestmark = pytest.mark.gpu

LAYER_TOL = {torch.bfloat16: (0.0, 5e-2), torch.float16: (0.0, 5e-2)}
SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "train_gpt.py"


@pytest.mark.parametrize("fmt", ["bshd", "sbhd", "thd"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpt_kernels_match_reference(fmt, dtype):
    """Every module of a 4-layer GQA GPT, forward and backward, kernels vs reference."""
    seed = torch.seed()
    print(f"seed {seed}")
    config = GPTConfig.named(
        "tiny",
        n_layer=4,
        d_model=256,
        n_head=8,
        n_kv_head=2,
        context_length=512,
        attn_input_format=fmt,
    )
    model = GPT(config, device="cuda", dtype=dtype)
    tokens = torch.randint(0, 256, (2, 385), device="cuda")  # odd length: partial blocks
    report = compare_with_reference(
        model,
        tokens[:, :-1],
        loss_fn=lambda logits: lm_loss(logits, tokens[:, 1:]),
        tolerances=LAYER_TOL,
        seed=seed % 2**31,
    )
    assert report.nonfinite is None, str(report)
    assert report.first_divergence is None, str(report)
    assert abs(report.loss["kernel"] - report.loss["reference"]) < 1e-2 * report.loss["reference"]


def test_kv_cache_generation_on_gpu():
    """Cached decoding on the kernels reproduces full recomputation (fp32 weights, greedy) for
    the first tokens; bf16 prefill and decode may round differently, fp32 should not flip an
    argmax within a few steps."""
    torch.manual_seed(torch.seed() % 2**31)
    model = GPT(GPTConfig.named("tiny", init_std=0.2), device="cuda")
    prompt = torch.randint(0, 256, (3, 17), device="cuda")
    cached = model.generate(prompt, 16, temperature=0)
    full = model.generate(prompt, 16, temperature=0, use_cache=False)
    assert torch.equal(cached, full)


def test_short_bf16_training_run(tmp_path, capsys):
    """examples/train_gpt.py on CUDA (bf16 autocast, Triton kernels): validation loss falls."""
    spec = importlib.util.spec_from_file_location("train_gpt", SCRIPT)
    train_gpt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_gpt)
    train_gpt.main(
        "--config tiny --steps 150 --batch-size 32 --eval-interval 50 --eval-batches 4 "
        f"--lr 3e-3 --warmup 20 --sample-tokens 64 --out-dir {tmp_path}".split()
    )
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("validation loss: first"))
    first, last = (float(v.split()[-1]) for v in line.split(":")[1].split(","))
    assert last < 0.6 * first, out
    peak = next(x for x in out.splitlines() if x.startswith("peak GPU memory:"))
    gib = float(peak.split()[3])
    assert 0 < gib * 2**30 <= torch.cuda.get_device_properties(0).total_memory, peak
