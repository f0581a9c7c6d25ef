"""Device meshes for the trainer and the sampler, and the one table mapping logical axes to mesh axes.

Every weight is declared once with logical axes (``grpax.models.params``: ``wq: ("embed", "q_heads",
"head_dim")``). ``LOGICAL_AXIS_RULES`` (declared beside the model in ``grpax.models.sharding_rules``,
re-exported here) maps each logical axis to mesh axes of a 3-axis mesh ``("data", "fsdp", "tensor")``, as
MaxText's ``logical_axis_rules`` do:

* ``data``: pure data parallelism (rows split, weights replicated);
* ``fsdp``: rows split and weights split on their ``embed`` dimension (ZeRO-3 / FSDP, gathered per use);
* ``tensor``: Megatron tensor parallelism on heads, MLP hidden and vocab;
* ``expert``: expert parallelism (a mixture of experts' experts split, rows split as by ``data`` elsewhere;
  ``grpax.models.moe``); 1 for a dense model.

Params and optimizer state are placed once with ``NamedSharding`` (``shard_params``,
``init_optimizer_state``); a plain ``jax.jit`` of the forward, the sampler or the train step then runs on the
mesh with no change to that code: XLA propagates the shardings and inserts the collectives.

Divisibility policy: a dimension whose size is not a multiple of its mesh axes is *replicated* on those axes
(with one logged warning per weight), never an error. SmolLM2-135M has 9 query and 3 KV heads, so with
``tensor=8`` its attention weights and KV cache are replicated over ``tensor`` while its MLP (1536 = 8 x 192)
and vocab (49152) are still split; the result is exact, only the attention memory saving is lost. A
multi-axis rule such as ``batch -> ("data", "fsdp")`` keeps the longest prefix that divides.

The mesh shape follows MaxText's keys: ``ici_*`` within a slice (or host, for GPUs/CPUs), ``dcn_*`` across
slices (hosts); one ``ici_*`` and one ``dcn_*`` may be -1 (filled from the device count). The sampler gets
its own mesh from ``rollout_data_parallelism`` x ``rollout_tensor_parallelism`` (fsdp=1), the MaxText RL
keys, x ``rollout_expert_parallelism``; ``reshard_for_rollout`` moves the weights when its layout differs from
the trainer's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from grpax.config import ConfigError, field
from grpax.models.params import Params, layer_specs, top_specs
from grpax.models.registry import ModelConfig
from grpax.models.sharding_rules import (  # noqa: F401  (re-exported: the mesh code reads the one table here)
    CACHE_K_AXES,
    CACHE_V_AXES,
    DATA,
    FSDP,
    LOGICAL_AXIS_RULES,
    MESH_AXES,
    TENSOR,
    MeshAxes,
    constrain,
    logical_to_spec,
)

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Mesh shape keys (MaxText names). ``ici_*``: within a slice/host; ``dcn_*``: across slices/hosts."""

    ici_data_parallelism: int = field(1, "data-parallel ways within a slice (-1: fill from device count)")
    ici_fsdp_parallelism: int = field(-1, "FSDP ways within a slice (weights split on embed; -1: fill)")
    ici_tensor_parallelism: int = field(1, "tensor-parallel ways within a slice (heads/mlp/vocab; -1: fill)")
    dcn_data_parallelism: int = field(
        -1, "data-parallel ways across slices/hosts (-1: fill from slice count)"
    )
    dcn_fsdp_parallelism: int = field(1, "FSDP ways across slices/hosts")
    dcn_tensor_parallelism: int = field(1, "tensor-parallel ways across slices/hosts (rarely useful)")
    ici_expert_parallelism: int = field(
        1, "expert-parallel ways within a slice (a mixture of experts' experts and the rows split; -1: fill)"
    )
    dcn_expert_parallelism: int = field(1, "expert-parallel ways across slices/hosts")
    chips_per_vm: int | None = field(
        0, "devices per host, checked against jax.local_device_count(); 0 = auto"
    )
    allow_split_physical_axes: bool = field(False, "let a mesh axis span a split TPU torus axis")
    rollout_data_parallelism: int = field(1, "sampler data-parallel ways (-1: sampler devices / tp)")
    rollout_tensor_parallelism: int = field(-1, "sampler tensor-parallel ways (-1: sampler devices / dp)")
    rollout_expert_parallelism: int = field(
        1, "sampler expert-parallel ways (a mixture of experts'); dp x tp x this = the sampler's devices"
    )
    rollout_devices: int = field(
        0,
        "devices of the sampler's own mesh (the first M; the trainer's mesh takes the rest, the weights are "
        "copied over after each update: time/reshard_s); 0 = the sampler shares the trainer's devices",
    )


def per_chip_bytes(tree) -> int:
    """Bytes of the largest shard of each leaf (arrays or ``ShapeDtypeStruct``s with a sharding), summed: one
    chip's."""
    return sum(
        math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize  # PRNG keys too (key<fry>: 8)
        for x in jax.tree.leaves(tree)
    )


# ---------------------------------------------------------------------------------------------- meshes


def _fill(values: Sequence[int], total: int, names: Sequence[str], what: str) -> tuple[int, ...]:
    """Replaces at most one -1 in ``values`` so that their product is ``total``; raises naming the keys."""
    values = [int(v) for v in values]
    auto = [i for i, v in enumerate(values) if v == -1]
    shown = ", ".join(f"{n}={v}" for n, v in zip(names, values, strict=True))
    if len(auto) > 1:
        raise ConfigError(f"at most one of {', '.join(names)} can be -1 (auto); got {shown}")
    if any(v == 0 or v < -1 for v in values):
        raise ConfigError(f"parallelism must be a positive integer or -1; got {shown}")
    known = math.prod(v for v in values if v != -1)
    if auto:
        if total % known:
            raise ConfigError(
                f"{what} ({total}) is not divisible by the product of the fixed keys "
                f"({known}: {shown}), so {names[auto[0]]}=-1 cannot be filled"
            )
        values[auto[0]] = total // known
    elif known != total:
        raise ConfigError(f"{' * '.join(names)} = {known} ({shown}) must equal {what} ({total})")
    return tuple(values)


def _granules(devices: Sequence[jax.Device]) -> tuple[int, bool]:
    """(number of DCN granules, whether they are processes): TPU slices when present, else hosts."""
    slices = {getattr(d, "slice_index", None) for d in devices}
    if None not in slices and len(slices) > 1:
        return len(slices), False
    return len({d.process_index for d in devices}), True


def check_chips_per_vm(mesh_cfg: MeshConfig) -> None:
    """Raises ``ConfigError`` when ``chips_per_vm`` is set and differs from ``jax.local_device_count()``."""
    if mesh_cfg.chips_per_vm and mesh_cfg.chips_per_vm != jax.local_device_count():
        raise ConfigError(
            f"chips_per_vm={mesh_cfg.chips_per_vm} but this host sees {jax.local_device_count()} "
            f"{jax.default_backend()} devices ({jax.local_devices()[0].device_kind}); set chips_per_vm="
            f"{jax.local_device_count()} or 0 (auto)"
        )


def _build(
    ici: Sequence[int],
    dcn: Sequence[int],
    devices: Sequence[jax.Device],
    allow_split: bool,
    axis_names: Sequence[str],
) -> Mesh:
    num_granules, process_is_granule = _granules(devices)
    if math.prod(dcn) > 1:
        arr = mesh_utils.create_hybrid_device_mesh(
            ici, dcn, devices, process_is_granule=process_is_granule, allow_split_physical_axes=allow_split
        )
    else:
        arr = mesh_utils.create_device_mesh(ici, devices, allow_split_physical_axes=allow_split)
    return Mesh(arr, tuple(axis_names))


def create_mesh(mesh_cfg: MeshConfig | None = None, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The trainer mesh, axes ``("data", "fsdp", "tensor", "expert")``, each of size ``ici_* x dcn_*``.

    Args:
      mesh_cfg: the mesh keys (default ``MeshConfig()``: all devices on fsdp within a host, data across).
      devices: the devices to use (default ``jax.devices()``, all processes).

    Returns:
      A ``jax.sharding.Mesh`` of shape (data, fsdp, tensor).

    Raises:
      ConfigError: a product of keys that does not match the device (or slice) count, naming the keys;
        two -1 among ``ici_*`` or ``dcn_*``; ``chips_per_vm`` differing from the local device count.
    """
    mesh_cfg = mesh_cfg or MeshConfig()
    check_chips_per_vm(mesh_cfg)
    devices = list(devices if devices is not None else jax.devices())
    num_granules, _ = _granules(devices)
    dcn = _fill(
        [getattr(mesh_cfg, f"dcn_{a}_parallelism") for a in MESH_AXES],
        num_granules,
        [f"dcn_{a}_parallelism" for a in MESH_AXES],
        "the number of slices/hosts",
    )
    if len(devices) % num_granules:
        raise ConfigError(f"{len(devices)} devices do not split evenly over {num_granules} slices/hosts")
    ici = ici_shape(mesh_cfg, len(devices) // num_granules)
    mesh = _build(ici, dcn, devices, mesh_cfg.allow_split_physical_axes, MESH_AXES)
    log.info("trainer mesh %s (ici %s, dcn %s)", dict(mesh.shape), ici, dcn)
    return mesh


def ici_shape(
    mesh_cfg: MeshConfig, num_devices: int, what: str = "the number of devices per slice/host"
) -> tuple[int, ...]:
    """(data, fsdp, tensor, expert) of ``num_devices`` devices joined by ICI (one slice or host) from the ``ici_*``
    keys (one -1: the rest). Raises ConfigError naming the keys and ``what`` when their product is not the count."""
    return _fill(
        [getattr(mesh_cfg, f"ici_{a}_parallelism") for a in MESH_AXES],
        num_devices,
        [f"ici_{a}_parallelism" for a in MESH_AXES],
        what,
    )


def rollout_parallelism(mesh_cfg: MeshConfig, num_devices: int) -> tuple[int, int]:
    """Resolves ``(rollout_data_parallelism, rollout_tensor_parallelism)`` for ``num_devices`` sampler devices.

    At most one key may be -1; it is derived so that dp x tp = ``num_devices`` (MaxText RL's rule).

    Raises:
      ConfigError: both keys -1; the other key does not divide ``num_devices``; dp x tp != ``num_devices``.
    """
    dp, tp = mesh_cfg.rollout_data_parallelism, mesh_cfg.rollout_tensor_parallelism
    if dp == -1 and tp == -1:
        raise ConfigError(
            "at most one of rollout_data_parallelism, rollout_tensor_parallelism can be -1 "
            f"(auto-derived); got both -1. Set one of them, e.g. rollout_data_parallelism=1 "
            f"for {num_devices}-way tensor parallelism"
        )
    for name, v in (("rollout_data_parallelism", dp), ("rollout_tensor_parallelism", tp)):
        if v == 0 or v < -1:
            raise ConfigError(f"{name}={v}: expected a positive integer or -1")
    if dp == -1 or tp == -1:
        fixed_name, fixed = (
            ("rollout_tensor_parallelism", tp) if dp == -1 else ("rollout_data_parallelism", dp)
        )
        auto_name = "rollout_data_parallelism" if dp == -1 else "rollout_tensor_parallelism"
        if num_devices % fixed:
            raise ConfigError(
                f"num_sampler_devices ({num_devices}) must be divisible by {fixed_name} ({fixed}) "
                f"when {auto_name} is -1"
            )
        return (num_devices // tp, tp) if dp == -1 else (dp, num_devices // dp)
    if dp * tp != num_devices:
        raise ConfigError(
            f"rollout_tensor_parallelism ({tp}) * rollout_data_parallelism ({dp}) != "
            f"number of sampler devices ({num_devices})"
        )
    return dp, tp


def create_meshes(
    mesh_cfg: MeshConfig | None = None, devices: Sequence[jax.Device] | None = None
) -> tuple[Mesh, Mesh]:
    """The trainer's mesh and the sampler's: on the same devices, or with ``rollout_devices=M`` the sampler on
    the first M devices and the trainer on the others.

    Raises:
      ConfigError: ``rollout_devices`` outside 0 .. devices - 1, with several processes; and the errors of
        ``create_mesh`` / ``create_rollout_mesh`` for each device set.
    """
    mesh_cfg = mesh_cfg or MeshConfig()
    devices = list(devices if devices is not None else jax.devices())
    M = mesh_cfg.rollout_devices
    if M == 0:
        return create_mesh(mesh_cfg, devices), create_rollout_mesh(mesh_cfg, devices)
    if len(devices) == 1 and M:
        raise ConfigError(
            f"rollout_devices={M} splits the devices between the sampler and the trainer, but there is 1 device: "
            "use rollout_devices=0 (the sampler shares it)"
        )
    if not 0 < M < len(devices):
        raise ConfigError(
            f"rollout_devices={M}: expected 0 (shared) or 1 .. {len(devices) - 1} of the {len(devices)} devices "
            "(the trainer keeps the rest)"
        )
    if len({d.process_index for d in devices}) > 1:
        raise ConfigError(
            f"rollout_devices={M} splits one process's devices only; with several hosts use rollout_devices=0"
        )
    return create_mesh(mesh_cfg, devices[M:]), create_rollout_mesh(mesh_cfg, devices[:M])


def create_rollout_mesh(
    mesh_cfg: MeshConfig | None = None, devices: Sequence[jax.Device] | None = None
) -> Mesh:
    """The sampler mesh: axes ``("data", "fsdp", "tensor", "expert")`` of shape (dp, 1, tp, ep).

    Tensor and expert parallelism stay within a slice/host; across several slices/hosts data parallelism spans
    them.

    Args:
      mesh_cfg: reads ``rollout_data_parallelism``, ``rollout_tensor_parallelism`` and
        ``rollout_expert_parallelism`` (ep).
      devices: the sampler's devices (default ``jax.devices()``: colocated with the trainer).

    Raises:
      ConfigError: see ``rollout_parallelism`` (over the devices / ep); ep not dividing the devices; or dp not a
        multiple of the number of slices/hosts.
    """
    mesh_cfg = mesh_cfg or MeshConfig()
    check_chips_per_vm(mesh_cfg)
    devices = list(devices if devices is not None else jax.devices())
    ep = mesh_cfg.rollout_expert_parallelism
    if ep < 1 or len(devices) % ep:
        raise ConfigError(
            f"rollout_expert_parallelism={ep}: expected a positive divisor of the {len(devices)} sampler devices"
        )
    dp, tp = rollout_parallelism(mesh_cfg, len(devices) // ep)
    num_granules, _ = _granules(devices)
    if dp % num_granules:
        raise ConfigError(
            f"rollout_data_parallelism={dp} must be a multiple of the number of slices/hosts "
            f"({num_granules}): tensor parallelism does not cross hosts; pass rollout_data_parallelism="
            f"{num_granules} (with rollout_tensor_parallelism=-1: {len(devices) // num_granules}-way within each)"
        )
    mesh = _build(
        (dp // num_granules, 1, tp, ep),
        (num_granules, 1, 1, 1),
        devices,
        mesh_cfg.allow_split_physical_axes,
        MESH_AXES,
    )
    log.info("rollout mesh %s", dict(mesh.shape))
    return mesh


# ------------------------------------------------------------------------------------ logical -> mesh


def _is_axes(x: Any) -> bool:
    return isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)


def logical_to_sharding(
    axes_tree: Any, mesh: Mesh, rules: Sequence[tuple[str, MeshAxes]] = LOGICAL_AXIS_RULES, shapes: Any = None
) -> Any:
    """Maps a tree of logical-axes tuples to a tree of ``NamedSharding`` on ``mesh``.

    Args:
      axes_tree: pytree whose leaves are tuples of logical axis names (``grpax.models.params.logical_axes``).
      mesh: the device mesh.
      rules: the logical -> mesh table.
      shapes: optional matching tree of arrays / ``ShapeDtypeStruct``s; enables the divisibility fallback
        (replicate, with a warning) described in the module docstring.

    Raises:
      ValueError: a clash (one mesh axis on two dims of a weight) or a logical axis with no rule.
    """
    mesh_shape = dict(mesh.shape)
    paths_axes, treedef = jax.tree_util.tree_flatten_with_path(axes_tree, is_leaf=_is_axes)
    shape_leaves = [None] * len(paths_axes)
    if shapes is not None:
        shape_leaves = [tuple(x.shape) for x in treedef.flatten_up_to(shapes)]
    out = []
    for (path, axes), shape in zip(paths_axes, shape_leaves, strict=True):
        spec = logical_to_spec(
            axes, rules, shape=shape, mesh_shape=mesh_shape, name=jax.tree_util.keystr(path)
        )
        out.append(NamedSharding(mesh, spec))
    return treedef.unflatten(out)


# --------------------------------------------------------------------------------------------- params


def _axes_by_name() -> dict[str, tuple[str, ...]]:
    """Weight name -> logical axes of one unstacked weight; the axes do not depend on sizes."""
    tiny = ModelConfig(  # every family weight switched on
        vocab_size=1, hidden_dim=1, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=2, mlp_dim=1,
        attention_bias=True, qk_norm=True, post_norms=True, attention_out_bias=True, attention_sinks=True,
    )  # fmt: skip
    moe = tiny.replace(
        num_experts=1, num_experts_per_tok=1, moe_mlp_dim=1, router_bias=True, expert_bias=True
    )
    out = {name: axes for name, (_, axes) in {**layer_specs(tiny), **layer_specs(moe)}.items()}
    out.update({name: axes for name, (_, axes) in top_specs(tiny).items()})
    out["lm_head"] = ("embed", "vocab")
    return out


def params_logical_axes(params: Params) -> Params:
    """Logical axes of an actual params tree, stacked (``layers`` a dict of [L, ...]) or a list of layers.

    A weight may be a ``grpax.models.lora.LoraWeight`` (the LoRA sampler's ``lora.apply``: W its weight's axes,
    A and B ``lora.part_axes``) or a QLoRA ``QuantizedWeight`` (its codes and scales take the weight's axes,
    a dim that does not divide replicated by the fallback of ``logical_to_sharding``)."""
    from grpax.models import lora

    names = _axes_by_name()

    def leaf(path, x):
        keys = [getattr(p, "key", getattr(p, "name", None)) for p in path]
        if keys[-1] in ("qvalue", "scale"):  # a QuantizedWeight's arrays
            keys = keys[:-1]
        part = keys.pop() if keys[-1] in ("w", "a", "b") and len(keys) > 1 else "w"  # a LoraWeight's
        name = keys[-1]
        if name not in names:
            raise ValueError(f"{jax.tree_util.keystr(path)}: not a known weight ({', '.join(names)})")
        return lora.part_axes(name, part, names[name], x.ndim)

    return jax.tree_util.tree_map_with_path(leaf, params)


def param_shardings(
    cfg: ModelConfig,
    mesh: Mesh,
    rules: Sequence[tuple[str, MeshAxes]] = LOGICAL_AXIS_RULES,
    params: Params | None = None,
) -> Params:
    """``NamedSharding`` tree for the params of ``cfg`` (layout of ``params`` when given, else of ``cfg``)."""
    from grpax.models.params import abstract_params, logical_axes

    if params is None:
        return logical_to_sharding(logical_axes(cfg), mesh, rules, shapes=abstract_params(cfg))
    return logical_to_sharding(params_logical_axes(params), mesh, rules, shapes=params)


def _put(x: Any, sharding: NamedSharding) -> jax.Array:
    """Places ``x`` with ``sharding``; multi-process safe (every process holds the same full host value)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return jax.jit(lambda a: a, out_shardings=sharding)(x)
    if jax.process_count() == 1:
        return jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def shard_params(
    params: Params, cfg: ModelConfig, mesh: Mesh, rules: Sequence[tuple[str, MeshAxes]] = LOGICAL_AXIS_RULES
) -> Params:
    """Places every weight on ``mesh`` by the rules table (``jax.device_put``); layout as given.

    With several processes every process must pass the same full values (e.g. from the same checkpoint or
    the same init key); each keeps only its own shards.
    """
    shardings = param_shardings(cfg, mesh, rules, params=params)
    return jax.tree.map(_put, params, shardings)


def _tree_shardings_like(tree: Any, params: Params, mesh: Mesh) -> Any:
    """For each leaf of ``tree`` (an optimizer state): the sharding of the params leaf it mirrors.

    A leaf mirrors a params leaf when its key path ends with that leaf's path and the shapes agree
    (optax's ``mu``, ``nu``, ... are params-shaped subtrees); other leaves (step counts) are replicated.
    """
    by_path = {tuple(path): x for path, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    replicated = NamedSharding(mesh, P())

    def leaf(path, x):
        path = tuple(path)
        for start in range(len(path)):
            p = by_path.get(path[start:])
            if p is not None and tuple(p.shape) == tuple(x.shape):
                return p.sharding
        return replicated

    return jax.tree_util.tree_map_with_path(leaf, tree)


def optimizer_state_shardings(tx: Any, params: Params, mesh: Mesh) -> Any:
    """Shardings of ``tx.init(params)``: params-shaped leaves follow ``params``, the rest replicated."""
    return _tree_shardings_like(jax.eval_shape(tx.init, params), params, mesh)


def init_optimizer_state(tx: Any, params: Params, mesh: Mesh) -> Any:
    """``tx.init(params)`` computed on the mesh with each moment sharded like its weight (no gather)."""
    return jax.jit(tx.init, out_shardings=optimizer_state_shardings(tx, params, mesh))(params)


# ----------------------------------------------------------------------------------- batch and cache


def batch_sharding(
    x: Any,
    mesh: Mesh,
    rules: Sequence[tuple[str, MeshAxes]] = LOGICAL_AXIS_RULES,
    global_rows: int | None = None,
) -> NamedSharding:
    """Sharding of one batch array: dim 0 over ``("data", "fsdp")`` (longest dividing prefix), rest replicated."""
    if np.ndim(x) == 0:
        return NamedSharding(mesh, P())
    shape = (global_rows or np.shape(x)[0], *np.shape(x)[1:])
    axes = ("batch",) + (None,) * (len(shape) - 1)
    return NamedSharding(
        mesh, logical_to_spec(axes, rules, shape=shape, mesh_shape=dict(mesh.shape), name="batch")
    )


def shard_batch(batch: Any, mesh: Mesh, rules: Sequence[tuple[str, MeshAxes]] = LOGICAL_AXIS_RULES) -> Any:
    """Places a pytree of batch arrays [B, ...] with rows split over ``("data", "fsdp")``.

    With one process ``batch`` is the global batch. With several, each process passes its own rows
    (``grpax.distributed.local_rows``) and the global batch is their concatenation in process order.
    """
    n = jax.process_count()
    if n == 1:
        return jax.tree.map(lambda x: jax.device_put(x, batch_sharding(x, mesh, rules)), batch)

    def put(x):
        x = np.asarray(x)
        global_rows = x.shape[0] * n if x.ndim else None
        sharding = batch_sharding(x, mesh, rules, global_rows=global_rows)
        global_shape = (global_rows, *x.shape[1:]) if x.ndim else ()
        return jax.make_array_from_process_local_data(sharding, x, global_shape)

    return jax.tree.map(put, batch)


def shard_global_batch(
    batch: Any, mesh: Mesh, rules: Sequence[tuple[str, MeshAxes]] = LOGICAL_AXIS_RULES
) -> Any:
    """Places a pytree of batch arrays [B, ...] that every process holds in full (the same values).

    Rows are split over ``("data", "fsdp")`` like ``shard_batch``; each process keeps only the rows of its
    own devices (``jax.make_array_from_callback``). With one process this is ``shard_batch``.
    """
    return jax.tree.map(lambda x: _put(x, batch_sharding(x, mesh, rules)), batch)


def cache_sharding(
    cfg: ModelConfig,
    mesh: Mesh,
    batch_size: int | None = None,
    max_length: int | None = None,
    rules: Sequence[tuple[str, MeshAxes]] = LOGICAL_AXIS_RULES,
) -> dict[str, NamedSharding]:
    """``{"k", "v"}`` shardings for the stacked KV cache of ``grpax.models.llama.init_cache``.

    Keys are [L, B, K, H, S] and values [L, B, K, S, H]. Rows follow the batch (``data``, ``fsdp``), KV heads
    follow ``tensor``; a size that does not divide is replicated. Without ``batch_size`` the row split is not
    checked for divisibility.
    """
    L, B, K, H = (
        cfg.num_layers,
        batch_size or math.prod(dict(mesh.shape).values()),
        cfg.num_kv_heads,
        cfg.head_dim,
    )
    S = max_length or 1
    mesh_shape = dict(mesh.shape)
    k = logical_to_spec(CACHE_K_AXES, rules, shape=(L, B, K, H, S), mesh_shape=mesh_shape, name="kv cache")
    v = logical_to_spec(CACHE_V_AXES, rules, shape=(L, B, K, S, H), mesh_shape=mesh_shape, name="kv cache")
    return {"k": NamedSharding(mesh, k), "v": NamedSharding(mesh, v)}


# -------------------------------------------------------------------------------------- trainer -> sampler


def rounded_dtype(dtype: Any, compute_dtype: Any) -> np.dtype:
    """``compute_dtype`` for a floating ``dtype`` wider than it (None: ``dtype``), else ``dtype``."""
    dtype = np.dtype(dtype)
    if compute_dtype is None or not jax.numpy.issubdtype(dtype, jax.numpy.floating):
        return dtype
    compute_dtype = jax.numpy.dtype(compute_dtype)
    return compute_dtype if dtype.itemsize > compute_dtype.itemsize else dtype


def narrow(x: Any, dtype: Any) -> Any:
    """``x`` rounded to ``dtype`` when it is a wider floating array (``rounded_dtype``), else ``x`` itself."""
    target = rounded_dtype(x.dtype, dtype)
    return x if target == x.dtype else x.astype(target)


def _quantised(x: Any) -> bool:
    from grpax.models.quantize import QuantizedWeight

    return isinstance(x, QuantizedWeight)


def reshard_for_rollout(
    params: Params,
    trainer_mesh: Mesh,
    rollout_mesh: Mesh,
    rules: Sequence[tuple[str, MeshAxes]] = LOGICAL_AXIS_RULES,
    dtype: Any = None,
) -> tuple[Params, float]:
    """The trainer's params laid out for the sampler's mesh.

    Args:
      params: the params tree placed on ``trainer_mesh``.
      trainer_mesh: the trainer's mesh.
      rollout_mesh: the sampler's mesh (``create_rollout_mesh``).
      dtype: the model's compute dtype (``ModelConfig.dtype``), or None: when the weights are copied, wider
        floating weights (float32 master weights) are copied rounded to it, as the sampler reads them
        anyway (its forward and ``prepare_decode`` round every weight to the compute dtype): half the bytes
        moved and held, and no second, rounded copy in the decode.

    Returns:
      (params on the rollout layout, seconds spent copying). When every weight already has an equivalent
      layout (same devices, same split) the very same ``params`` object is returned with 0.0 seconds: no
      copy. Otherwise the weights are copied (``jax.device_put``, blocked until done; rounded leaf by leaf on
      the trainer's devices first with ``dtype``), so trainer and sampler copies coexist while sampling.
    """
    if trainer_mesh is rollout_mesh:
        return params, 0.0
    targets = logical_to_sharding(params_logical_axes(params), rollout_mesh, rules, shapes=params)
    leaves, treedef = jax.tree.flatten(params)
    target_leaves = treedef.flatten_up_to(targets)
    same = all(
        isinstance(x, jax.Array) and x.sharding.is_equivalent_to(s, x.ndim)
        for x, s in zip(leaves, target_leaves, strict=True)
    )
    if same:
        return params, 0.0
    # QLoRA's quantised weights (the adapters sampler's base) are copied as they are: their scales rounded
    # would change the dequantised values.
    kept = {
        id(x)
        for w in jax.tree.leaves(params, is_leaf=_quantised)
        if _quantised(w)
        for x in jax.tree.leaves(w)
    }
    start = time.perf_counter()
    out = jax.block_until_ready(
        [
            _put(x if id(x) in kept else narrow(x, dtype), s)
            for x, s in zip(leaves, target_leaves, strict=True)
        ]
    )
    seconds = time.perf_counter() - start
    log.info("resharded params for rollout in %.3f s", seconds)
    return treedef.unflatten(out), seconds


def mesh_context(mesh: jax.sharding.Mesh | None):
    """``jax.set_mesh(mesh)`` (activation sharding constraints apply inside), or nothing."""
    return jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()
