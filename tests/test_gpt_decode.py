"""`GPT.generate` on the decode kernel (CPU interpreter): greedy tokens with the KV cache, every
attention on the split-KV kernel with lengths on the device, equal full recomputation in fp64 on
the reference path; learned positions read their positions from the device lengths too.
`cuda_graph=True` needs CUDA (tests/gpu/test_decode_gpu.py checks it against the eager path)."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from fusedlayers.models import GPT
from test_gpt import small_config

from fusedlayers.layers.decode_graph import DecodeGraph
from fusedlayers.layers.inference import InferenceParams


@pytest.mark.skipif(
    torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
    reason="runs the decode kernel under the Triton CPU interpreter",
)
@pytest.mark.parametrize(
    "overrides",
    [dict(), dict(attn_input_format="sbhd", pos_emb="learned", n_kv_head=1)],
)
def test_generate_on_the_decode_kernel_matches_full_recompute(kernels_on_cpu, overrides):
    torch.manual_seed(0)
    model = GPT(small_config(**overrides))
    high = copy.deepcopy(model).double()
    high.use_reference = True
    prompt = torch.randint(0, 256, (2, 7))
    cached = model.generate(prompt, 8, temperature=0)
    full = high.generate(prompt, 8, temperature=0, use_cache=False)
    assert torch.equal(cached, full)
    assert len(set(cached[0, 7:].tolist())) > 2  # not degenerate


def test_cuda_graph_needs_cuda_and_the_cache():
    model = GPT(small_config())
    prompt = torch.zeros(1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match=r"cuda_graph=True needs use_cache=True and CUDA"):
        model.generate(prompt, 2, cuda_graph=True)
    with pytest.raises(ValueError, match="CUDA graphs need CUDA tensors"):
        DecodeGraph(lambda t: t, InferenceParams(1, 8), prompt)


def test_learned_positions_follow_per_sequence_lengths():
    """Positions come from the device lengths: a ragged batch embeds each sequence at its own
    position (what one sequence alone would see)."""
    torch.manual_seed(1)
    model = GPT(small_config(pos_emb="learned")).double().eval()
    seqs = [torch.randint(0, 256, (1, n)) for n in (5, 3)]
    prompt = torch.zeros(2, 5, dtype=torch.long)
    prompt[0], prompt[1, :3] = seqs[0][0], seqs[1][0]
    params = InferenceParams(2, 16)
    with torch.no_grad():
        model(prompt, inference_params=params)
        params.set_sequence_lengths([5, 3])
        nxt = torch.randint(0, 256, (2, 1))
        step = model(nxt, inference_params=params)[:, -1]
        for z, seq in enumerate(seqs):
            alone = model(torch.cat((seq, nxt[z : z + 1]), 1))[0, -1]
            torch.testing.assert_close(step[z], alone, atol=1e-10, rtol=0)
