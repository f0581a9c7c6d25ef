"""grpax: JAX-native GRPO post-training for Llama-family language models.

Data flows checkpoint -> model -> sampler -> rewards -> rl update -> checkpoint; the sub-packages follow that
flow (see README.md).
"""

__version__ = "0.1.0"
