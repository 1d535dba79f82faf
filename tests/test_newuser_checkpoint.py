"""`save_checkpoint` names its weights file `*.safetensors` whatever path it is given, and the
loaders find the file from the same path."""

import torch
from fusedlayers.models import (
    GPT,
    GPTConfig,
    lm_loss,
    load_train_state,
    load_weights,
    read_config,
    save_checkpoint,
    train_state_path,
)

CONFIG = dict(n_layer=1, d_model=32, n_head=2, n_kv_head=2, context_length=16)


def _trained():
    model = GPT(GPTConfig.named("tiny", **CONFIG))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    idx = torch.randint(0, 256, (2, 9))
    lm_loss(model(idx[:, :-1]), idx[:, 1:]).backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def test_bare_name_gets_the_suffix_and_loads_back(tmp_path):
    model, opt = _trained()
    path = save_checkpoint(tmp_path / "ck", model, opt, step=7, extra={"k": 1})
    assert path == tmp_path / "ck.safetensors"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck.safetensors", "ck.train.safetensors"]
    assert train_state_path(tmp_path / "ck") == train_state_path(path)
    # The caller keeps using the name it gave.
    assert read_config(tmp_path / "ck").d_model == 32
    fresh = GPT(GPTConfig.named("tiny", **CONFIG))
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    load_weights(tmp_path / "ck", fresh)
    assert load_train_state(str(tmp_path / "ck"), fresh_opt) == {"step": 7, "extra": {"k": 1}}
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name
    saved = opt.state_dict()["state"][0]["exp_avg"]
    assert torch.equal(fresh_opt.state_dict()["state"][0]["exp_avg"], saved)


def test_given_suffix_is_kept_and_other_suffixes_extended(tmp_path):
    model, _ = _trained()
    assert save_checkpoint(tmp_path / "a.safetensors", model) == tmp_path / "a.safetensors"
    assert save_checkpoint(str(tmp_path / "b.v2"), model) == tmp_path / "b.v2.safetensors"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.safetensors", "b.v2.safetensors"]
