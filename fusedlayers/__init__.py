"""fusedlayers: TransformerEngine-style attention layers on Triton flash-attention kernels."""

__version__ = "0.1.0"
