"""Adapters that plug fusedlayers into other frameworks at their own seams.

    fusedlayers.integrations.transformers   Hugging Face transformers' AttentionInterface:
                                            `register()`, then attn_implementation="fusedlayers"

Each adapter imports its framework only when it is imported itself; `import fusedlayers` never
imports any of them.
"""
