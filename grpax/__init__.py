"""grpax: JAX-native GRPO post-training for Llama-family language models.

Data flows checkpoint -> model -> sampler -> task rewards -> rl update -> checkpoint; the sub-packages follow that
flow (see README.md).
"""

import logging

__version__ = "0.1.0"

# grpax needs only transformers' torch-free tokenizers: drop its "PyTorch was not found" import banner alone.
logging.getLogger("transformers").addFilter(
    lambda record: not str(record.msg).startswith("PyTorch was not found")
)
