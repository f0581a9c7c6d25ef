"""The host's bookkeeping of the paged KV cache: which pages are free, and how many sequences hold each.

The pool lives on the device (``grpax.sampler.backend``: one buffer of ``num_pages`` pages per layer); this
class only hands out page indices. A prompt's full pages are held by each of its G completions (one reference
each) and freed with the last of them; a completion's own pages (the prompt's partial last page copied, then its
new tokens) have one holder. Page 0 is the scratch page idle decode slots write to: never handed out. The same
scheme as vLLM's block manager (Kwon et al. 2023, "Efficient Memory Management for Large Language Model Serving
with PagedAttention"), without copy-on-write: completions append to pages of their own.

The pool's size is decided here too (``pool_pages``: ``num_pages``, else a sequence's worth per decode slot, else
what ``hbm_utilization`` leaves after the params, ``memory_room``), and its placement (``abstract_pool``: the
params' mesh as the backend lays pages out): the engine allocates, and the planner sizes, what these say.
"""

from __future__ import annotations

import collections
import functools
import weakref

import jax
import jax.numpy as jnp
import numpy as np

from grpax import sharding
from grpax.errors import ConfigError
from grpax.host_memory import available_host_bytes
from grpax.models.params import Params
from grpax.models.registry import ModelConfig
from grpax.sampler.keys import SamplerConfig


class PagePool:
    """Free pages and reference counts of a pool of ``num_pages`` pages (page 0 reserved).

    Raises:
      ValueError: fewer than 2 pages.
    """

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"num_pages={num_pages}: the pool needs page 0 (scratch) and at least one more")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, 0, -1))  # popped from the end: low indices first
        self._refs = np.zeros(num_pages, np.int64)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int] | None:
        """``count`` free pages, each with one reference; None (nothing taken) if fewer are free."""
        if count > len(self._free):
            return None
        pages = [self._free.pop() for _ in range(count)]
        self._refs[pages] = 1
        return pages

    def retain(self, pages: list[int]) -> None:
        """One more holder of each of ``pages``."""
        np.add.at(self._refs, pages, 1)

    def release(self, pages: list[int]) -> None:
        """One holder less of each of ``pages``; those left without one are free again."""
        for page in pages:
            assert self._refs[page] > 0, page
            self._refs[page] -= 1
            if self._refs[page] == 0:
                self._free.append(page)


def pool_pages(sampler_cfg: SamplerConfig, num_slots: int, room: tuple[int, int] | None = None) -> int:
    """Pages in the KV pool of an engine of ``num_slots`` decode slots: ``num_pages``, or where it is 0 one scratch
    page and ``pages_per_sequence`` for every slot (each can hold max_prompt_length + max_completion_length
    tokens: the static engine's memory); with ``hbm_utilization`` and ``room`` (``memory_room``: bytes the pool
    may take per device, bytes of one page per device), the pages that fit in that room, at most that many.
    ``Engine``, ``abstract_programs`` and the planner (``grpax.plan.compile_check``) all size the pool here."""
    sc = sampler_cfg
    full = sc.num_pages or 1 + num_slots * sc.pages_per_sequence()
    if not sc.hbm_utilization or room is None:
        return full
    free, page = room
    return min(full, max(0, free // page))


# Engines whose page pools are alive: ``memory_room`` leaves their bytes out of a new engine's room.
LIVE_ENGINES: weakref.WeakSet = weakref.WeakSet()


def hold(engine) -> None:
    """Counts ``engine``'s page pools (its ``pages``) out of every later engine's ``memory_room`` while it lives."""
    LIVE_ENGINES.add(engine)


def bytes_limit(device) -> int | None:
    """The bytes JAX may allocate on ``device`` (``memory_stats()["bytes_limit"]``), None where it reports none."""
    return (device.memory_stats() or {}).get("bytes_limit")


def check_memory_fraction(hbm_utilization: float) -> None:
    """Refuses ``hbm_utilization_vllm`` where this host's devices report no memory size (CPU) before any model
    loads, rather than ``memory_room`` after the load (the same message).

    Raises:
      ConfigError: the key, its value and the fix (num_pages) named.
    """
    if hbm_utilization and bytes_limit(jax.local_devices()[0]) is None:
        raise ConfigError(_no_memory_size(hbm_utilization, jax.local_devices()[0].platform))


def _no_memory_size(hbm_utilization: float, kind: str) -> str:
    return (
        f"hbm_utilization_vllm={hbm_utilization}: the {kind} devices report no memory size; size the KV pool with "
        "num_pages instead (grpax train_rl compile_topology=... suggests one)"
    )


def memory_room(params: Params, cfg: ModelConfig, sampler_cfg: SamplerConfig, backend) -> tuple[int, int]:
    """``(bytes, page bytes)``: what ``hbm_utilization`` of the smallest memory among the params' devices
    (``memory_stats()["bytes_limit"]``) leaves after the params' largest per-device share and the pools of the
    engines alive (a training run's kept rollout engine while an evaluation builds its own), and one page's bytes
    per device (its largest shard of every pool). Reference: vLLM's gpu_memory_utilization (the instance's
    weights and KV cache within the fraction; its activation profile is not counted here).

    Raises:
      ValueError: a device that reports no memory size (CPU): the key and the fix named.
    """
    sc = sampler_cfg
    leaves = [x for x in jax.tree.leaves(params) if hasattr(x, "addressable_shards")]
    devices = {s.device for x in leaves for s in x.addressable_shards} or set(jax.local_devices()[:1])
    limits = [bytes_limit(d) for d in devices]
    if None in limits:
        raise ValueError(_no_memory_size(sc.hbm_utilization, next(iter(devices)).platform))
    held = collections.Counter()  # the params, and the pools of the engines alive (a kept rollout's)
    for x in [*leaves, *(p for engine in list(LIVE_ENGINES) for p in jax.tree.leaves(engine.pages))]:
        for shard in x.addressable_shards:
            held[shard.device] += shard.data.nbytes
    limit = min(limits)
    page = sharding.per_chip_bytes(abstract_pool(params, cfg, sc, backend, 1))
    return int(sc.hbm_utilization * limit) - max(held.values(), default=0), int(page)


def engine_pool_pages(
    params: Params, cfg: ModelConfig, sampler_cfg: SamplerConfig, backend, num_slots: int
) -> int:
    """The pages of a new engine's pool (``pool_pages``, in ``memory_room`` where ``hbm_utilization`` is set),
    checked to hold one whole sequence and to fit the host (``check_host_room``).

    Raises:
      ValueError: a pool that holds no sequence of max_prompt_length + max_completion_length tokens (naming the
        key that sized it and the fix), or that the host cannot hold.
    """
    sc, width = sampler_cfg, sampler_cfg.pages_per_sequence()
    room = memory_room(params, cfg, sc, backend) if sc.hbm_utilization else None
    num_pages = pool_pages(sc, num_slots, room)
    if room is not None and num_pages < 1 + width:
        free, page = room
        raise ValueError(
            f"hbm_utilization_vllm={sc.hbm_utilization}: the KV pool gets {max(free, 0) / 2**30:.2f} GiB per "
            f"device after the params, {num_pages} pages of {sc.page_size} tokens, fewer than one sequence of "
            f"{sc.max_prompt_length + sc.max_completion_length} tokens needs ({1 + width}); raise it, "
            "or pass num_pages"
        )
    if num_pages < 1 + width:
        raise ValueError(
            f"num_pages={num_pages} holds no sequence of max_prompt_length + max_completion_length = "
            f"{sc.max_prompt_length + sc.max_completion_length} tokens in pages of {sc.page_size}: "
            f"pass at least {1 + width}"
        )
    check_host_room(params, cfg, sc, backend, num_pages, num_slots)
    return num_pages


def check_host_room(
    params: Params, cfg: ModelConfig, sampler_cfg: SamplerConfig, backend, num_pages: int, num_slots: int
) -> None:
    """Refuses a KV pool of ``num_pages`` pages that the host's available memory cannot hold
    (``grpax.host_memory.available_host_bytes``), before it is allocated, where the pool lives on devices that
    report no memory size (CPU: there an oversized pool ends in the kernel's OOM killer, with no message).

    Raises:
      ValueError: one line naming the key that sized the pool (num_pages, else max_num_seqs), its value, the
        bytes needed and available, and the largest value that fits.
    """
    sc = sampler_cfg
    leaves = [x for x in jax.tree.leaves(params) if hasattr(x, "addressable_shards")]
    devices = {s.device for x in leaves for s in x.addressable_shards} or set(jax.local_devices()[:1])
    room = available_host_bytes()
    if room is None or any(bytes_limit(d) is not None for d in devices):
        return
    init, _ = pool_init(params, cfg, sc, backend, 1)
    page = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(jax.eval_shape(init)))  # all on this host
    usable = int(room * 0.9)  # a tenth for the prefill's cache, the logits and the programs
    if num_pages * page <= usable:
        return
    fit = max(0, usable // page - 1)  # pages, less the scratch page
    gib = lambda n: f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"  # noqa: E731
    if sc.num_pages:
        raise ValueError(
            f"num_pages={sc.num_pages}: the KV pool needs {gib(num_pages * page)}, more than the {gib(room)} of host "
            f"memory available; pass num_pages <= {fit}"
        )
    tokens = sc.max_prompt_length + sc.max_completion_length
    key = (
        f"max_num_seqs={sc.max_num_seqs}"
        if sc.max_num_seqs
        else f"max_num_seqs=0 ({num_slots} slots: the batch)"
    )
    raise ValueError(
        f"{key}: the KV pool of {num_slots} decode slots of {tokens} tokens needs "
        f"{gib(num_pages * page)}, more than the {gib(room)} of host memory available; pass max_num_seqs <= "
        f"{fit // sc.pages_per_sequence()}, or num_pages <= {fit} (sequences then share the pool)"
    )


def pool_init(params: Params, cfg: ModelConfig, sampler_cfg: SamplerConfig, backend, num_pages: int):
    """(the function that builds the zero page pools, where they are placed): the backend's layout of
    ``num_pages`` pages of ``page_size`` tokens in ``cache_dtype`` (default the model's dtype)."""
    sc = sampler_cfg
    dtype = jnp.dtype(sc.cache_dtype or cfg.dtype)
    init = functools.partial(backend.init_pages, cfg, num_pages, sc.page_size, dtype)
    return init, pool_sharding(params, cfg, backend)


def abstract_pool(params: Params, cfg: ModelConfig, sampler_cfg: SamplerConfig, backend, num_pages: int):
    """The page pools ``Engine`` allocates, as ``jax.ShapeDtypeStruct``s placed as it places them (the params'
    mesh and the backend's ``page_spec``): what ``abstract_programs`` compiles with and the planner sizes.

    Args:
      params: the rollout's params, concrete or ``jax.ShapeDtypeStruct`` with shardings (a device mesh or an
        ``AbstractMesh``).
      backend: ``select_backend``'s choice (its ``init_pages`` and ``page_spec``).
      num_pages: ``pool_pages``.
    """
    init, sharding = pool_init(params, cfg, sampler_cfg, backend, num_pages)
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), jax.eval_shape(init)
    )


def pool_sharding(params: Params, cfg: ModelConfig, backend):
    """Where the page pools live: the params' devices, over their mesh as the backend places them (None: the
    default device)."""
    sharding = getattr(jax.tree.leaves(params)[0], "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(sharding.mesh, backend.page_spec(cfg, dict(sharding.mesh.shape)))
    return sharding
