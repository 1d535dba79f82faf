"""fusedlayers.models: a GPT built from `fusedlayers.TransformerLayer`, its config and checkpoints.

from fusedlayers.models import GPT, GPTConfig
model = GPT(GPTConfig.named("tiny"))
logits = model(idx)                                  # idx [b, s] -> [b, s, vocab_size]
out = model.generate(idx, 100, temperature=0.8, top_k=40)
save_checkpoint("run/last.safetensors", model, optimizer, step)
"""

from .checkpoint import (
    CheckpointError,
    load_train_state,
    load_weights,
    read_config,
    save_checkpoint,
    train_state_path,
)
from .config import GPTConfig
from .gpt import GPT, lm_loss

__all__ = [
    "GPT",
    "CheckpointError",
    "GPTConfig",
    "lm_loss",
    "load_train_state",
    "load_weights",
    "read_config",
    "save_checkpoint",
    "train_state_path",
]
