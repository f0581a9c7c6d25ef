"""Checkpoint conversion: Hugging Face safetensors / Hub / GGUF -> grpax Orbax, and grpax Orbax -> Hugging Face.

The library side of ``grpax to_native`` and ``grpax to_huggingface`` (MaxText's ``to_maxtext`` /
``to_huggingface`` keys). Both write into a hidden staging folder and publish it with a rename at the end, so an
interrupted conversion never leaves something that looks like a finished checkpoint:

* ``to_native`` writes ``<base>/config.json``, the tokenizer files and ``<base>/0/items`` (Orbax); ``0`` is
  moved into place last.
* ``to_huggingface`` writes ``config.json``, ``generation_config.json``, tokenizer files and ``*.safetensors``
  (sharded with ``model.safetensors.index.json`` above ``max_shard_size``); ``config.json`` is moved last.

With ``lazy_load_tensors=True`` the conversion streams: every output leaf is a ``grpax.checkpoint.orbax.LazyArray``
whose source tensors are read (``grpax.checkpoint.safetensors_io``: pread, no mmap, no torch) only when Orbax
writes that leaf, so about one stacked [L, ...] leaf is in memory at a time. ``lazy_load_tensors=False`` reads
every file, builds the whole tree, then writes it. bfloat16 uses ``ml_dtypes`` so no torch is needed either way.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np

from grpax.checkpoint import peft, rounding
from grpax.checkpoint.hf import (
    MissingTensorError,
    iter_hf_tensors,
    load_params_from_tensors,
)
from grpax.checkpoint.orbax import (
    TOKENIZER_FILES,
    BrokenCheckpointError,
    LazyArray,
    OutputExistsError,
    find_model_folder,
    restore_params,
    save_params,
    steps_kept,
)
from grpax.checkpoint.peft import CONVERTED_FROM
from grpax.checkpoint.safetensors_io import SafetensorsFile
from grpax.checkpoint.train_state import lora_meta
from grpax.config import ConfigError, env_flag
from grpax.models.registry import (
    MODELS,
    ModelConfig,
    check_matches,
    from_hf_config,
    get_model_config,
    to_hf_config,
)

log = logging.getLogger(__name__)

DTYPES = {
    "float32": np.dtype(np.float32),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float16": np.dtype(np.float16),
}
DEFAULT_MAX_SHARD_SIZE = 2 * 1024**3  # bytes, as transformers' save_pretrained
_HUB_PATTERNS = [
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    *TOKENIZER_FILES,
]


def _dtype(name: str) -> np.dtype:
    if name not in DTYPES:
        raise ConfigError(f"weight_dtype={name!r}: expected one of {', '.join(DTYPES)}")
    return DTYPES[name]


# ----------------------------------------------------------------------------------------------- sources


class SafetensorsSource:
    """HF-named tensors from a folder of ``*.safetensors`` (one file, or sharded with an index).

    Args:
      folder: holds ``model.safetensors`` or ``model.safetensors.index.json`` + shards (or any ``*.safetensors``).
      lazy: keep files open and read one tensor per ``get_tensor``; otherwise read every file at once.

    Raises:
      FileNotFoundError: no safetensors in ``folder`` or a shard named by the index is missing.
      ValueError: a file is not valid safetensors (names it).
    """

    def __init__(self, folder: Path, lazy: bool = True):
        index = folder / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise ValueError(f"{index} is not a valid safetensors index ({e})") from None
            files = sorted({folder / f for f in weight_map.values()})
        else:
            files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(
                f"no *.safetensors in {folder}: hf_model_path must hold config.json and the "
                "model's safetensors files (PyTorch .bin files are not read)"
            )
        for f in files:
            if not f.exists():
                raise FileNotFoundError(f"{f} is listed in {index} but missing; re-download the model")
        self.total_bytes = sum(f.stat().st_size for f in files)
        # pread-based reader (grpax.checkpoint.safetensors_io): no mmap, so read tensors leave the RSS once copied.
        self._where: dict[str, SafetensorsFile] = {}
        self._arrays: dict[str, np.ndarray] = {}
        for f in files:
            handle = SafetensorsFile(f)
            if lazy:
                self._where.update(dict.fromkeys(handle.keys(), handle))
            else:
                self._arrays.update({name: handle.get_tensor(name) for name in handle.keys()})

    def has_tensor(self, name: str) -> bool:
        return name in self._where or name in self._arrays

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        """The stored shape of ``name`` (from the header when lazy; nothing is read)."""
        if name in self._arrays:
            return tuple(self._arrays[name].shape)
        return tuple(self._where[name].entries[name]["shape"])

    def get_tensor(self, name: str) -> np.ndarray:
        if name in self._arrays:
            return self._arrays.pop(name)  # each tensor is read once: free it as soon as it is copied
        return self._where[name].get_tensor(name)


def _hub_download(model_name: str, hf_access_token: str | None) -> Path:
    """Downloads config, safetensors and tokenizer files of ``MODELS[model_name].hf_repo``; fails at once offline."""
    import huggingface_hub
    from huggingface_hub import HfApi, snapshot_download

    if model_name not in MODELS:
        raise ConfigError(
            f"model_name={model_name!r} has no known Hub repository; pass hf_model_path=<folder with "
            "config.json and *.safetensors> or gguf_path=<file.gguf>"
        )
    repo = MODELS[model_name].hf_repo
    how = (
        f"download it elsewhere (huggingface-cli download {repo}) and pass hf_model_path=<that folder>, "
        "or pass gguf_path=<file.gguf>"
    )
    offline = env_flag("HF_HUB_OFFLINE") or bool(getattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False))
    if offline:
        try:  # a snapshot already in the local Hub cache is fine offline
            return Path(snapshot_download(repo_id=repo, allow_patterns=_HUB_PATTERNS, local_files_only=True))
        except Exception:
            raise ConfigError(
                f"HF_HUB_OFFLINE is set and {repo} is not in the local Hub cache; {how}"
            ) from None
    try:  # a short probe so a machine without network fails in seconds, not after long retries
        HfApi().model_info(repo, token=hf_access_token, timeout=5)
    except Exception as e:
        gated = type(e).__name__ in ("GatedRepoError", "RepositoryNotFoundError", "HfHubHTTPError")
        fix = "pass hf_access_token=<token with access to it>, or " if gated else ""
        raise ConfigError(
            f"cannot reach the Hugging Face Hub for {repo} ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:200]}); {fix}{how}"
        ) from None
    log.info("downloading %s from the Hub", repo)
    return Path(snapshot_download(repo_id=repo, token=hf_access_token, allow_patterns=_HUB_PATTERNS))


# ------------------------------------------------------------------------------------------- publishing


def _staging_dir(target: Path) -> Path:
    """A fresh hidden sibling of ``target`` on the same filesystem (so the final rename is atomic).

    Raises:
      OSError: ``target``'s folder cannot be created or written (a path under a file, a read-only or full
        disk): one line naming ``base_output_directory`` and the reason.
    """
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex[:8]}"
        staging.mkdir()
    except OSError as e:
        if isinstance(e, (FileExistsError, NotADirectoryError)) and e.filename:
            reason, where = (
                f"{e.filename} is a file, not a folder",
                "",
            )  # mkdir's 'File exists' of /dev/null/x
        else:
            reason = e.strerror or type(e).__name__
            where = f" ({e.filename})" if e.filename and str(e.filename) != str(target.parent) else ""
        raise OSError(
            f"cannot write base_output_directory={str(target)!r}: {reason}{where}; pass a folder you can "
            "write to (with free space), or fix its permissions"
        ) from None
    return staging


def _publish(staging: Path, target: Path, last: str) -> None:
    """Moves ``staging``'s content to ``target``; entry ``last`` (what makes it look valid) is moved last.

    Raises:
      FileExistsError: ``target`` already holds an entry of the same name (nothing is overwritten).
    """
    if not target.exists() or (target.is_dir() and not any(target.iterdir())):
        if target.exists():
            target.rmdir()
        os.replace(staging, target)  # one atomic rename
        return
    clashes = [p.name for p in staging.iterdir() if (target / p.name).exists()]
    if clashes:
        raise OutputExistsError(
            f"{target} already holds {', '.join(sorted(clashes))}; delete them or choose another "
            "base_output_directory"
        )
    for entry in sorted(staging.iterdir(), key=lambda p: p.name == last):
        os.replace(entry, target / entry.name)
    staging.rmdir()


def _check_target(target: Path, names: list[str]) -> None:
    clashes = [n for n in names if (target / n).exists()]
    if clashes:
        raise OutputExistsError(
            f"{target} already holds {', '.join(clashes)}; delete them or choose another "
            "base_output_directory"
        )


def _progress(total: int, desc: str, enabled: bool) -> tuple[Callable[[int], None], Callable[[], None]]:
    """A tqdm bar over bytes: returns ``(update, close)``."""
    if not enabled:
        return (lambda n: None), (lambda: None)
    from tqdm import tqdm

    # disable=None: no bar when stderr is not a terminal (logs, CI, captured output)
    bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, disable=None)
    return bar.update, bar.close


def _extra_keys(source: dict, ours: dict) -> dict:
    """The source config.json's keys to keep under ``ours`` (``to_hf_config``'s): all but the rope and dtype
    forms ours replaces and a quantisation the weights no longer have (GPT-OSS's MXFP4 experts are dequantised),
    or only ``transformers_version`` when the source is another class (the text model of a
    Gemma3ForConditionalGeneration is exported as a Gemma3ForCausalLM, without the vision keys)."""
    if source.get("architectures", ours["architectures"]) != ours["architectures"]:
        return {k: v for k, v in source.items() if k == "transformers_version"}
    dropped = ("rope_parameters", "dtype", "torch_dtype", "quantization_config", CONVERTED_FROM)
    return {k: v for k, v in source.items() if k not in dropped}


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def _copy_tokenizer(src: Path, dst: Path) -> list[str]:
    copied = []
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
            copied.append(name)
    return copied


# ------------------------------------------------------------------------------------------- streaming


def lazy_params(
    source: Any, cfg: ModelConfig, dtype: np.dtype, on_tensor: Callable[[int], None] | None = None
) -> dict:
    """A params tree of ``LazyArray`` leaves that read their source tensors only when built.

    ``grpax.checkpoint.hf.load_params_from_tensors`` with leaves built later: every tensor name (and, where the
    source knows it without reading, its size) is checked here, before anything is written.

    Args:
      source: has ``get_tensor(name) -> np.ndarray`` and ``has_tensor(name) -> bool`` (HF names), optionally
        ``tensor_shape(name)``.
      cfg: model config (``scan_layers`` picks stacked leaves or a per-layer list).
      dtype: output dtype of every leaf.
      on_tensor: called with each source tensor's byte count as it is read (progress bars).

    Returns:
      The params tree (``grpax.models.params`` layout) with ``LazyArray`` leaves.

    Raises:
      MissingTensorError: a tensor is absent (names it; an untied model without ``lm_head.weight`` included).
      ValueError: a tensor has the wrong number of elements for this config (names it, with both shapes); a
        wrong layout of the right size is raised when the leaf is built, which aborts the save.
    """
    return load_params_from_tensors(
        source.get_tensor,
        source.has_tensor,
        cfg,
        dtype,
        on_tensor,
        tensor_shape=getattr(source, "tensor_shape", None),
        lazy=LazyArray,
    )


# -------------------------------------------------------------------------------------------- to_native


def to_native(
    model_name: str,
    base_output_directory: str | Path,
    hf_model_path: str | Path | None = None,
    hf_access_token: str | None = None,
    gguf_path: str | Path | None = None,
    scan_layers: bool = True,
    lazy_load_tensors: bool = True,
    weight_dtype: str = "float32",
    use_zarr3: bool = True,
    use_ocdbt: bool = True,
    use_multimodal: bool = False,
    progress: bool = True,
    use_compression: bool = True,
) -> dict[str, Any]:
    """Converts a Hugging Face checkpoint (local folder, Hub, or GGUF file) to a grpax Orbax checkpoint.

    Args:
      model_name: a registered name (``grpax.models.registry.MODELS``): the source config must match its
        shapes, and without a local source it names the Hub repository. Empty (or unregistered) with
        ``hf_model_path`` or ``gguf_path``: the source's own config is converted as it is.
      base_output_directory: output root; receives ``config.json``, tokenizer files and ``0/items``.
      hf_model_path: local folder with ``config.json`` and ``*.safetensors`` (single or sharded).
      hf_access_token: Hub token for gated repositories (used only without a local source).
      gguf_path: a GGUF file instead (``grpax.checkpoint.gguf``); wins over the Hub, not over hf_model_path.
      scan_layers: store layers stacked [L, ...] (True) or as a per-layer list.
      lazy_load_tensors: stream: read each output leaf's tensors only when it is written, one leaf at a time
        (peak memory about one stacked leaf); False reads whole files and builds the tree first (more memory).
      weight_dtype: float32 | bfloat16 | float16, the stored parameter dtype.
      use_zarr3, use_ocdbt: Orbax storage format options.
      use_multimodal: must be False (only text Llama models are supported).
      progress: show a tqdm bar over bytes read.
      use_compression: zstd-compress the Orbax chunks (Orbax's default); see ``save_params``.

    Returns:
      A summary dict: ``params_path``, ``config_path``, ``tokenizer_files``, ``source``, ``num_params``,
      ``bytes_read``, ``weight_dtype``, ``scan_layers``.

    Raises:
      ConfigError: no source (neither hf_model_path, gguf_path nor model_name), multimodal, a config that does
        not match ``model_name``, a bad dtype, an unreachable Hub.
      FileNotFoundError: a missing source file or folder; FileExistsError: the output already holds a checkpoint.
      MissingTensorError: a tensor is absent (names it). ValueError: corrupt file or wrong tensor shape.
    """
    if use_multimodal:
        raise ConfigError(
            "use_multimodal=true is not supported: grpax converts text-only Llama models; "
            "set use_multimodal=false"
        )
    if not (hf_model_path or gguf_path or model_name):
        raise ConfigError(
            "no source to convert: pass hf_model_path=<folder with config.json and *.safetensors>, "
            "gguf_path=<file.gguf>, or model_name=<registered name> to download it from the Hub"
        )
    dtype = _dtype(weight_dtype)
    target = Path(base_output_directory).absolute()
    _check_target(target, ["0", "config.json"])
    src = _open_source(model_name, hf_model_path, hf_access_token, gguf_path, scan_layers, weight_dtype)
    if src.folder is not None:
        src.tensors = SafetensorsSource(src.folder, lazy=lazy_load_tensors)
        src.total_bytes = src.tensors.total_bytes
    update, close = _progress(src.total_bytes, "to_native", progress)
    bytes_read = [0]

    def on_tensor(n: int) -> None:
        bytes_read[0] += n
        update(n)

    params = _read_params(src, dtype, lazy_load_tensors, on_tensor, close)
    src.tensors = None
    num_params = sum(int(np.prod(x.shape)) for x in _leaves(params))
    orbax_options = dict(use_zarr3=use_zarr3, use_ocdbt=use_ocdbt, use_compression=use_compression)
    tokenizer_files = _write_native(params, src, target, weight_dtype, close, orbax_options)
    return {
        "params_path": str(target / "0" / "items"),
        "config_path": str(target / "config.json"),
        "tokenizer_files": [str(target / n) for n in tokenizer_files],
        "source": src.kind,
        "num_params": num_params,
        "bytes_read": bytes_read[0],
        "weight_dtype": weight_dtype,
        "scan_layers": scan_layers,
    }


def _read_params(src: _Source, dtype, lazy: bool, on_tensor, close):
    """The source's params in ``dtype``: lazy leaves read while Orbax writes them, one at a time (``lazy``), or the
    whole tree read now (then ``close`` ends the progress bar)."""
    if lazy:
        return lazy_params(src.tensors, src.cfg, dtype, on_tensor=on_tensor)
    try:
        return load_params_from_tensors(
            src.tensors.get_tensor, src.tensors.has_tensor, src.cfg, dtype=dtype, on_tensor=on_tensor
        )
    finally:
        close()


@dataclasses.dataclass
class _Source:
    """What ``to_native`` converts: the tensors, their model, and where they came from."""

    cfg: ModelConfig
    hf_config: dict  # the source's config.json (a GGUF file's, as transformers reads it)
    folder: Path | None  # a safetensors folder (local or the Hub's download); None for GGUF
    kind: str  # e.g. "GGUF file /x.gguf", for the summary
    converted_from: dict  # recorded in config.json (the Hugging Face base a PEFT export names)
    tensors: Any = None  # get_tensor / has_tensor (SafetensorsSource or the GGUF reader)
    total_bytes: int = 0
    tokenizer: Any = None  # a GGUF file's tokenizer (a folder's tokenizer files are copied)


def _open_source(model_name, hf_model_path, hf_access_token, gguf_path, scan_layers, weight_dtype) -> _Source:
    """The source ``to_native`` reads: a local folder, else a GGUF file, else the Hub's download of ``model_name``;
    its config read (checked against ``model_name``) and, for GGUF, its tensors opened.

    Raises:
      FileNotFoundError: hf_model_path is not a folder, or gguf_path does not exist.
      ConfigError: a config that does not match ``model_name``; an unreachable Hub.
    """
    if gguf_path and not hf_model_path:
        return _open_gguf(Path(gguf_path).absolute(), model_name, scan_layers, weight_dtype)
    if hf_model_path:
        folder = Path(hf_model_path).absolute()
        if not folder.is_dir():
            raise FileNotFoundError(
                f"hf_model_path={folder} is not a folder; pass the folder holding config.json and *.safetensors"
            )
        kind, converted_from = f"safetensors folder {folder}", {"hf_model_path": str(folder)}
    else:
        folder = _hub_download(model_name, hf_access_token)
        kind = f"Hub {MODELS[model_name].hf_repo} ({folder})"
        converted_from = {"hub": MODELS[model_name].hf_repo}
    from grpax.models.registry import load_hf_config, read_hf_config

    hf_config = read_hf_config(folder)
    cfg = load_hf_config(folder, hf_config, scan_layers=scan_layers, weight_dtype=weight_dtype)
    check_matches(cfg, model_name, str(folder / "config.json"))
    return _Source(cfg, hf_config, folder, kind, converted_from)


def _open_gguf(gguf_file: Path, model_name, scan_layers: bool, weight_dtype: str) -> _Source:
    """A GGUF file's config, tensors (dequantised to float32 as read) and tokenizer.

    Raises:
      FileNotFoundError: the file does not exist. ConfigError: its config does not match ``model_name``.
    """
    from grpax.checkpoint.gguf import read_gguf

    if not gguf_file.is_file():
        raise FileNotFoundError(f"gguf_path={gguf_file} does not exist")
    reader = read_gguf(gguf_file)
    cfg = from_hf_config(
        reader.hf_config, f"GGUF {gguf_file}", scan_layers=scan_layers, weight_dtype=weight_dtype
    )
    check_matches(cfg, model_name, f"GGUF {gguf_file}")
    if model_name in MODELS:  # GGUF metadata lacks some ids (pad); the registry knows them
        ref = get_model_config(model_name)
        cfg = cfg.replace(
            bos_token_id=ref.bos_token_id, eos_token_ids=ref.eos_token_ids, pad_token_id=ref.pad_token_id
        )
    return _Source(
        cfg,
        reader.hf_config,
        None,
        f"GGUF file {gguf_file}",
        {"gguf": str(gguf_file)},
        tensors=reader,
        total_bytes=sum(4 * n for n in _tensor_sizes(cfg)),  # dequantised float32
        tokenizer=reader.tokenizer(),
    )


def _write_native(
    params, src: _Source, target: Path, weight_dtype: str, close, orbax_options: dict
) -> list[str]:
    """Writes config.json, the tokenizer and ``0/items`` (``save_params`` with ``orbax_options``) into ``target``
    through a staging folder, ``0`` last; returns the tokenizer's file names. ``close`` ends the progress bar.
    Nothing is left in ``target`` when it fails."""
    staging = _staging_dir(target)
    try:
        out_cfg = to_hf_config(src.cfg, torch_dtype=weight_dtype)
        if src.folder is not None:  # keep the source's extra keys (e.g. transformers_version) under ours
            out_cfg = {**_extra_keys(src.hf_config, out_cfg), **out_cfg}
        # The Hugging Face base a PEFT export of a run on this checkpoint names (checkpoint/peft.py).
        out_cfg[CONVERTED_FROM] = src.converted_from
        _write_json(staging / "config.json", out_cfg)
        if src.tokenizer is not None:
            from grpax.data.tokenizer import save_tokenizer

            save_tokenizer(src.tokenizer, staging)
            tokenizer_files = sorted(p.name for p in staging.iterdir() if p.name in TOKENIZER_FILES)
        else:
            tokenizer_files = _copy_tokenizer(src.folder, staging)
        if not tokenizer_files:
            log.warning("no tokenizer files in %s; load_model will need them next to config.json", src.folder)
        save_params(params, staging / "0" / "items", **orbax_options)
        close()
        del params
        _publish(staging, target, last="0")
    except BaseException:
        close()
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return tokenizer_files


def _leaves(params: dict) -> Iterator[np.ndarray]:
    for k, v in params.items():
        if k == "layers":
            for layer in v if isinstance(v, list) else [v]:
                yield from layer.values()
        else:
            yield v


def _tensor_sizes(cfg: ModelConfig) -> list[int]:
    from grpax.models.params import abstract_params

    return [int(np.prod(x.shape)) for x in _leaves(abstract_params(cfg))]


# ---------------------------------------------------------------------------------------- to_huggingface


def end_of_turn_ids(cfg: ModelConfig, tokenizer: Any | None) -> list[int]:
    """Every id that ends generation: the config's eos ids, the tokenizer's eos, and chat end-of-turn tokens."""
    if tokenizer is None:
        return list(cfg.eos_token_ids)
    from grpax.data.tokenizer import stop_token_ids

    return [i for i in stop_token_ids(tokenizer, cfg) if i < cfg.vocab_size]


def generation_config(cfg: ModelConfig, tokenizer: Any | None) -> dict[str, Any]:
    """``generation_config.json``: bos, pad, and eos as a list of every end-of-turn id (a single id when one)."""
    eos = end_of_turn_ids(cfg, tokenizer)
    out: dict[str, Any] = {"_from_model_config": False}
    if cfg.bos_token_id is not None:
        out["bos_token_id"] = cfg.bos_token_id
    if eos:
        out["eos_token_id"] = eos if len(eos) > 1 else eos[0]
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else getattr(tokenizer, "pad_token_id", None)
    if pad is not None:
        out["pad_token_id"] = int(pad)
    return out


def _write_safetensors(
    tensors: Iterator[tuple[str, np.ndarray]],
    folder: Path,
    max_shard_size: int,
    total: int,
    update: Callable[[int], None],
) -> list[str]:
    """Writes shards of at most ``max_shard_size`` bytes (a larger single tensor gets its own shard)."""
    from safetensors.numpy import save_file

    shards: list[dict[str, np.ndarray]] = [{}]
    sizes = [0]
    paths: list[str] = []
    weight_map: dict[str, int] = {}

    def flush(final: bool) -> None:
        idx = len(paths)
        name = f"model-{idx + 1:05d}.safetensors.part"
        (folder / name).touch()  # the mode of an ordinary new file here (0666 less the umask)
        mode = (folder / name).stat().st_mode & 0o777
        save_file(shards[-1], str(folder / name), metadata={"format": "pt"})
        (folder / name).chmod(mode)  # safetensors writes 0600
        paths.append(name)
        if not final:
            shards.append({})
            sizes.append(0)

    for hf_name, w in tensors:
        if sizes[-1] and sizes[-1] + w.nbytes > max_shard_size:
            flush(final=False)
            shards[-2] = {}  # free the written shard
        shards[-1][hf_name] = np.ascontiguousarray(w)
        sizes[-1] += w.nbytes
        weight_map[hf_name] = len(paths)
        update(w.nbytes)
    flush(final=True)
    n = len(paths)
    names = (
        ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    )
    for part, final in zip(paths, names, strict=True):
        os.replace(folder / part, folder / final)
    if n > 1:
        _write_json(
            folder / "model.safetensors.index.json",
            {
                "metadata": {"total_size": total},
                "weight_map": {k: names[i] for k, i in sorted(weight_map.items())},
            },
        )
    return names


def _check_finite(params: Any, path: Path) -> None:
    """Raises BrokenCheckpointError when a weight is NaN or inf (a diverged step must never be exported)."""
    count, first = 0, None
    for key, leaf in jax.tree_util.tree_leaves_with_path(params):
        if np.issubdtype(np.asarray(leaf).dtype, np.integer):
            continue
        n = int(np.size(leaf) - np.count_nonzero(np.isfinite(np.asarray(leaf, np.float32))))
        if n and first is None:
            first = jax.tree_util.keystr(key, simple=True, separator=".")
        count += n
    if count:
        raise BrokenCheckpointError(
            f"{path} holds {count:,} NaN/inf weights (the first in {first}): it is not a model to export; "
            "pass an earlier step's .../actor/<step>/model_params, or re-train with a lower learning_rate"
        )


def _count(params) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))


def to_huggingface(
    load_parameters_path: str | Path,
    base_output_directory: str | Path,
    model_name: str | None = None,
    weight_dtype: str = "bfloat16",
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    progress: bool = True,
    lora_export: str = "merged",
    base_parameters_path: str | Path = "",
    base_model_name_or_path: str = "",
) -> dict[str, Any]:
    """Exports a grpax Orbax checkpoint as a Hugging Face ``LlamaForCausalLM`` folder.

    A LoRA run's step (adapters only, ``grpax.checkpoint.peft``) is exported merged into its base
    (``lora_export="merged"``), or as a PEFT adapter folder (``lora_export="peft"``: ``adapter_config.json``,
    ``adapter_model.safetensors``, the tokenizer).

    A training step's export is compared with the weights its run started from (``grpax.checkpoint.rounding``):
    the summary's ``rounding`` says how much of the update survives ``weight_dtype`` (``lost``: most of it did
    not), or ``rounding_note`` why nothing was compared.

    The model config and tokenizer are taken from the nearest folder at or above ``load_parameters_path``
    holding ``config.json`` (see ``grpax.checkpoint.orbax.load_model``); without one, the registered
    ``model_name`` config is used. Tied models get no ``lm_head.weight``.

    Args:
      load_parameters_path: the Orbax params folder (``<base>/0/items`` or ``.../actor/<step>/model_params``).
      base_output_directory: output folder (created; existing files are never overwritten).
      model_name: when given, the checkpoint's config must match its shapes.
      weight_dtype: float32 | bfloat16 | float16 dtype of the written safetensors (``torch_dtype`` too).
      max_shard_size: bytes per safetensors shard; more than one shard writes ``model.safetensors.index.json``.
      progress: show a tqdm bar over bytes written.
      lora_export: merged | peft, for a LoRA step (peft of a whole model is refused).
      base_parameters_path: the base the step was trained from: a LoRA step's (default: the path its
        ``train_meta`` records; pass where it is now if it moved) and what a full fine-tune's export is compared
        with (default: the run's ``load_parameters_path`` in ``<run>/config.json``); "none": no comparison.
      base_model_name_or_path: a PEFT export's Hugging Face base (default: ``peft.hf_base``).

    Returns:
      A summary dict: ``output_dir``, ``safetensors`` (file names), ``config_path``, ``tokenizer_files``,
      ``num_params``, ``bytes_written``, ``weight_dtype``, and ``rounding`` (a ``RoundingReport``) or
      ``rounding_note``; a PEFT export: ``output_dir``, ``peft_files``, ``num_params``, ``lora``, ``hf_base``
      and ``hf_base_note`` (``peft.hf_base``).

    Raises:
      FileNotFoundError: no checkpoint, or neither config.json nor a registered ``model_name``.
      ConfigError: the checkpoint's config does not match ``model_name``; a bad dtype; max_shard_size < 1;
        ``lora_export=peft`` of a whole model.
      MissingTensorError / ValueError: the params lack a weight (e.g. ``lm_head`` of an untied model) or have
        the wrong shape.
    """
    dtype = _dtype(weight_dtype)
    if max_shard_size < 1:
        raise ConfigError(
            f"max_shard_size={max_shard_size} must be a positive number of bytes (default {DEFAULT_MAX_SHARD_SIZE})"
        )
    if lora_export not in ("merged", "peft"):
        raise ConfigError(f"lora_export={lora_export!r}: expected merged (the full model) or peft (adapters)")
    params_path = Path(load_parameters_path).absolute()
    target = Path(base_output_directory).absolute()
    _check_target(target, ["config.json", "model.safetensors", "model.safetensors.index.json"])
    folder, hf_config, cfg = _export_model(params_path, model_name)
    lora = lora_meta(params_path)
    if lora is None and lora_export == "peft":
        raise ConfigError(
            f"lora_export=peft writes a LoRA run's adapters, but {params_path} holds a whole model (no LoRA "
            "record in its train_meta): drop lora_export to export the model, or pass a step of a run trained "
            "with lora_rank > 0"
        )
    params = restore_params(params_path)
    _check_finite(params, params_path)
    chosen_base = Path(base_parameters_path).absolute() if base_parameters_path not in ("", "none") else None
    if lora is not None and lora_export == "peft":
        return _export_peft(params, cfg, lora, target, folder, chosen_base, base_model_name_or_path)
    if lora is not None:
        params, base = peft.load_lora_step(params_path, params, lora, chosen_base)
        base_name, note = f"the LoRA base {chosen_base or lora['base_path']}", ""
        if str(base_parameters_path) == "none":
            base = None
    params, cfg = _checked_export_params(params, cfg, params_path, folder or model_name)
    if lora is None:
        base, base_name, note = _run_base(params_path, str(base_parameters_path), cfg)
    report, note = _rounding(params, base, dtype, base_name, note)
    del base
    total = sum(int(np.prod(x.shape)) for x in _leaves(params)) * dtype.itemsize
    files, tokenizer_files = _write_hf_folder(
        params, cfg, hf_config, folder, target, weight_dtype, max_shard_size, total, progress
    )
    return {
        "output_dir": str(target),
        "safetensors": files,
        "config_path": str(target / "config.json"),
        "tokenizer_files": tokenizer_files,
        "num_params": sum(int(np.prod(x.shape)) for x in _leaves(params)),
        "bytes_written": total,
        "weight_dtype": weight_dtype,
        "rounding": report,
        "rounding_note": note,
    }


def _rounding(params, base, dtype, base_name: str, note: str) -> tuple[rounding.RoundingReport | None, str]:
    """``(report, note)``: how much of the update from ``base`` survives ``dtype`` (``rounding.measure``), or
    None and ``note`` (why nothing was compared: no base, or another model's weights)."""
    if base is None:
        return None, note
    try:
        return rounding.measure(
            params, {k: v for k, v in base.items() if k in params}, dtype, base_name
        ), note
    except ValueError as e:  # another model's weights
        return None, f"not compared with {base_name}: {e}"


def _export_model(params_path: Path, model_name: str | None) -> tuple[Path | None, dict, ModelConfig]:
    """``(folder, hf_config, cfg)``: the nearest folder at or above ``params_path`` with ``config.json``, that
    config and its ``ModelConfig`` (checked against ``model_name``); without one, ``(None, {}, model_name's
    registered config)``.

    Raises:
      FileNotFoundError: no checkpoint at ``params_path``, or neither config.json nor a registered ``model_name``.
    """
    if not params_path.exists():
        raise FileNotFoundError(
            f"load_parameters_path={params_path} does not exist{steps_kept(params_path)}; pass <base>/0/items of a "
            "converted model or .../checkpoints/actor/<step>/model_params"
        )
    try:
        folder = find_model_folder(params_path)
    except FileNotFoundError:
        if not model_name or model_name not in MODELS:
            raise
        log.warning("no config.json above %s; using the registered %s config", params_path, model_name)
        return None, {}, get_model_config(model_name)
    hf_config = json.loads((folder / "config.json").read_text())
    cfg = from_hf_config(hf_config, source=str(folder / "config.json"))
    if model_name:
        check_matches(cfg, model_name, str(folder / "config.json"))
    return folder, hf_config, cfg


def _export_peft(
    params,
    cfg: ModelConfig,
    lora: dict,
    target: Path,
    folder: Path | None,
    chosen_base: Path | None,
    hf_name: str,
) -> dict[str, Any]:
    """A LoRA step written as a PEFT adapter folder (``peft.save_peft``) with the tokenizer: ``to_huggingface``'s
    summary of a PEFT export."""
    hf_base, how = peft.hf_base(chosen_base or Path(lora["base_path"]))
    hf_base = hf_name or hf_base
    files = peft.save_peft(params, cfg, lora, target, hf_base)
    if folder is not None:
        files += _copy_tokenizer(folder, target)
    return {
        "output_dir": str(target),
        "peft_files": files,
        "num_params": _count(params),
        "lora": lora,
        "hf_base": hf_base,
        "hf_base_note": "given by base_model_name_or_path" if hf_name else how,
    }


def _checked_export_params(params, cfg: ModelConfig, params_path: Path, source) -> tuple[Any, ModelConfig]:
    """``params`` checked against ``cfg`` (``source`` names where ``cfg`` came from), a tied model's extra
    ``lm_head`` dropped, and ``cfg`` in the params' layer layout.

    Raises:
      MissingTensorError: embed, final_norm or an untied lm_head is missing.
      ValueError: a wrong shape or number of layers.
    """
    from grpax.models.params import abstract_params

    stacked = isinstance(params["layers"], dict)
    cfg = cfg.replace(scan_layers=stacked)
    expected = abstract_params(cfg)
    for name in ("embed", "final_norm", "lm_head"):
        if name in expected and name not in params:
            hint = " (the config says tie_word_embeddings=false)" if name == "lm_head" else ""
            raise MissingTensorError(f"weight {name!r} is missing from {params_path}{hint}")
        if name in expected and tuple(params[name].shape) != expected[name].shape:
            raise ValueError(
                f"weight {name!r} in {params_path} has shape {tuple(params[name].shape)}, expected "
                f"{expected[name].shape} from {source}"
            )
    layers = params["layers"]
    num_layers = len(layers) if not stacked else next(iter(layers.values())).shape[0]
    if num_layers != cfg.num_layers:
        raise ValueError(f"{params_path} has {num_layers} layers, config says {cfg.num_layers}")
    if "lm_head" in params and cfg.tie_word_embeddings:
        log.warning("checkpoint has lm_head but the config ties embeddings; lm_head is not exported")
        params = {k: v for k, v in params.items() if k != "lm_head"}
    return params, cfg


def _write_hf_folder(
    params,
    cfg,
    hf_config,
    folder,
    target: Path,
    weight_dtype: str,
    max_shard_size: int,
    total: int,
    progress: bool,
) -> tuple[list[str], list[str]]:
    """Writes the safetensors, tokenizer, generation_config.json and config.json (last) into ``target`` through a
    staging folder; returns ``(safetensors files, tokenizer files)``.

    Raises:
      ConfigError: the safetensors writer failed (a full disk); nothing is left in ``target``.
    """
    dtype = _dtype(weight_dtype)
    tokenizer = None
    tokenizer_files: list[str] = []
    if folder is not None and (folder / "tokenizer.json").exists():
        from grpax.data.tokenizer import special_tokens  # its ids only: no transformers import (seconds)

        tokenizer = special_tokens(folder)
    staging = _staging_dir(target)
    update, close = _progress(total, "to_huggingface", progress)
    try:
        tensors = ((n, w.astype(dtype, copy=False)) for n, w in iter_hf_tensors(params, cfg))
        files = _write_safetensors(tensors, staging, max_shard_size, total, update)
        close()
        if folder is not None:
            tokenizer_files = _copy_tokenizer(folder, staging)
        else:
            log.warning("no tokenizer to export: the output has weights and config only")
        _write_json(staging / "generation_config.json", generation_config(cfg, tokenizer))
        out_cfg = to_hf_config(cfg, torch_dtype=weight_dtype)
        _write_json(staging / "config.json", {**_extra_keys(hf_config, out_cfg), **out_cfg})
        _publish(staging, target, last="config.json")
    except BaseException as e:
        close()
        shutil.rmtree(staging, ignore_errors=True)
        if type(e).__name__ == "SafetensorError":  # the Rust writer's I/O error (a full disk): one line
            raise ConfigError(
                f"writing the safetensors under {target} failed ({' '.join(str(e).split())}): free space there or "
                "pass another base_output_directory; nothing was exported"
            ) from None
        raise
    return files, tokenizer_files


def _run_base(params_path: Path, base_parameters_path: str, cfg: ModelConfig) -> tuple[Any, str, str]:
    """``(weights, name, note)``: the weights a full fine-tune's step started from, in ``cfg``'s layout, and how
    they are named; or None and a note saying why there are none to compare with ("" for a checkpoint that is
    no training step, a conversion: nothing was trained; and for ``base_parameters_path=none``).

    The base is ``base_parameters_path``, else the ``load_parameters_path`` of the run's ``config.json``
    (``<run>/checkpoints/actor/<step>/model_params`` -> ``<run>/config.json``).

    Raises:
      ConfigError: a ``base_parameters_path`` that does not exist.
    """
    from grpax.models.params import convert_layout

    training_step = params_path.name == "model_params" and params_path.parent.parent.name == "actor"
    if base_parameters_path == "none" or not (base_parameters_path or training_step):
        return None, "", ""
    fix = "pass base_parameters_path=<the run's load_parameters_path> to measure what weight_dtype keeps"
    if base_parameters_path:
        base_path, how = Path(base_parameters_path).absolute(), "base_parameters_path"
        if not base_path.exists():
            raise ConfigError(
                f"base_parameters_path={base_parameters_path!r} does not exist: pass the params folder the run "
                "started from (its load_parameters_path), or none to export without the comparison"
            )
    else:
        run_config = params_path.parents[3] / "config.json"
        try:
            base_path = Path(json.loads(run_config.read_text())["load_parameters_path"])
        except (OSError, ValueError, KeyError, TypeError):
            return None, "", f"not compared with the run's base: {run_config} does not name it; {fix}"
        how = f"the run's load_parameters_path, {run_config}"
        if not base_path.exists():
            return None, "", f"not compared with the run's base: {base_path} ({how}) does not exist; {fix}"
    base = convert_layout(restore_params(base_path), cfg, scan_layers=cfg.scan_layers)
    return base, f"{base_path} ({how})", ""
