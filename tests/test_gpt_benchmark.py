"""examples/benchmark_gpt.py compares like with like: the plain-PyTorch GPT loaded with the
fusedlayers GPT's weights computes the same logits and gradients (CPU, fp64, SDPA math backend)."""

import importlib.util
from pathlib import Path

import pytest
import torch
from fusedlayers.models import GPT, GPTConfig, lm_loss
from torch.nn.attention import SDPBackend

SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "benchmark_gpt.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("benchmark_gpt", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("n_kv_head", [4, 2])
def test_plain_model_is_the_same_function(bench, n_kv_head):
    print(f"seed {torch.seed()}")
    c = GPTConfig.named("tiny", n_layer=2, d_model=64, n_kv_head=n_kv_head, context_length=48)
    gpt = GPT(c).double()
    plain = bench.PlainGPT(c, sdpa_backend=SDPBackend.MATH).double()
    bench.copy_from_fused(plain, gpt)
    assert sum(p.numel() for p in plain.parameters()) == sum(p.numel() for p in gpt.parameters())
    idx = torch.randint(0, 256, (2, 33))
    losses = []
    for model in (gpt, plain):
        loss = lm_loss(model(idx[:, :-1]), idx[:, 1:])
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-12, atol=0)
    torch.testing.assert_close(gpt.tok_emb.weight.grad, plain.tok_emb.weight.grad)


def test_flop_count(bench):
    c = GPTConfig.named("gpt-125m")
    with torch.device("meta"):
        model = GPT(c)
    n = sum(p.numel() for p in model.parameters())
    assert bench.flops_per_token(model, c) == 6 * n + 6 * 12 * 2048 * 768


def test_variants_switch_the_off_by_default_kernels_and_restore_them(bench):
    from fusedlayers.kernels import _flash_bwd

    from fusedlayers.layers import normalization

    before = normalization.KERNEL_MIN_HIDDEN, _flash_bwd.ATOMIC_DQ_DEVICES
    with bench.switched(**bench.VARIANTS["both"]):
        assert normalization.KERNEL_MIN_HIDDEN == 0 and _flash_bwd.ATOMIC_DQ_DEVICES == "cuda"
    assert (normalization.KERNEL_MIN_HIDDEN, _flash_bwd.ATOMIC_DQ_DEVICES) == before
    with bench.switched(**bench.VARIANTS["default"]):
        assert normalization.KERNEL_MIN_HIDDEN == before[0]
        assert _flash_bwd.ATOMIC_DQ_DEVICES == "never"


def test_host_profile_names_the_layers_and_removes_its_hooks(bench, capsys):
    c = GPTConfig.named("tiny", n_layer=2, d_model=64, context_length=16)
    gpt = GPT(c)
    idx = torch.randint(0, 256, (1, 17))

    def step():
        lm_loss(gpt(idx[:, :-1]), idx[:, 1:]).backward()

    result = bench.profile_host(gpt, step, steps=2)
    table = capsys.readouterr().out
    for scope in ("module: TransformerLayer", "module: MultiheadAttention", "evaluate_function"):
        assert scope in table
    assert set(result) == {"launches_per_step", "host_profiled_wall_ms"}
    assert result["host_profiled_wall_ms"] > 0
    hooks = [m for m in gpt.modules() if m._forward_hooks or m._forward_pre_hooks]
    assert not hooks
    step()  # the model still runs without the profile's scopes
