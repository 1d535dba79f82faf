"""GPT checkpoints: bitwise round trip with resume state, and clear errors on bad files."""

import json
import pickle

import pytest
import torch
from fusedlayers.models import (
    GPT,
    CheckpointError,
    GPTConfig,
    lm_loss,
    load_train_state,
    load_weights,
    read_config,
    save_checkpoint,
    train_state_path,
)
from fusedlayers.models import checkpoint as ckpt_mod
from safetensors.torch import save_file

CONFIG = dict(n_layer=2, d_model=64, context_length=32)


@pytest.fixture(autouse=True)
def fresh_seed():
    print(f"seed {torch.seed()}")


def _train(model, opt, steps):
    for _ in range(steps):
        idx = torch.randint(0, 256, (4, 17))
        loss = lm_loss(model(idx[:, :-1]), idx[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
    return loss


def _setup(**overrides):
    model = GPT(GPTConfig.named("tiny", **{**CONFIG, **overrides}))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    return model, opt


@pytest.fixture
def saved(tmp_path):
    model, opt = _setup()
    _train(model, opt, 2)
    path = save_checkpoint(tmp_path / "ck.safetensors", model, opt, step=2, extra={"a": [1]})
    return path, model, opt


def test_round_trip_is_bitwise_and_resumes_identically(saved):
    path, model, opt = saved
    model2, opt2 = _setup()
    load_weights(path, model2)
    state = load_train_state(path, opt2)
    assert state == {"step": 2, "extra": {"a": [1]}}
    for (n, a), b in zip(model.state_dict().items(), model2.state_dict().values()):
        assert a.dtype == b.dtype and torch.equal(a, b), n
    # The restored RNG makes the next batch identical; then both runs must agree to the bit.
    rng = torch.get_rng_state()
    loss_a = _train(model2, opt2, 2)
    torch.set_rng_state(rng)
    loss_b = _train(model, opt, 2)
    assert torch.equal(loss_a, loss_b)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))


def test_read_config(saved):
    path, model, _ = saved
    assert read_config(path) == model.config


def _expect(path, model, match, opt=None):
    with pytest.raises(CheckpointError, match=match):
        load_weights(path, model)
        load_train_state(path, opt)


def test_truncated_file(saved):
    path, model, _ = saved
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    _expect(path, model, "not a readable safetensors file")


def test_flipped_bit_in_tensor_data(saved):
    path, model, _ = saved
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x10  # inside the last tensor's bytes; the header still parses
    path.write_bytes(bytes(data))
    _expect(path, model, "does not match its sha256")


def test_pickle_is_never_loaded(tmp_path):
    path = tmp_path / "evil.safetensors"
    path.write_bytes(pickle.dumps({"tok_emb.weight": torch.zeros(2)}))
    _expect(path, GPT(GPTConfig.named("tiny", **CONFIG)), "not a readable safetensors file")


def test_missing_file(tmp_path):
    _expect(tmp_path / "nope.safetensors", None, "no such checkpoint file")


def test_wrong_config_names_fields(saved):
    path, _, _ = saved
    other, _ = _setup(n_layer=3, pos_emb="learned")
    _expect(path, other, r"config mismatch: n_layer: file 2 vs model 3; pos_emb: file 'rope'")


def _rewrite(path, edit):
    """Re-save `path` with edited tensors but valid metadata and checksum (a well-formed file
    from some other model)."""
    tensors, meta = ckpt_mod._read(path, ckpt_mod.FORMAT)
    edit(tensors)
    ckpt_mod._write(path, tensors, {k: v for k, v in meta.items() if k != "sha256"})


def test_missing_and_extra_keys(saved):
    path, model, _ = saved
    key = "layers.1.layernorm_mlp.fc2_weight"
    assert key in model.state_dict()

    def edit(t):
        t["bogus.weight"] = t.pop(key)

    _rewrite(path, edit)
    _expect(path, model, rf"missing keys \['{key}'\], unexpected keys \['bogus.weight'\]")


def test_wrong_shape(saved):
    path, model, _ = saved

    def edit(t):
        t["tok_emb.weight"] = t["tok_emb.weight"][:100]

    _rewrite(path, edit)
    _expect(path, model, r"shape mismatch: tok_emb.weight: file \(100, 64\) vs model \(256, 64\)")


def test_not_a_gpt_checkpoint(tmp_path):
    path = tmp_path / "plain.safetensors"
    save_file({"x": torch.zeros(3)}, str(path), metadata={"format": "pt"})
    _expect(path, GPT(GPTConfig.named("tiny", **CONFIG)), "format tag is 'pt'")


def test_train_state_from_other_weights(saved, tmp_path):
    path, model, opt = saved
    stale = train_state_path(path).read_bytes()
    _train(model, opt, 1)
    save_checkpoint(path, model, opt, step=3)
    train_state_path(path).write_bytes(stale)
    _expect(path, model, "belongs to different weights", opt)


def test_train_state_wrong_optimizer(saved):
    path, _, _ = saved
    model, _ = _setup()
    sgd = torch.optim.SGD([p for p in model.parameters()][:3], lr=0.1)
    _expect(path, model, "optimizer has param groups of sizes", sgd)


def test_corrupt_config_json(saved):
    path, model, _ = saved
    tensors, meta = ckpt_mod._read(path, ckpt_mod.FORMAT)
    meta["config"] = json.dumps({**json.loads(meta["config"]), "d_model": 65})
    ckpt_mod._write(path, tensors, {k: v for k, v in meta.items() if k != "sha256"})
    _expect(path, model, r"stored config is invalid: d_model \(65\) must be divisible")
