"""The CPU backend: the sampler's prefill and decode step on C++ kernels, for one CPU device.

``build`` compiles the kernels (``kernels/*.cc``) at first use, ``ops`` calls them through the XLA FFI and
``backend`` runs the model's block on them (``CpuBackend``). Imported only by
``grpax.sampler.backend.select_backend`` when it may choose this backend (params on one CPU device).
"""

from grpax.backends.cpu.backend import CpuBackend, unavailable_reason

__all__ = ["CpuBackend", "unavailable_reason"]
