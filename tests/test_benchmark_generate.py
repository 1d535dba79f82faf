"""The generation benchmark's CPU-checkable parts: its --dry-run pipeline end to end, the plain
static-cache model computing the same function as the fusedlayers GPT, and argument checks."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import benchmark_generate as bg  # noqa: E402

from fusedlayers.bench.record import read_run  # noqa: E402


def test_dry_run_writes_every_provider(tmp_path):
    out = tmp_path / "gen.json"
    run = bg.main(["--dry-run", "--json", str(out)])
    assert read_run(out) == json.loads(json.dumps(run)) and run["kind"] == "generate"
    assert run["header"]["config"] == {
        "config": "tiny", "prompt": 12, "new_tokens": 6, "dtype": "torch.float32",
        "batches": [1, 2],
    }  # fmt: skip
    assert {"date", "torch", "python", "commit", "command"} <= set(run["header"])
    for b in (1, 2):
        rows = {r["provider"]: r for r in run["rows"] if r["batch"] == b}
        assert list(rows) == list(bg.PROVIDERS)
        assert rows["ours-graph"] == {
            "batch": b, "provider": "ours-graph", "config": "tiny", "skipped": "needs CUDA"
        }  # fmt: skip
        for name in ("ours-eager", "plain-eager"):
            assert rows[name]["ms_per_token"] > 0 and rows[name]["tokens_per_s"] > 0
        # fp32, same weights: the plain static-cache model decodes the same greedy tokens.
        assert rows["plain-eager"]["identical_to_ours_eager"]


def test_plain_static_cache_matches_the_gpt():
    """Prefill and decode logits of CachedPlainGPT equal the fusedlayers GPT's (fp64)."""
    c = bg.GPTConfig.named("tiny", n_layer=2)
    ours, plain = bg.build(c, "cpu", torch.float64)
    prompt = torch.randint(0, c.vocab_size, (2, 9))
    plain.setup_cache(2, 16)
    params = bg.InferenceParams(2, 16)
    with torch.no_grad():
        want = ours(prompt)
        got = plain(prompt[:, :6], torch.arange(6))
        params_logits = ours(prompt[:, :6], inference_params=params)
        params.advance(6)
        for i in range(6, 9):
            step = plain(prompt[:, i : i + 1], torch.tensor([i]))
            got = torch.cat((got, step), 1)
            params_logits = torch.cat(
                (params_logits, ours(prompt[:, i : i + 1], inference_params=params)), 1
            )
            params.advance(1)
    # Both build their RoPE tables in fp32: agreement to fp32 rounding of the angles.
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    torch.testing.assert_close(params_logits, want, atol=1e-10, rtol=0)


def test_generate_ours_equals_gpt_generate():
    c = bg.GPTConfig.named("tiny", n_layer=2)
    ours, _ = bg.build(c, "cpu", torch.float32)
    prompt = torch.randint(0, c.vocab_size, (2, 5))
    r = bg.generate_ours(ours, prompt, 6, graph=False)
    assert torch.equal(r["tokens"], ours.generate(prompt, 6, temperature=0)[:, 5:])


def test_bad_providers_are_refused():
    with pytest.raises(SystemExit):
        bg.parse_args(["--providers", "ours-eager,nope"])
