"""Native grpax checkpoints: the params tree saved with Orbax (zarr3 + OCDBT), restored to host or to shardings.

A converted checkpoint follows MaxText's layout so ``load_parameters_path=<base>/0/items`` works the same::

    <base>/config.json          Hugging Face form (``grpax.models.registry.to_hf_config``)
    <base>/tokenizer.json ...   tokenizer files and chat template
    <base>/0/items/             Orbax PyTree checkpoint of the params tree (``grpax.models.params``)

A trained actor checkpoint lives at ``<base>/<run>/checkpoints/actor/<step>/model_params`` with ``config.json``
and the tokenizer files at ``<base>/<run>/checkpoints/``. ``load_model`` finds them by walking up from the
params folder.

Writes are atomic: Orbax writes into ``<dir>.orbax-checkpoint-tmp-*`` and renames it to ``<dir>`` only after
every array and ``_CHECKPOINT_METADATA`` are written, so an interrupted save leaves no folder at ``<dir>``.
Params may be stored stacked (``scan_layers=True``) or as a per-layer list; restore converts to the layout asked.

Streaming writes: a leaf may be a ``LazyArray`` (shape, dtype and a function that builds the array). Such leaves
are built one at a time inside Orbax's own save and written while the next are built, each freed once written,
with at most ``STREAM_BYTES`` of them (or one larger leaf) alive, so a conversion holds a bounded part of the tree
instead of the whole tree (plus Orbax's copy of it). The files
are the ones a plain ``PyTreeSave`` of numpy arrays writes (same ``_METADATA``, typestr ``np.ndarray``), so the
ordinary Orbax restore reads them.
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import json
import logging
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from grpax.checkpoint import digests
from grpax.checkpoint.train_state import (
    DamagedStepError,
    lora_meta,
    quiet_orbax_thread_errors,
    read_train_meta,
    tensorstore_status,
)
from grpax.config import ConfigError
from grpax.models.attention import select_attention
from grpax.models.params import Params, abstract_params, convert_layout
from grpax.models.registry import ModelConfig, find_hf_config, from_hf_config

log = logging.getLogger(__name__)

# Files written by ``tokenizer.save_pretrained`` (any of them may be absent).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
)
_METADATA_FILE = "_CHECKPOINT_METADATA"
_TREE_METADATA_FILE = "_METADATA"  # the PyTree structure; written before the final rename
_TMP_SUFFIX = ".orbax-checkpoint-tmp"


class OutputExistsError(FileExistsError, ValueError):
    """The output path already exists; nothing is overwritten (a ValueError too, so the CLI prints one line)."""


class BrokenCheckpointError(ValueError):
    """A checkpoint folder whose files are missing, truncated or of another kind; the message names the fix."""


# Bytes of built leaves a streaming save holds at once (a larger leaf is written alone): tensorstore compresses
# each leaf (one zstd chunk) on one core, so leaves written side by side use as many cores as fit in it.
STREAM_BYTES = 1 << 30
_RECONVERT = "re-convert the model (grpax to_native) or pass another step's .../actor/<step>/model_params"


@dataclasses.dataclass(frozen=True)
class LazyArray:
    """A params leaf built only when ``save_params`` writes it (see the module docstring).

    Attributes:
      shape: the array's shape.
      dtype: its numpy dtype.
      build: returns the array (a numpy array of ``shape`` and ``dtype``); called once, from Orbax's writer
        thread; its exceptions abort the save.
    """

    shape: tuple[int, ...]
    dtype: np.dtype
    build: Callable[[], np.ndarray]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


def _release_free_memory() -> None:
    """Returns freed heap pages to the OS (glibc keeps tensorstore's per-thread arenas otherwise)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


async def _write_streaming(values: list, names: list[str], write: Callable[[int, np.ndarray], Any]) -> None:
    """Builds each of ``values`` in turn (a ``LazyArray`` in a thread, so that the writes already started go on)
    and starts the coroutine ``write(i, array)``, waiting for writes to finish while the next would hold more than
    ``STREAM_BYTES`` of built arrays; all writes are finished (or cancelled) when it returns or raises.

    Raises:
      ValueError: a ``LazyArray`` built another shape or dtype than it declared (names the leaf).
    """
    pending: set[asyncio.Future] = set()
    in_flight: dict[asyncio.Future, int] = {}
    try:
        for i, (value, name) in enumerate(zip(values, names, strict=True)):
            while pending and sum(in_flight.values()) + value.nbytes > STREAM_BYTES:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    task.result()  # raises a failed write's error
                    del in_flight[task]
                _release_free_memory()
            start = time.perf_counter()
            array = await asyncio.to_thread(value.build) if isinstance(value, LazyArray) else value
            if array.shape != tuple(value.shape) or array.dtype != np.dtype(value.dtype):
                raise ValueError(
                    f"{name}: built {array.dtype}{list(array.shape)}, declared "
                    f"{np.dtype(value.dtype)}{list(value.shape)}"
                )
            log.debug("%s: built in %.2f s", name, time.perf_counter() - start)
            task = asyncio.ensure_future(write(i, array))
            pending.add(task)
            in_flight[task] = array.nbytes
            del array
        await asyncio.gather(*pending)
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        _release_free_memory()


def _streaming_handler_registry():
    """Orbax's default type handlers plus one that builds ``LazyArray`` leaves one at a time and writes them
    within ``STREAM_BYTES``."""
    from orbax.checkpoint._src.futures import future
    from orbax.checkpoint._src.serialization import type_handler_registry as registry
    from orbax.checkpoint._src.serialization import type_handlers, types

    class StreamingNumpyHandler(type_handlers.NumpyHandler):
        """``NumpyHandler`` (typestr ``np.ndarray``, so restore reads the leaves as usual) that writes leaf by leaf.

        The stock handler deep-copies every array up front and writes them all concurrently, so the whole tree
        is held twice plus tensorstore's encode buffers. Here each array is built, written and dropped once
        written, at most ``STREAM_BYTES`` of them alive (``_write_streaming``); ``save_params`` blocks until
        the writes finish, so no copy is needed. The copy lives in the stock ``serialize``, which this one
        replaces, so no constructor flag is needed either (newer Orbax's ``deepcopy_host_arrays`` does not exist
        in orbax-checkpoint 0.12.4).
        """

        async def serialize(self, values, infos, args=None):
            args = args or [types.SaveArgs()] * len(values)
            types.check_input_arguments(values, infos, args)

            async def write(i: int, array: np.ndarray) -> None:
                start = time.perf_counter()
                await self._background_serialize([array], [infos[i]], [args[i]])
                seconds = time.perf_counter() - start
                log.debug("%s: %.0f MB written in %.2f s", infos[i].name, array.nbytes / 1e6, seconds)

            names = [info.name for info in infos]
            streaming = _write_streaming(values, names, write)
            return [future.CommitFutureAwaitingContractedSignals(streaming, name="grpax_streaming")]

    handler = StreamingNumpyHandler()
    return registry.create_type_handler_registry(
        *registry._DEFAULT_TYPE_HANDLERS, (LazyArray, handler), (np.ndarray, handler)
    )


def _checkpointer(
    use_zarr3: bool = True, use_ocdbt: bool = True, use_compression: bool = True, streaming: bool = False
):
    import orbax.checkpoint as ocp

    kwargs = {"type_handler_registry": _streaming_handler_registry()} if streaming else {}
    return ocp.Checkpointer(
        ocp.PyTreeCheckpointHandler(
            use_ocdbt=use_ocdbt, use_zarr3=use_zarr3, use_compression=use_compression, **kwargs
        )
    )


def save_params(
    params: Params,
    directory: str | Path,
    use_zarr3: bool = True,
    use_ocdbt: bool = True,
    *,
    use_compression: bool = True,
) -> Path:
    """Saves a params tree (numpy or jax leaves, any layout) as an Orbax PyTree checkpoint.

    Args:
      params: the params tree; numpy leaves are written as they are (bfloat16 via ``ml_dtypes``). ``LazyArray``
        leaves are built one at a time and written side by side (with the numpy leaves) within ``STREAM_BYTES``,
        so peak memory is about that much (or one larger leaf) plus encode buffers; they restore as numpy arrays.
      directory: the checkpoint folder to create, e.g. ``<base>/0/items``; must not exist.
      use_zarr3: zarr v3 array format (MaxText ``checkpoint_storage_use_zarr3``).
      use_ocdbt: one OCDBT key-value store instead of a file per chunk (``checkpoint_storage_use_ocdbt``).
      use_compression: zstd-compress the chunks (Orbax's default); random-like bfloat16 weights shrink by about
        a quarter at roughly half the write speed.

    Returns:
      The absolute checkpoint path.

    Raises:
      FileExistsError: if ``directory`` already exists (choose another path or delete it).
    """
    directory = Path(directory).absolute()
    if directory.exists():
        raise OutputExistsError(f"{directory} already exists; delete it or choose another output directory")
    directory.parent.mkdir(parents=True, exist_ok=True)
    import orbax.checkpoint as ocp

    leaves = jax.tree.leaves(params)
    streaming = any(isinstance(x, LazyArray) for x in leaves) and all(
        isinstance(x, LazyArray | np.ndarray) for x in leaves
    )
    checkpointer = _checkpointer(use_zarr3, use_ocdbt, use_compression, streaming=streaming)

    quiet_orbax_thread_errors()  # a failed write is reported once, by the caller
    try:
        checkpointer.save(directory, args=ocp.args.PyTreeSave(params))
    except BaseException:
        checkpointer.close()  # wait for Orbax's background writers before cleaning up
        # Orbax leaves its unfinished ``<name>.orbax-checkpoint-tmp*`` folder behind; it never restores (see
        # ``_stored_tree``), but remove it so a retry starts clean.
        for tmp in directory.parent.glob(f"{directory.name}{_TMP_SUFFIX}*"):
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory


def _stored_tree(directory: Path) -> Any:
    """The checkpoint's metadata tree (leaves carry ``shape`` and ``dtype``)."""
    # A standalone checkpoint has _CHECKPOINT_METADATA itself; an item of a CheckpointManager step (the
    # trainer's actor/<step>/model_params) has it in the step folder, which Orbax renames into place last.
    committed = (directory / _METADATA_FILE).exists() or (directory.parent / _METADATA_FILE).exists()
    finished = committed and (directory / _TREE_METADATA_FILE).exists()
    if not finished or _TMP_SUFFIX in directory.name or _TMP_SUFFIX in directory.parent.name:
        hint = ""
        if (directory / "0" / "items" / _METADATA_FILE).exists():
            hint = f" (did you mean {directory / '0' / 'items'}?)"
        elif (directory / "model_params" / _TREE_METADATA_FILE).exists():  # an actor step folder
            hint = f" (did you mean {directory / 'model_params'}?)"
        elif directory.exists():
            hint = " (an interrupted or unfinished write, or not an Orbax checkpoint)"
        raise FileNotFoundError(
            f"{directory} is not a grpax/Orbax params checkpoint{hint}: pass the folder "
            "holding _CHECKPOINT_METADATA, e.g. <base>/0/items"
        )
    meta = _checkpointer().metadata(directory)
    tree = getattr(getattr(meta, "item_metadata", meta), "tree", None)
    if tree is None:
        raise BrokenCheckpointError(f"{directory} is damaged: {_damage(directory)}; {_RECONVERT}")
    lora_adapters = isinstance(tree, dict) and set(tree) == {
        "layers"
    }  # a LoRA run's step (checkpoint/peft.py)
    if not (isinstance(tree, dict) and {"embed", "layers"} <= set(tree)) and not lora_adapters:
        hint = directory.parent / "model_params"
        fix = (
            f"pass {hint}"
            if (hint / _TREE_METADATA_FILE).exists()
            else "pass <base>/0/items or .../model_params"
        )
        raise BrokenCheckpointError(
            f"{directory} is an Orbax checkpoint but not of model params (no embed/layers; "
            f"an optimizer state or train_meta?): {fix}"
        )
    return tree


def _damage(directory: Path) -> str:
    """Which of the checkpoint's metadata files is missing or unreadable (Orbax's metadata() returned None)."""
    try:
        stored = json.loads((directory / _TREE_METADATA_FILE).read_text())
    except (OSError, ValueError):
        return f"{_TREE_METADATA_FILE} is truncated or not valid JSON"
    if stored.get("use_ocdbt", True) and not (directory / "manifest.ocdbt").exists():
        return "manifest.ocdbt is missing"
    return f"{_TREE_METADATA_FILE} or manifest.ocdbt cannot be read"


def stored_dtype(directory: str | Path) -> str:
    """The dtype of the checkpoint's embedding (the dtype the weights were saved in)."""
    tree = _stored_tree(Path(directory).absolute())
    return str(np.dtype(tree["embed"].dtype))


def restore_params(directory: str | Path, cfg: ModelConfig | None = None, sharding: Any = None) -> Params:
    """Restores a params tree saved by ``save_params`` (or by the trainer).

    Args:
      directory: the checkpoint folder (``<base>/0/items`` or ``.../actor/<step>/model_params``).
      cfg: when given, layers are converted to ``cfg.scan_layers`` layout (stacked [L, ...] or a list) and
        leaves are cast to ``cfg.weight_dtype``; when None the stored layout and dtype are kept.
      sharding: None restores numpy arrays on the host; a ``jax.sharding.Sharding`` is applied to every leaf;
        a pytree of shardings must match the params tree in ``cfg``'s layout.

    Returns:
      The params tree (numpy leaves on host, ``jax.Array`` leaves with ``sharding``).

    Raises:
      FileNotFoundError: the folder is missing or holds no finished checkpoint.
      BrokenCheckpointError: a metadata or data file is missing or truncated, or the folder holds another tree
        (e.g. ``.../actor/<step>/opt_state``); the message names the folder and the fix.
    """
    import orbax.checkpoint as ocp

    directory = Path(directory).absolute()
    tree = _stored_tree(directory)
    dtype = np.dtype(cfg.weight_dtype) if cfg is not None else None
    stacked = isinstance(tree["layers"], dict)
    direct = sharding is not None and (cfg is None or stacked == cfg.scan_layers)
    if direct:
        shardings = (
            jax.tree.map(lambda _: sharding, tree)
            if isinstance(sharding, jax.sharding.Sharding)
            else sharding
        )
        restore_args = jax.tree.map(
            lambda _, s: ocp.ArrayRestoreArgs(sharding=s, dtype=dtype), tree, shardings
        )
    else:
        restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray, dtype=dtype), tree)

    quiet_orbax_thread_errors()  # a failed read is reported once, below
    try:
        params = _checkpointer().restore(directory, args=ocp.args.PyTreeRestore(restore_args=restore_args))
    except (
        Exception
    ) as e:  # tensorstore: "OUT_OF_RANGE: Error reading ... in "layers.wo/c/0..." ...", maybe wrapped
        found = tensorstore_status(e)
        if found is None:
            raise
        status, message = found
        leaf = re.search(r'in "([^"/]+)/', message)
        raise BrokenCheckpointError(
            f"{directory} is damaged: reading {leaf.group(1) if leaf else 'an array'} failed with "
            f"{status} (a truncated or corrupt data file); {_other_checkpoint(directory)}"
        ) from e
    _check_digests(directory, params)
    if cfg is not None and not direct:
        params = convert_layout(params, cfg, cfg.scan_layers)
        if not cfg.scan_layers:
            params["layers"] = [{k: np.asarray(v) for k, v in layer.items()} for layer in params["layers"]]
        else:
            params["layers"] = {k: np.asarray(v) for k, v in params["layers"].items()}
    if sharding is not None and not direct:
        params = jax.device_put(params, sharding)
    return params


def _check_digests(directory: Path, params: Params) -> None:
    """Checks a training step's params (``.../actor/<step>/model_params``) against the digests its
    ``train_meta`` holds (``grpax.checkpoint.digests``); a converted checkpoint has none.

    Raises:
      BrokenCheckpointError: an array differs from its digest (names it, the folder and the steps kept).
    """

    step_dir = directory.parent
    if directory.name != "model_params" or not (step_dir / "train_meta").is_dir():
        return
    try:
        expected = (read_train_meta(step_dir).get("digests") or {}).get("model_params") or {}
    except DamagedStepError as e:
        log.warning("%s; the weights of %s are not checked against their digests", e, directory)
        return
    bad = digests.mismatches(params, expected)
    if bad:
        raise BrokenCheckpointError(
            f"{directory} is damaged: array {bad[0]}{f' (and {len(bad) - 1} more)' if len(bad) > 1 else ''} "
            f"differs from the digest written with it (a corrupt or overwritten data file): {_other_checkpoint(directory)}"
        )


def _other_checkpoint(directory: Path) -> str:
    """The fix for a damaged params folder: another step of its run (the steps kept named), or a re-conversion."""
    step_dir = directory.parent
    if directory.name != "model_params" or step_dir.parent.name != "actor":
        return _RECONVERT
    kept = sorted((p.name for p in step_dir.parent.iterdir() if p.name.isdigit() and p != step_dir), key=int)
    return f"pass another step's {step_dir.parent}/<step>/model_params (kept: {', '.join(kept) or 'none'})"


def check_shapes(directory: Path, cfg: ModelConfig, config_path: Path) -> None:
    """Checks the stored arrays' shapes against those ``cfg`` (read from ``config_path``) implies, before any
    weight is read: a config.json of another size would otherwise fail deep inside sampling.

    Raises:
      BrokenCheckpointError: a weight of the config is missing from the checkpoint or has another shape
        (names the weight, both shapes and the config's sizes).
    """

    tree = _stored_tree(directory)
    expected = abstract_params(cfg.replace(scan_layers=isinstance(tree["layers"], dict)))
    stored = {
        jax.tree_util.keystr(k, simple=True, separator="."): tuple(getattr(v, "shape", ()))
        for k, v in jax.tree_util.tree_leaves_with_path(tree)
    }
    for key, leaf in jax.tree_util.tree_leaves_with_path(expected):
        name = jax.tree_util.keystr(key, simple=True, separator=".")
        have = stored.get(name)
        if have != tuple(leaf.shape):
            what = "is missing" if have is None else f"has shape {list(have)}"
            raise BrokenCheckpointError(
                f"{directory} does not match {config_path}: weight {name} {what} in the checkpoint, "
                f"{list(leaf.shape)} from the config (num_layers={cfg.num_layers}, hidden_dim={cfg.hidden_dim}, "
                f"vocab_size={cfg.vocab_size}): restore the config.json written with this checkpoint"
            )


def steps_kept(path: Path) -> str:
    """`` (<run>/checkpoints/actor holds steps 2, 4)`` for a missing ``.../actor/<step>/model_params``, else ''."""
    actor = path.parent.parent if path.name == "model_params" else path.parent
    if actor.name != "actor" or not actor.is_dir():
        return ""
    steps = sorted(int(p.name) for p in actor.iterdir() if p.name.isdigit())
    return (
        f" ({actor} holds steps {', '.join(map(str, steps))})"
        if steps
        else f" ({actor} holds no finished step)"
    )


def find_model_folder(path: str | Path) -> Path:
    """The nearest folder at or above ``path`` that holds ``config.json``.

    Raises:
      FileNotFoundError: if no folder from ``path`` up to the filesystem root has ``config.json``.
    """
    path = Path(path).absolute()
    config = find_hf_config(path)
    if config is not None:
        return config.parent
    raise FileNotFoundError(
        f"no config.json at or above {path}: a converted checkpoint keeps it at <base>/ next "
        "to 0/items, a trained one at <base>/<run>/checkpoints/; re-run grpax to_native or "
        "copy the model's config.json there"
    )


def load_model(
    path: str | Path, model_cfg: ModelConfig | None = None, **model_overrides: Any
) -> tuple[Params, ModelConfig, Any]:
    """Loads params, model config and tokenizer from a native checkpoint.

    ``path`` is either a converted checkpoint ``<base>/0/items`` or a trained actor checkpoint
    ``<base>/<run>/checkpoints/actor/<step>/model_params``. ``config.json`` (Hugging Face form) and the tokenizer
    files are searched from ``path`` upwards: the first folder holding ``config.json`` must also hold the
    tokenizer (``to_native`` writes both at ``<base>/``; the trainer at ``<base>/<run>/checkpoints/``).

    Args:
      path: the Orbax params folder.
      model_cfg: the model when the caller has read its ``config.json`` already
        (``grpax.models.registry.checkpoint_config``, with its overrides); None: read here.
      **model_overrides: ``ModelConfig`` fields to override (``scan_layers``, ``dtype``, ``weight_dtype``...);
        ``weight_dtype`` defaults to the dtype stored in the checkpoint.

    Returns:
      ``(params, cfg, tokenizer)``: numpy params in ``cfg``'s layout, the ``ModelConfig``, and a
      ``transformers.PreTrainedTokenizerFast``.

    Raises:
      FileNotFoundError: the checkpoint, ``config.json`` or the tokenizer files are missing (names the path).
      ConfigError: ``config.json`` is not a Llama config, or names an attention this platform cannot run.
    """
    from grpax.data.tokenizer import load_tokenizer

    path = Path(path).absolute()
    if not path.exists():
        raise FileNotFoundError(
            f"checkpoint {path} does not exist{steps_kept(path)}: pass <base>/0/items of a converted model "
            "(grpax to_native) or <run>/checkpoints/actor/<step>/model_params"
        )
    lora = lora_meta(path)
    if lora is not None:
        raise ConfigError(
            f"{path} holds the LoRA adapters of a run on the base {lora['base_path']}, not a whole model: export "
            "it merged (grpax to_huggingface load_parameters_path=... base_output_directory=HF, then grpax "
            "to_native hf_model_path=HF) to sample or train from it"
        )
    folder = find_model_folder(path)
    if model_cfg is None:
        try:
            hf = json.loads((folder / "config.json").read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{folder / 'config.json'} is not valid JSON ({e})") from None
        overrides = dict(model_overrides)
        overrides.setdefault("weight_dtype", stored_dtype(path))
        model_cfg = from_hf_config(hf, str(folder / "config.json"), **overrides)
    else:
        assert not model_overrides, "model_cfg carries its overrides"
    check_shapes(path, model_cfg, folder / "config.json")
    # An attention this platform cannot run is refused before any weight is read (the forward resolves it
    # again when traced; the sampler's CPU backend, which runs its own kernels, never does).
    select_attention(model_cfg)
    if not any((folder / name).exists() for name in ("tokenizer.json", "tokenizer.model")):
        raise FileNotFoundError(
            f"no tokenizer.json in {folder} (the folder holding config.json for {path}); "
            "copy the model's tokenizer files there or re-run grpax to_native"
        )
    tokenizer = load_tokenizer(folder)
    params = restore_params(path, model_cfg)
    return params, model_cfg, tokenizer
