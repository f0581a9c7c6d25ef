"""Optional speed-ups of the sampler, each behind its one seam (``grpax.sampler.backend``).

A backend supplies its own weight layout, prefill and decode step; the sampler keeps the algorithm. Nothing
imports a backend except ``grpax.sampler.backend.select_backend``, which chooses one per ``generate`` call.
"""
