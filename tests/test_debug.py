"""`fusedlayers.debug.compare_with_reference` pinpoints planted faults (CPU).

On CPU both paths of a fusedlayers module compute the same thing, so each fault below is planted
to act only when the module is on its kernel path (`reference_active` False): exactly what a
kernel bug looks like to the helper.
"""

import math

import pytest
import torch

from fusedlayers import DotProductAttention
from fusedlayers.debug import compare_with_reference
from fusedlayers.reference_switch import ReferenceSwitch

# The models here run on CPU tensors, so compare_with_reference warns that no kernel ran: these
# tests plant their faults on the kernel pass and know it (tests/test_newuser_debug.py checks it).
pytestmark = pytest.mark.filterwarnings("ignore::fusedlayers.debug.NoKernelWarning")


class Block(ReferenceSwitch):
    """x [b, s, d] -> x + proj(causal attention(qkv(x))) [b, s, d]."""

    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.h = h
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.attn = DotProductAttention(h, d // h, qkv_format="bshd", attn_mask_type="causal")
        self.proj = torch.nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.h, d // self.h).unbind(2)
        return x + self.proj(self.attn(q, k, v).reshape(b, s, d))


class Stack(ReferenceSwitch):
    def __init__(self, n: int = 4, d: int = 32, h: int = 4) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(Block(d, h) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * 1.5


def _plant(module: ReferenceSwitch, fault: str) -> None:
    """Corrupt `module`'s output (or only its backward) on the kernel path."""

    def hook(m, args, out):
        if m.reference_active:
            return out
        if fault == "scale":
            return out * 1.01
        if fault == "nan":
            out = out.clone()
            out[1, 3, 5] = math.nan
            return out
        return _ScaleGrad.apply(out)

    module.register_forward_hook(hook)


@pytest.fixture
def model_and_batch():
    torch.manual_seed(torch.seed() % 2**31)  # fresh random weights and inputs every run
    return Stack().double(), torch.randn(2, 12, 32, dtype=torch.float64)


def test_clean_model_passes(model_and_batch):
    model, x = model_and_batch
    report = compare_with_reference(model, x)
    assert report.first_divergence is None and report.nonfinite is None
    assert [r.name for r in report.records][:2] == ["layers.0.attn", "layers.0"]
    assert all(r.output.max_abs == 0 for r in report.records)


@pytest.mark.parametrize("layer", [1, 2])
def test_forward_fault_named(model_and_batch, layer):
    model, x = model_and_batch
    _plant(model.layers[layer].attn, "scale")
    report = compare_with_reference(model, x)
    assert report.first_forward == f"layers.{layer}.attn", str(report)
    # Everything before the fault agrees in the forward pass.
    before = [
        r for r in report.records if r.name.startswith(tuple(f"layers.{i}" for i in range(layer)))
    ]
    assert before and not any(r.output.over for r in before)


def test_backward_only_fault_named(model_and_batch):
    model, x = model_and_batch
    _plant(model.layers[2], "grad")
    report = compare_with_reference(model, x)
    assert report.first_forward is None
    assert report.first_backward == "layers.2", str(report)


def test_nan_position_reported(model_and_batch):
    model, x = model_and_batch
    _plant(model.layers[1].attn, "nan")
    report = compare_with_reference(model, x)
    assert report.nonfinite.startswith(
        "layers.1.attn (output, kernel path): nan at index [1, 3, 5]"
    )
    assert report.first_forward == "layers.1.attn"


def test_model_state_restored(model_and_batch):
    model, x = model_and_batch
    model.layers[0].use_reference = True
    model.train()
    compare_with_reference(model, x)
    assert model.training and model.layers[0].use_reference and not model.layers[1].use_reference
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize(
    "fault, expected", [("scale", "core_attention"), ("grad", "self_attention")]
)
def test_pinpoints_fault_in_gpt(fault, expected):
    """Through a whole GPT: a forward fault is named at the core attention itself; a
    backward-only one at the attention block whose parameter gradients it corrupts."""
    from fusedlayers.models import GPT, GPTConfig, lm_loss

    torch.manual_seed(torch.seed() % 2**31)
    model = GPT(GPTConfig.named("tiny", n_layer=3, d_model=64, context_length=32))
    idx = torch.randint(0, 256, (2, 17))
    _plant(model.layers[1].self_attention.core_attention, fault)
    report = compare_with_reference(
        model, idx[:, :-1], loss_fn=lambda logits: lm_loss(logits, idx[:, 1:])
    )
    name = "layers.1.self_attention" + (".core_attention" if expected == "core_attention" else "")
    assert report.first_divergence == name, str(report)
