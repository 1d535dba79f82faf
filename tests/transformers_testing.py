"""Tiny transformers models and the checks run on them with attn_implementation="fusedlayers"
(tests/test_transformers_integration.py on the CPU, tests/gpu/test_transformers_gpu.py in bf16).

Every model is randomly initialized from a small config (2 layers, hidden 64, 4 query heads over
2 KV heads, head dim 16, vocabulary 100): no download. `initializer_range` is raised so that
attention is far from uniform and a wrong mask moves the logits well past the tolerances.
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fusedlayers.integrations import transformers as fl_hf  # noqa: E402

NAME = fl_hf.register("fusedlayers")
KERNEL_NAME = fl_hf.register("fusedlayers-kernel", backend="kernel")
ORACLE = "fp64-oracle"


def oracle_attention(
    module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None,
    s_aux=None, **kwargs,
):  # fmt: skip
    """The models' eager attention computed wholly in the inputs' precision (their eager
    functions take the softmax in fp32, where the fp64 mask minimum becomes -inf and padding
    rows turn to NaN): the oracle, run on fp64 models."""
    group = query.shape[1] // key.shape[1]
    key, value = (t.repeat_interleave(group, dim=1) for t in (key, value))
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    scores = (query @ key.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if attention_mask is not None:
        scores = scores + attention_mask
    if s_aux is not None:
        sink = s_aux.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
        scores = torch.cat((scores, sink), dim=-1)
    probs = torch.softmax(scores, dim=-1)
    if s_aux is not None:
        probs = probs[..., :-1]
    return (probs @ value).transpose(1, 2).contiguous(), probs


transformers.AttentionInterface.register(ORACLE, oracle_attention)
transformers.masking_utils.AttentionMaskInterface.register(
    ORACLE, transformers.masking_utils.eager_mask
)
WINDOW = 4  # sliding windows shorter than the prompts
COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=100,
    initializer_range=0.2,
    tie_word_embeddings=False,
)


def _configs() -> dict:
    t = transformers
    return {
        # family: (config, the implementation it is compared with in the same dtype)
        "llama": (lambda: t.LlamaConfig(**COMMON), "sdpa"),
        "mistral": (lambda: t.MistralConfig(**COMMON, sliding_window=WINDOW), "sdpa"),
        # GQA, and biases on the q/k/v projections
        "qwen2": (lambda: t.Qwen2Config(**COMMON), "sdpa"),
        # softcap, sliding and full layers alternating; transformers has no sdpa for it
        "gemma2": (
            lambda: t.Gemma2Config(
                **COMMON,
                sliding_window=WINDOW,
                attn_logit_softcapping=5.0,
                final_logit_softcapping=None,
                query_pre_attn_scalar=16,
            ),  # fmt: skip
            "eager",
        ),
        # attention sinks (s_aux), q/k/v biases, alternating windows; no sdpa either
        "gpt_oss": (
            lambda: t.GptOssConfig(
                **COMMON, sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2
            ),
            "eager",
        ),
    }


FAMILIES = _configs()


def tiny_model(family: str, seed: int = 0):
    make, comparator = FAMILIES[family]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(make(), attn_implementation="eager")
    if hasattr(model, "set_experts_implementation") and family == "gpt_oss":
        model.set_experts_implementation("eager")  # grouped_mm has no fp64
    model.generation_config.eos_token_id = None  # generate the full length in every row
    model.generation_config.pad_token_id = 0
    return model.eval(), comparator


def variant(model, implementation: str, dtype: torch.dtype, device="cpu"):
    """A copy of `model` with the same weights, in `dtype`, on `implementation`."""
    other = copy.deepcopy(model).to(device=device, dtype=dtype)
    other.set_attn_implementation(implementation)
    return other


def padded_batch(lengths, width: int, side: str, seed: int = 1, device="cpu"):
    """Token ids [b, width] (1..99) and the 0/1 attention mask of sequences of `lengths`,
    padded on `side` with token 0."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 100, (len(lengths), width), generator=generator)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        cols = slice(width - n, width) if side == "left" else slice(0, n)
        mask[row, cols] = 1
    return (ids * mask).to(device), mask.to(device)


def labels_of(ids, mask):
    """Labels of the real tokens that a real token predicts: a padding position's output is
    the implementation's choice (fusedlayers gives 0, eager uniform attention), so the first
    token after left padding is not a target."""
    before = torch.nn.functional.pad(mask[:, :-1], (1, 0))
    return ids.masked_fill((mask == 0) | (before == 0), -100)


def forward_backward(model, ids, mask, **kwargs):
    """(logits fp64 on real tokens, loss, {name: grad fp64})."""
    model.zero_grad(set_to_none=True)
    out = model(ids, attention_mask=mask, labels=labels_of(ids, mask), **kwargs)
    out.loss.backward()
    grads = {n: p.grad.double() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits[mask.bool()].double(), out.loss.double(), grads


def assert_two_x(got, compared, oracle, what: str, atol: float) -> None:
    """flash-attn's rule: |got - oracle| <= 2 |compared - oracle| + atol (all fp64)."""
    err_got = (got.double() - oracle.double()).abs().max().item()
    err_cmp = (compared.double() - oracle.double()).abs().max().item()
    assert err_got <= 2 * err_cmp + atol, (
        f"{what}: fusedlayers error {err_got:.3e} > 2 x {err_cmp:.3e} (the comparator's) + {atol:g}"
    )


def assert_grads_two_x(got: dict, compared: dict, oracle: dict, rel_atol: float) -> None:
    assert got.keys() == oracle.keys() == compared.keys()
    for name in oracle:
        scale = 1.0 + oracle[name].abs().max().item()
        assert_two_x(got[name], compared[name], oracle[name], f"grad {name}", rel_atol * scale)


def greedy(model, ids, mask, new_tokens: int, **kwargs):
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, **kwargs
        )
    return out[:, ids.shape[1] :]


def assert_same_greedy(got, want, oracle, ids, mask, tie: float) -> None:
    """`got` == `want`, except where the first difference of a row is a near tie (< `tie`) of
    the two tokens under the high-precision `oracle` model, which kernels that round
    differently may break either way."""
    for row in range(got.shape[0]):
        differ = (got[row] != want[row]).nonzero()
        if differ.numel() == 0:
            continue
        step = int(differ[0])
        prefix = torch.cat((ids[row], want[row, :step]))[None]
        prefix_mask = torch.cat((mask[row], mask.new_ones(step)))[None]
        with torch.no_grad():
            logits = oracle(prefix.to(oracle.device), attention_mask=prefix_mask).logits[0, -1]
        gap = (logits[got[row, step]] - logits[want[row, step]]).abs().item()
        assert gap < tie, (
            f"row {row} differs at step {step}: {got[row].tolist()} vs {want[row].tolist()}, "
            f"not a tie (oracle logit gap {gap:.3e})"
        )


class RouteSpy:
    """Records the route each structured call takes (fl_hf._structured's second result)."""

    def __init__(self, monkeypatch):
        self.routes: list[str] = []
        original = fl_hf._structured

        def spy(*args, **kwargs):
            out, route = original(*args, **kwargs)
            self.routes.append(route)
            return out, route

        monkeypatch.setattr(fl_hf, "_structured", spy)

    def saw(self, prefix: str) -> bool:
        return any(r.startswith(prefix) for r in self.routes)
