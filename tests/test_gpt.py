"""The GPT on CPU (reference path): config, formats, generation with the KV cache, training."""

import pytest
import torch
from fusedlayers.models import GPT, GPTConfig, lm_loss


def small_config(**overrides) -> GPTConfig:
    """`tiny`'s shape at a test-friendly size; GQA (4 query heads on 2 KV heads) by default."""
    base = dict(n_layer=2, d_model=64, context_length=64, init_std=0.2)
    return GPTConfig.named("tiny", **{**base, **overrides})


@pytest.fixture(autouse=True)
def fresh_seed():
    """Fresh random weights and inputs every run; the seed is printed on failure."""
    print(f"seed {torch.seed()}")


def test_config_derived_fields_and_validation():
    c = GPTConfig(d_model=96, n_head=6, n_kv_head=None, activation="gelu")
    assert (c.head_dim, c.n_kv_head, c.d_ff) == (16, 6, 384)
    assert GPTConfig(d_model=128, activation="swiglu").d_ff == 384  # 8/3 * 128 rounded up to 64
    assert GPTConfig.from_dict(c.to_dict()) == c
    with pytest.raises(ValueError, match=r"n_head \(6\) must be divisible by n_kv_head \(4\)"):
        GPTConfig(d_model=96, n_head=6, n_kv_head=4)
    with pytest.raises(ValueError, match="pos_emb"):
        GPTConfig(pos_emb="alibi")
    with pytest.raises(ValueError, match="unknown GPTConfig fields: \\['n_layers'\\]"):
        GPTConfig.from_dict({"n_layers": 3})


@pytest.mark.parametrize(
    "name, low, high",
    [
        ("tiny", 0.7e6, 1e6),
        ("gpt-50m", 45e6, 55e6),
        ("gpt-125m", 115e6, 135e6),
        ("gpt-1.3b", 1.25e9, 1.45e9),
    ],
)
def test_named_sizes(name, low, high):
    with torch.device("meta"):
        model = GPT(GPTConfig.named(name))
    assert low <= model.num_parameters(non_embedding=False) <= high


def _logits_and_grads(config: GPTConfig, state: dict, idx: torch.Tensor):
    model = GPT(config).double()
    model.load_state_dict(state)
    logits = model(idx)
    lm_loss(logits, idx.roll(-1, 1)).backward()
    return logits, {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("fmt", ["sbhd", "thd"])
def test_formats_agree_with_bshd(fmt):
    """The same weights give the same logits and gradients in every attn_input_format."""
    config = small_config()
    state = GPT(config).double().state_dict()
    idx = torch.randint(0, 256, (3, 40))
    ref_logits, ref_grads = _logits_and_grads(config, state, idx)
    logits, grads = _logits_and_grads(small_config(attn_input_format=fmt), state, idx)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-10, atol=1e-10)
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-9, atol=1e-10, msg=name)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(),
        dict(attn_input_format="sbhd", pos_emb="learned", normalization="LayerNorm"),
        dict(n_kv_head=1, activation="gelu", tie_embeddings=False),
    ],
)
def test_kv_cache_generation_matches_full_recompute(overrides):
    """Greedy decoding with the cache (one token per step) equals rerunning the whole prefix."""
    model = GPT(small_config(**overrides)).double()
    prompt = torch.randint(0, 256, (2, 9))
    cached = model.generate(prompt, 30, temperature=0)
    full = model.generate(prompt, 30, temperature=0, use_cache=False)
    assert torch.equal(cached, full)
    # Not degenerate: a small random model's greedy output sometimes loops over 2-3 tokens in
    # one sequence (about 2% of seeds for one row); over both rows' 60 tokens, 0 of 150 seeds.
    assert cached.shape == (2, 39) and len(set(cached[:, 9:].flatten().tolist())) > 3


def test_kv_cache_decodes_one_token_per_step():
    """After the prompt, every forward call sees exactly one new token."""
    model = GPT(small_config())
    lengths = []
    model.layers[0].register_forward_pre_hook(lambda m, args: lengths.append(args[0].shape[1]))
    model.generate(torch.randint(0, 256, (1, 5)), 4, temperature=0)
    assert lengths == [5, 1, 1, 1]


def test_sampling_respects_top_k_and_context():
    model = GPT(small_config())
    gen = torch.Generator().manual_seed(0)
    out = model.generate(torch.zeros(4, 1, dtype=torch.long), 20, top_k=1, generator=gen)
    assert torch.equal(out, model.generate(torch.zeros(4, 1, dtype=torch.long), 20, temperature=0))
    with pytest.raises(ValueError, match=r"prompt \+ new tokens \(65\) exceed context_length"):
        model.generate(torch.zeros(1, 5, dtype=torch.long), 60)


def test_a_few_training_steps_reduce_loss():
    model = GPT(small_config(init_std=0.02))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    text = torch.tensor(list(b"To be, or not to be, that is the question: " * 8))
    batch = torch.stack([text[i : i + 33] for i in torch.randint(0, len(text) - 33, (8,))])
    losses = []
    for _ in range(25):
        loss = lm_loss(model(batch[:, :-1]), batch[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    # min over the last steps: one Adam spike at the last step is not a failure to learn
    assert min(losses[-5:]) < 0.6 * losses[0], losses


def test_autocast_promotes_the_residual_stream_into_the_final_norm():
    """Under autocast the layers' outputs are bf16 while the residual stream stays fp32: the GPT
    adds them before its final norm (the norm takes one dtype) and computes what it computes in
    fp32, to bf16's precision."""
    torch.manual_seed(0)
    model = GPT(small_config()).eval()
    idx = torch.randint(0, model.config.vocab_size, (2, 16))
    with torch.no_grad():
        want = model(idx)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = model(idx)
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    assert (got - want).norm() / want.norm() < 3e-2
