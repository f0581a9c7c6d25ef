"""The logical axes of the model's arrays and the one table mapping them to mesh axes.

Every weight is declared once with logical axes (``grpax.models.params``: ``wq: ("embed", "q_heads",
"head_dim")``); ``LOGICAL_AXIS_RULES`` maps each logical axis to mesh axes of a 4-axis mesh
``("data", "fsdp", "tensor", "expert")``, as MaxText's ``logical_axis_rules`` do. ``expert`` (MaxText's
expert parallelism) splits a mixture of experts' experts, and the rows like ``data`` elsewhere
(``grpax.models.moe``: each chip computes its own experts for every token of the expert group); a dense
model's run leaves it at 1. ``constrain`` pins an activation's
layout inside ``jax.set_mesh(mesh)`` and is a no-op outside one. The meshes themselves, and placing params and
batches on them, are ``grpax.sharding``'s (which re-exports these names); this module lives beside the model
so that the model imports nothing from above it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import jax
from jax.sharding import PartitionSpec as P

log = logging.getLogger(__name__)

DATA, FSDP, TENSOR, EXPERT = "data", "fsdp", "tensor", "expert"
MESH_AXES = (DATA, FSDP, TENSOR, EXPERT)

MeshAxes = str | tuple[str, ...] | None

# The one table: logical axis -> mesh axis (or axes, major first, or None = replicated).
LOGICAL_AXIS_RULES: tuple[tuple[str, MeshAxes], ...] = (
    # weights (grpax.models.params)
    ("vocab", TENSOR),
    ("embed", FSDP),
    ("q_heads", TENSOR),
    ("kv_heads", TENSOR),
    ("mlp", TENSOR),
    ("head_dim", None),
    ("layers", None),
    ("norm", None),
    ("experts", EXPERT),
    # activations [B, T, ...]
    ("batch", (DATA, FSDP, EXPERT)),
    ("length", None),
    ("act_embed", None),
    ("act_heads", TENSOR),
    ("act_kv_heads", TENSOR),
    ("act_mlp", TENSOR),
    ("act_vocab", TENSOR),
    # the vocabulary projection of the trainer (grpax.rl.train_step.completion_logprobs): logits and the head
    # split over the vocabulary on fsdp too, tokens only over data (and expert), so no chip gathers the head
    ("head_batch", (DATA, EXPERT)),
    ("head_vocab", (TENSOR, FSDP)),
    # KV cache: keys [L, B, K, H, S], values [L, B, K, S, H] (grpax.models.llama.init_cache)
    ("cache_layers", None),
    ("cache_batch", (DATA, FSDP, EXPERT)),
    ("cache_length", None),
    ("cache_kv_heads", TENSOR),
    ("cache_head_dim", None),
)

CACHE_K_AXES = ("cache_layers", "cache_batch", "cache_kv_heads", "cache_head_dim", "cache_length")
CACHE_V_AXES = ("cache_layers", "cache_batch", "cache_kv_heads", "cache_length", "cache_head_dim")


def _rules_dict(rules: Sequence[tuple[str, MeshAxes]]) -> dict[str, tuple[str, ...]]:
    out = {}
    for logical, mesh_axes in rules:
        out[logical] = (
            () if mesh_axes is None else ((mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes))
        )
    return out


_warned: set[str] = set()


def logical_to_spec(
    axes: Sequence[str | None],
    rules: Sequence[tuple[str, MeshAxes]] = LOGICAL_AXIS_RULES,
    *,
    shape: Sequence[int] | None = None,
    mesh_shape: dict[str, int] | None = None,
    name: str = "array",
) -> P:
    """The ``PartitionSpec`` of one array from its logical axes.

    Args:
      axes: one logical axis name (or None) per dimension.
      rules: the logical -> mesh table.
      shape: the array's shape; with ``mesh_shape``, a dimension not divisible by its mesh axes keeps the
        longest dividing prefix of them (replicated when none), logging a warning naming ``name``.
      mesh_shape: mesh axis name -> size.
      name: used in messages.

    Raises:
      ValueError: a logical axis missing from ``rules``; the same mesh axis used by two dimensions (a clash);
        ``shape`` and ``axes`` of different lengths.
    """
    table = _rules_dict(rules)
    if shape is not None and len(shape) != len(axes):
        raise ValueError(f"{name}: shape {tuple(shape)} has {len(shape)} dims but logical axes {tuple(axes)}")
    used: dict[str, str] = {}
    spec = []
    for i, logical in enumerate(axes):
        if logical is None:
            spec.append(None)
            continue
        if logical not in table:
            raise ValueError(f"{name}: logical axis {logical!r} has no rule; known: {', '.join(table)}")
        mesh_axes = table[logical]
        for m in mesh_axes:
            if m in used:
                raise ValueError(
                    f"{name}: mesh axis {m!r} is used twice (by logical axes {used[m]!r} and "
                    f"{logical!r}); fix the rules table"
                )
            used[m] = logical
        if mesh_axes and shape is not None and mesh_shape is not None:
            sizes = [mesh_shape.get(m, 1) for m in mesh_axes]
            keep = len(mesh_axes)
            while keep and shape[i] % math.prod(sizes[:keep]):
                keep -= 1
            if keep < len(mesh_axes):
                msg = (
                    f"{name}: dim {i} ({logical}) of size {shape[i]} is not divisible by mesh axes "
                    f"{mesh_axes} of sizes {sizes}; replicating it over {mesh_axes[keep:]}"
                )
                if logical == "batch":  # every device then computes every row: the data parallelism is lost
                    msg += (
                        f" (each of those devices computes every row): make the rows (batch_size x num_generations, "
                        f"or eval_batch_size x num_eval_passes) a multiple of {math.prod(sizes)}, or change the "
                        "mesh (ici_data_parallelism / ici_fsdp_parallelism)"
                    )
                if msg not in _warned:
                    _warned.add(msg)
                    log.warning(msg)
            mesh_axes = mesh_axes[:keep]
        # Size-1 mesh axes are dropped so equal layouts on differently-shaped meshes compare equal.
        if mesh_shape is not None:
            mesh_axes = tuple(m for m in mesh_axes if mesh_shape.get(m, 1) > 1)
        spec.append(None if not mesh_axes else (mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes))
    while spec and spec[-1] is None:
        spec.pop()
    return P(*spec)


def constrain(
    x: jax.Array,
    logical_axes: Sequence[str | None],
    rules: Sequence[tuple[str, MeshAxes]] = LOGICAL_AXIS_RULES,
) -> jax.Array:
    """``with_sharding_constraint`` by logical axes inside ``jax.set_mesh(mesh)``; a no-op outside a mesh.

    Args:
      x: an activation, e.g. the residual stream [B, T, D] with ``("batch", "length", "act_embed")``.
      logical_axes: one logical axis (or None) per dim of ``x``.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    spec = logical_to_spec(logical_axes, rules, shape=x.shape, mesh_shape=dict(mesh.shape), name="activation")
    return jax.lax.with_sharding_constraint(x, spec)
