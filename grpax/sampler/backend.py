"""The sampler's one seam: how a backend runs the model's prefill and decode step on the paged KV cache.

The sampler (``grpax.sampler.engine``) keeps the algorithm: buckets, the page tables and the pool's free pages,
the scheduling of sequences into decode slots, the on-device loop with early exit, per-sequence positions and
noise, stop bookkeeping. A backend supplies the weight layout, the layout of the page pools (``init_pages``),
the prefill (into a dense cache of the prompt bucket, then ``write_prompts`` into the pages) and the decode step
over the pages. ``XlaBackend`` is the model's own ``forward`` in XLA's ops
(any device, any mesh); ``grpax.backends.cpu.CpuBackend`` runs them on C++ kernels on one CPU device.
``select_backend`` chooses one per ``generate`` call (``SamplerConfig.backend``), the only place that imports a
backend, so that GPU and TPU runs never import the CPU kernels. The shape follows MaxText's ``attention=`` key:
one choice, no switch per op.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from grpax.models.attention import ragged_tpu_takes, write_pages
from grpax.models.llama import decode_paged, forward, logits_from_hidden
from grpax.models.lora import LoraWeight
from grpax.models.params import Params, convert_layout
from grpax.models.quantize import QuantizedWeight
from grpax.models.registry import ModelConfig

BACKENDS = ("auto", "xla", "cpu")

# XLA:CPU options of the sampler's jits (both backends, params on ONE CPU device). Its YNNPACK fusions made the
# decode's small-batch matmuls (weights streamed from memory at every step) slower: at batch 16 on a 2-core AVX2
# machine 81-93 ms per decode step without them against 112-117 with them; no clear change at batch 64
# (docs/benchmarks.md). Only where they were measured: on a mesh of several CPU devices jaxlib 0.10.2 with
# this option decoded wrong tokens from about the 16th step of a 30-layer model (sampler logprobs 25.8 nats
# from the trainer's; tests/test_sharding.py compares an 8-device rollout with the 1-device one).
XLA_CPU_OPTIONS = (("xla_cpu_experimental_ynn_fusion_type", ""),)

# The TPU compiler's options of the sampler's jits (the XLA backend, params on TPU chips). Its memory-space
# assignment staged most layers' KV cache buffers through on-chip memory (VMEM) at every decode step: each
# buffer prefetched, its new slot scattered in VMEM, the whole buffer written back to HBM (llama3.1-8b on v6e-8:
# 191 of the 4 phases' 256 per-layer buffers, 309 MiB each way per step summed over the phases). No eviction
# leaves the cache, the one buffer the loop body modifies, in HBM and updated in place: the scatter writes one
# slot per row; read-only operands are still prefetched (docs/scaling.md, "The decode on a TPU slice").
XLA_TPU_OPTIONS = (("xla_msa_max_outstanding_evictions", "0"),)

# XLA's GPU compiler options of the sampler's jits (the XLA backend, params on GPUs): none yet. The candidates
# (command buffers that capture the decode's while loop, the latency-hiding scheduler, ...) are measured side by
# side by benchmarks/device_check.py, which sets this tuple per variant; the fastest becomes the default here,
# with its figures in docs/benchmarks.md.
XLA_GPU_OPTIONS: tuple[tuple[str, str], ...] = ()


@dataclasses.dataclass(frozen=True)
class XlaBackend:
    """The model's own ``forward``: a padded prefill, and a decode step of one token per row.

    Every backend has these fields and methods (hashable: a static argument of the compiled prefill and decode).

    Attributes:
      name: "xla" or "cpu".
      compiler_options: XLA compiler options of the sampler's jits, as (key, value) pairs.
      prepares_once: see the field's comment.
    """

    name: str = "xla"
    compiler_options: tuple[tuple[str, str], ...] = ()
    # The decode's attention over the pages (grpax.models.attention.PAGED_IMPLEMENTATIONS): "ragged_tpu" where
    # the params are on TPU chips and the kernel takes the model's heads (``ragged_tpu_takes``: Pallas's ragged
    # paged attention, which reads only each sequence's filled pages), else "xla" (the pages a step reads
    # gathered).
    paged_attention: str = "xla"
    # A mixture of experts' routing recorded (``SamplerConfig.record_routes``): ``prefill`` and ``decode_step``
    # return the experts each fed token was routed to as a third element.
    record_routes: bool = False
    # Whether a decode made of several programs (the retiring decode's phases) runs ``prepare_decode`` once,
    # in a program of its own, and passes its output on (costly preparations: the CPU kernels' packing), or
    # inside each phase's program, where the compiler reads the weights in place instead of materialising a
    # prepared copy of them (this backend's layout change and rounding).
    prepares_once: bool = False
    # Stacked layers scanned in the decode step, over one pool of every layer's pages (``init_pages``;
    # ``grpax.models.llama.decode_paged``): one compiled layer instead of L. Chosen by ``select_backend`` where
    # the params are stacked on TPU chips and the attention is XLA's (docs/benchmarks.md: the TPU compiler's
    # time is per fusion, and the unrolled layers were most of the decode's); elsewhere the layers are unrolled
    # over per-layer pools (a scan copied each layer's weights and cache at every step on CPU).
    scan_layers: bool = False

    @property
    def reads_filled_pages(self) -> bool:
        """Whether a decode step reads only each sequence's filled pages whatever the page table's width (else
        the engine cuts the table to the pages its longest sequence needs, rounded up to a bucket)."""
        return self.paged_attention == "ragged_tpu"

    def init_pages(self, cfg: ModelConfig, num_pages: int, page_size: int, dtype) -> list:
        """Empty page pools: per layer ``[num_pages, page_size, 2K, H]`` (``grpax.models.attention``'s layout);
        with ``scan_layers`` one pool of them all, ``[L * num_pages, page_size, 2K, H]`` (layer i's pages at
        rows i * num_pages ...)."""
        shape = (num_pages, page_size, 2 * cfg.num_kv_heads, cfg.head_dim)
        if self.scan_layers:
            return [jnp.zeros((cfg.num_layers * num_pages, *shape[1:]), dtype)]
        return [jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)]

    def page_spec(self, cfg: ModelConfig, mesh_shape: dict) -> jax.sharding.PartitionSpec:
        """The pools' placement on a mesh: kv heads (axis 2, k/v pairs together) over "tensor" where they divide,
        as the decode's heads are; the rest replicated."""
        tensor = mesh_shape.get("tensor", 1)
        axis = "tensor" if tensor > 1 and cfg.num_kv_heads % tensor == 0 else None
        return jax.sharding.PartitionSpec(None, None, axis, None)

    def write_prompts(self, pages: list, cache: dict, dest: jax.Array) -> list:
        """Writes prefilled prompts into the pages (traced inside the sampler's jit).

        Args:
          pages: the pools (``init_pages``).
          cache: the prefill's cache of N prompts: keys L x [N, K, H, P], values L x [N, K, P, H] (with
            ``scan_layers`` stacked: [L, N, K, H, P] and [L, N, K, P, H]).
          dest: int32 [N, G, P]: the page of token t of prompt n's completion g (offset t % page_size);
            indices past the pool are not written.
        """
        N, G, P = dest.shape
        page_size = jax.tree.leaves(pages)[0].shape[1]
        offsets = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32) % page_size, (N, G, P)).reshape(-1)
        if self.scan_layers:
            return [_write_stacked(pages[0], cache, dest, offsets)]
        return [
            write_pages(kv, *_prompt_entries(ck, cv, G), dest.reshape(-1), offsets)
            for kv, ck, cv in zip(pages, cache["k"], cache["v"], strict=True)
        ]

    def plan(self, prompt_tokens: jax.Array, prompt_lengths: jax.Array) -> Any:
        """Static prefill choices made on the host from the concrete prompts (hashable; None: nothing to choose).

        Args:
          prompt_tokens: int32 [B, P] right-padded prompts; prompt_lengths: int32 [B] their lengths in tokens
            (arrays of any sharding: this backend does not read them).
        """
        return None

    def prefill(
        self,
        params: Params,
        prompt_tokens: jax.Array,
        prompt_lengths: jax.Array,
        cache: dict,
        cfg: ModelConfig,
        plan: Any,
    ) -> tuple[jax.Array, dict]:
        """Prefills right-padded prompts into the cache (traced inside the sampler's jit).

        Args:
          params: the model's params as the sampler got them.
          prompt_tokens: int32 [B, P] right-padded prompts; prompt_lengths: int32 [B], each in 1..P.
          cache: per-layer KV buffers of P slots (``init_cache(..., stacked=False)``); token t of row b goes to
            slot t.
          cfg: model config.
          plan: what ``plan`` returned for these prompts.

        Returns:
          (final-normed hidden state of each prompt's last token [B, D] in ``cfg.dtype``, the filled cache), and
          with ``record_routes`` the expert ids of every prompt token, int [B, P, L, k] (``moe.Routing``).
        """
        B, P = prompt_tokens.shape
        positions = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
        routed = dict(return_routes=True) if self.record_routes else {}
        if isinstance(params["layers"], dict):
            # Stacked layers are scanned: one compiled layer instead of L unrolled ones (70B's 80 unrolled
            # layers took the TPU compiler most of an hour). A prefill reads each weight once whichever way;
            # the scan's stacked cache is cut into the per-layer buffers the decode updates in place.
            stacked = {name: jnp.stack(buffers) for name, buffers in cache.items()}
            hidden, stacked, *routing = forward(
                params, prompt_tokens, cfg, positions=positions, cache=stacked, return_hidden=True, **routed
            )
            cache = stacked if self.scan_layers else {name: list(b) for name, b in stacked.items()}
        else:
            hidden, cache, *routing = forward(
                params, prompt_tokens, cfg, positions=positions, cache=cache, return_hidden=True, **routed
            )
        last = hidden[jnp.arange(B), prompt_lengths - 1]
        return (last, cache, routing[0].experts) if self.record_routes else (last, cache)

    def prepare_decode(self, params: Params, cfg: ModelConfig, num_slots: int) -> Any:
        """The weights (and anything else) the decode steps read, once per decode call, outside its loop.

        Weights wider than the compute dtype (float32 master weights, bfloat16 compute) are rounded to it here,
        once, as the forward rounds them at every use: the same values, and each decode step reads half the
        bytes (a no-op for the rollout's copy, which ``reshard_for_rollout`` already rounds). The layout is
        left as it is: ``decode_step`` slices each layer out of stacked weights itself, inside the step, where
        the TPU compiler reads it in place; cut into per-layer buffers here, outside the loop, they were a
        second copy of every weight (docs/scaling.md). Only views change: some stacked weights' head axes
        are merged (``merge_heads``).

        LoRA's adapters (``lora.LoraWeight``: the LoRA sampler's ``lora_sampler=adapters``) are rounded with
        their weight, as the forward rounds them; a QLoRA weight's codes and scales are left as they are (its
        matmul dequantises them into the compute dtype).

        Args:
          num_slots: the most cache slots the loop reaches (P + C).
        """
        dtype = jnp.dtype(cfg.dtype)

        def narrow(x):
            if isinstance(x, QuantizedWeight):
                return x
            return x.astype(dtype) if x.dtype.itemsize > dtype.itemsize else x

        narrowed = jax.tree.map(narrow, params, is_leaf=lambda x: isinstance(x, QuantizedWeight))
        return merge_heads(narrowed)

    def decode_step(
        self,
        prepared: Any,
        tokens: jax.Array,
        positions: jax.Array,
        pages: Any,
        page_table: jax.Array,
        cfg: ModelConfig,
    ) -> tuple[jax.Array, Any]:
        """One token per slot: writes its key/value at its position's page and returns the next logits.

        Args:
          prepared: what ``prepare_decode`` returned.
          tokens: int32 [S] each slot's last token; positions: int32 [S] its position, -1 for an idle slot
            (nothing of a sequence written, its logits meaningless).
          pages: the pools (``init_pages``); page_table: int32 [S, n] each slot's pages.

        Returns:
          (float32 logits [S, V], the updated pools), and with ``record_routes`` the experts each slot's token
          was routed to, int [S, L, k].
        """
        # Layers unrolled with per-layer pools (scanning stacked layers copied each layer's weights and cache
        # at every step, ~2x slower on CPU), each layer's weights sliced here, inside the step; or scanned
        # (``scan_layers``: stacked weights, one pool).
        params = prepared if self.scan_layers else convert_layout(prepared, cfg, scan_layers=False)
        hidden, pages, *routes = decode_paged(
            params, tokens, positions, pages, page_table, cfg, self.paged_attention, self.record_routes
        )
        return (logits_from_hidden(params, hidden, cfg), pages, *routes)


def _write_stacked(pool: jax.Array, cache: dict, dest: jax.Array, offsets: jax.Array) -> jax.Array:
    """``write_prompts`` into one pool of every layer's pages (``scan_layers``), a layer at a time in a loop
    (one layer's entries in flight, as the per-layer pools' writes): layer i's page p at row i * (its pages) +
    p; ``dest`` past a layer's pages is not written."""
    L, G = cache["k"].shape[0], dest.shape[1]
    num_pages = pool.shape[0] // L
    flat = dest.reshape(-1)

    def one(i, pool):
        pages = jnp.where(flat < num_pages, flat + i * num_pages, L * num_pages)  # past the pool: dropped
        return write_pages(pool, *_prompt_entries(cache["k"][i], cache["v"][i], G), pages, offsets)

    return jax.lax.fori_loop(0, L, one, pool)


def _prompt_entries(ck: jax.Array, cv: jax.Array, G: int) -> tuple[jax.Array, jax.Array]:
    """One layer's prefilled keys [N, K, H, P] and values [N, K, P, H] as ``write_pages``' [N * G * P, K, H]
    entries, each prompt's repeated for its G completions."""
    N, K, H, P = ck.shape
    k = jnp.broadcast_to(ck.transpose(0, 3, 1, 2)[:, None], (N, G, P, K, H)).reshape(-1, K, H)
    v = jnp.broadcast_to(cv.transpose(0, 2, 1, 3)[:, None], (N, G, P, K, H)).reshape(-1, K, H)
    return k, v


def merge_heads(params: Params) -> Params:
    """``params`` with some stacked weights' head axes merged, as the decode step multiplies by them: ``wo``
    [L, N, H, D] as [L, N * H, D] (a LoRA ``wo``'s A [L, N, H, r] too), and a LoRA ``wq``, ``wk``, ``wv``
    [L, D, N, H] as [L, D, N * H] (their B [L, r, N, H] too). Other trees (listed layers, quantised weights,
    QLoRA's) as they are.

    ``grpax.models.llama.output_and_mlp`` multiplies by the [N * H, D] view of a layer's ``wo``, ``_project`` by
    the [D, N * H] view of its projections. Sliced out of the stacked weight first and reshaped after, inside
    the decode loop, the TPU compiler wrote the L slices out at every step instead of reading them in place as
    its dots read the other weights' slices (llama3.1-8b on v6e-8, docs/benchmarks.md). Merged here, outside
    the loop, each layer's slice is the dot's operand as it is. A plain ``wq`` is left apart: the compiler
    reads its [N, H, D] slices in place (in a convolution over N, after one relayout per call), and merged it
    sliced them at every step. The reshapes move nothing (N and H adjacent, H never sharded, a multiple of a
    TPU tile's rows in the supported models) and the products are the same: the tokens do not change.
    """
    layers = params["layers"]
    if not isinstance(layers, dict):
        return params
    out = dict(layers)
    wo = layers["wo"]
    if _adapted_array(wo):
        L, D = wo.w.shape[0], wo.w.shape[-1]
        out["wo"] = LoraWeight(wo.w.reshape(L, -1, D), wo.a.reshape(L, -1, wo.a.shape[-1]), wo.b, wo.scale)
    elif isinstance(wo, jax.Array):
        out["wo"] = wo.reshape(wo.shape[0], -1, wo.shape[-1])
    for name in ("wq", "wk", "wv"):
        w = layers[name]
        if _adapted_array(w):
            L, D = w.w.shape[:2]
            out[name] = LoraWeight(w.w.reshape(L, D, -1), w.a, w.b.reshape(L, w.b.shape[1], -1), w.scale)
    return {**params, "layers": out}


def _adapted_array(w) -> bool:
    """Whether ``w`` is a LoRA weight over a plain array (not over QLoRA's quantised base)."""
    return isinstance(w, LoraWeight) and isinstance(w.w, jax.Array)


def _param_devices(params: Params) -> set | None:
    """The devices holding the params (numpy leaves: the default device); None while they are traced or placed on
    a ``jax.sharding.AbstractMesh`` (the planner's NVIDIA estimate: no devices)."""
    leaves = jax.tree.leaves(params)

    def abstract(x) -> bool:
        return isinstance(getattr(getattr(x, "sharding", None), "mesh", None), jax.sharding.AbstractMesh)

    if any(isinstance(x, jax.core.Tracer) or abstract(x) for x in leaves):
        return None
    return set().union(
        *(x.sharding.device_set if hasattr(x, "sharding") else {jax.devices()[0]} for x in leaves)
    )


def _plain(params: Params) -> bool:
    """Whether every weight is an array (not LoRA's ``LoraWeight`` nor QLoRA's ``QuantizedWeight``)."""
    wrapped = lambda x: isinstance(x, LoraWeight | QuantizedWeight)  # noqa: E731
    return not any(wrapped(x) for x in jax.tree.leaves(params, is_leaf=wrapped))


def _compiler_options(devices: set | None) -> tuple[tuple[str, str], ...]:
    """The sampler's XLA options for params on ``devices`` (None: traced; one CPU device only for the CPU's)."""
    platforms = {d.platform for d in devices} if devices else set()
    if platforms == {"cpu"}:
        return XLA_CPU_OPTIONS if len(devices) == 1 else ()
    if platforms == {"tpu"}:
        return XLA_TPU_OPTIONS
    return XLA_GPU_OPTIONS if platforms == {"gpu"} else ()


def select_backend(
    name: str, params: Params, cfg: ModelConfig, cache_dtype: str | None = None, concrete: bool = True
) -> Any:
    """The backend that runs one ``generate`` call: the one place that chooses (and imports) a backend.

    "cpu" runs a Llama-family model (``cfg.family == "llama"``: its kernels implement that block only) where
    every param is a concrete array (no LoRA adapters beside a weight, no quantised weight) on one CPU device, the prompts are concrete (``concrete``) and
    ``grpax.backends.cpu.unavailable_reason`` finds nothing against it (dtypes, group size, the kernels
    build); "auto" picks it there and "xla" anywhere else.

    Args:
      name: "auto", "xla" or "cpu" (``SamplerConfig.backend``).
      params: the params the call samples with.
      cfg: model config.
      cache_dtype: the KV cache dtype (None: ``cfg.dtype``).
      concrete: whether the prompts are concrete arrays (not traced).

    Raises:
      ValueError: "cpu" where it cannot run (the reason in the message), e.g. on a Qwen or Gemma model.
    """
    devices = _param_devices(params)
    on_cpu = devices is not None and all(d.platform == "cpu" for d in devices)
    options = _compiler_options(devices)
    # Pallas's ragged paged attention on TPU chips where it takes the model's heads (else the gathered pages)
    on_tpu = bool(devices) and {d.platform for d in devices} == {"tpu"}
    takes = ragged_tpu_takes(cfg.num_kv_heads, cfg.head_dim, cache_dtype or cfg.dtype)
    paged = "ragged_tpu" if on_tpu and takes and not cfg.attention_sinks else "xla"  # the kernel has no sinks
    # the decode's layers scanned where the params are stacked on TPU chips (XlaBackend.scan_layers)
    stacked = isinstance(params.get("layers"), dict) if isinstance(params, dict) else False
    scan = on_tpu and paged == "xla" and stacked and not any(cfg.local_layers)
    xla = XlaBackend(compiler_options=options, paged_attention=paged, scan_layers=scan)
    if name == "xla":
        return xla
    if cfg.family != "llama":  # the kernels implement the plain Llama block only
        if name == "cpu":
            raise ValueError(
                f"backend='cpu' runs Llama-family models only; this is a {cfg.family} model: "
                "use backend='auto' or 'xla'"
            )
        return xla
    if not (on_cpu and len(devices) == 1 and concrete):
        if name == "cpu":
            raise ValueError(
                "backend='cpu' runs on one CPU device with concrete params and prompts; these are sharded, on an "
                "accelerator or traced: use backend='auto' or 'xla'"
            )
        return xla
    if not _plain(params):
        if name == "cpu":
            raise ValueError(
                "backend='cpu' runs plain weights only; these hold LoRA adapters beside their weights "
                "(lora_sampler=adapters) or quantised weights: use backend='auto' or 'xla', or lora_sampler=merged"
            )
        return xla
    from grpax.backends import cpu  # only here, and only for params on one CPU device

    reason = cpu.unavailable_reason(params, cfg, cache_dtype)
    if reason is None:
        return cpu.CpuBackend(compiler_options=options)
    if name == "cpu":
        raise ValueError(f"backend='cpu' cannot run here: {reason}; use backend='auto' or 'xla'")
    return xla


_SHAPE_PLANNED: dict[type, type] = {}


def shape_planned(backend):
    """``backend`` with prefill plans that depend on the prompts' shape only: the plan of N full prompts that
    share no prefix (every valid plan for that shape covers them), so no batch compiles a plan of its own (a
    server's bounded program set: ``Engine``'s ``shape_plans``).

    A backend whose plan is None for every batch (XLA's) is returned as it is.
    """
    cls = type(backend)
    if cls.plan(backend, np.zeros((2, 2), np.int32), np.ones((2,), np.int32)) is None:
        return backend
    if cls not in _SHAPE_PLANNED:

        def plan(self, prompt_tokens, prompt_lengths):
            B, P = np.shape(prompt_tokens)
            rows = np.zeros((B, P), np.int32)
            rows[:, 0] = np.arange(B)  # rows that differ at their first token: no shared prefix
            return cls.plan(self, rows, np.full((B,), P, np.int32))

        _SHAPE_PLANNED[cls] = type(
            f"ShapePlanned{cls.__name__}", (cls,), {"plan": plan, "__doc__": cls.__doc__}
        )
    fields = {f.name: getattr(backend, f.name) for f in dataclasses.fields(backend) if f.init}
    return _SHAPE_PLANNED[cls](**fields)
