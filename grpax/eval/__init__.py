"""Evaluation and its statistics, shared by ``grpax train_rl`` (before, during, after) and ``grpax evaluate``.

``keys`` (the evaluation keys and their checks), ``evaluate`` (sample, score, summarise), ``metrics``
(accuracy, pass@k, maj@k with Wilson intervals), ``compare`` (the paired before/after sign test).
"""
