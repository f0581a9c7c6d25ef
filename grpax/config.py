"""Typed, frozen configs and MaxText-style ``key=value`` parsing.

Every command takes flat ``key=value`` arguments whose names match MaxText's where MaxText has one
(``model_name``, ``base_output_directory``, ``load_parameters_path``, ``scan_layers``, ...), so a MaxText user
switches by changing only the module name. Values are layered, later wins:

1. the dataclass defaults;
2. the model preset ``grpax/configs/<preset>.yml`` named by ``model_name``'s row of ``MODELS`` (only keys the
   command knows);
3. a user YAML given as ``config=FILE.yml`` (or as a bare ``*.yml`` first argument, as MaxText does);
4. ``key=value`` overrides on the command line.

An unknown key is an error that suggests the closest valid one.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import logging
import os
import re
import types
import typing
from pathlib import Path
from typing import Any, ClassVar

import yaml

from grpax.errors import ConfigError, suggest  # noqa: F401 - re-exported: grpax.config.ConfigError
from grpax.models.registry import (
    MODELS,
    ModelConfig,
    check_context_length,
    checkpoint_config,
    find_hf_config,
    load_hf_config,
    registered_names_of,
)

CONFIG_DIR = Path(__file__).parent / "configs"


def _parse_bool(key: str, text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{key}={text!r}: expected a boolean (true/false)")


def _coerce(key: str, value: Any, annotation: Any) -> Any:
    """Converts a YAML or command-line value to the field's annotated type."""
    if isinstance(annotation, str):
        annotation = eval(annotation, vars(typing))  # noqa: S307 - our own annotations only
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.strip().lower() in ("none", "null", "")):
            if type(None) in args:
                return None
        non_none = [a for a in args if a is not type(None)]
        last_error = None
        for a in non_none:
            try:
                return _coerce(key, value, a)
            except ConfigError as e:
                last_error = e
        raise last_error or ConfigError(f"{key}={value!r}: cannot convert")
    if origin in (tuple, list):
        if isinstance(value, str):
            items = [v for v in value.replace("[", "").replace("]", "").split(",") if v.strip()]
        elif isinstance(value, (list, tuple)):
            items = list(value)
        else:
            items = [value]
        elem = args[0] if args else str
        return tuple(_coerce(key, v, elem) for v in items)
    if annotation is bool:
        return value if isinstance(value, bool) else _parse_bool(key, str(value))
    if annotation is int:
        try:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(float(value)) if isinstance(value, str) and "e" in value.lower() else int(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}={value!r}: expected an integer") from None
    if annotation is float:
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}={value!r}: expected a number") from None
    if annotation is dict or origin is dict:  # a YAML mapping, or its flow form on the command line
        parsed = _flow_mapping(key, value) if isinstance(value, str) else value
        if parsed is None or parsed == "":
            return {}
        if not isinstance(parsed, dict):
            raise ConfigError(f"{key}={value!r}: expected a mapping, e.g. {key}={{name: {{key: value}}}}")
        return parsed
    if annotation is str:
        if value is None or isinstance(
            value, bool
        ):  # YAML's null / no / off: never the string 'None' / 'False'
            raise ConfigError(
                f"{key}: {value!r} (YAML reads {'null' if value is None else str(value).lower()} as "
                f"{'no value' if value is None else 'a boolean'}): quote a text value ({key}: 'no'), or write "
                f"{key}: '' for none"
            )
        if isinstance(value, (list, dict)):  # a YAML list or mapping: never its Python repr as a name
            raise ConfigError(f"{key}: {value!r} is a YAML {type(value).__name__}: expected one text value")
        return str(value).strip()
    return value


# A colon that YAML's flow style reads as part of a plain scalar ("a:1" is one key): one followed by neither a
# space nor "//" (a URL's).
_TIGHT_COLON = re.compile(r":(?=[^\s/])")


def _flow_mapping(key: str, value: str) -> Any:
    """A command-line mapping in YAML's flow style. MaxText's scripts write it without spaces
    (``vllm_hf_overrides={architectures:[MaxTextForCausalLM]}``), where YAML would read ``{a:{b:1}}`` as the key
    ``'a:{b:1}'``: inside braces a colon followed by text is read as a separator.

    Raises:
      ConfigError: text that is not YAML (the key, the value and the problem named).
    """
    text = _TIGHT_COLON.sub(": ", value) if value.lstrip().startswith("{") else value
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        problem = " ".join(str(getattr(e, "problem", None) or e).split())
        raise ConfigError(
            f"{key}={value!r} is not a YAML mapping ({problem}): write it as {key}={{name: {{key: value}}}} and "
            "quote it for the shell"
        ) from None


# The key of every command that compiles (MaxText's jax_cache_dir); acted on in grpax.cli.common.
JAX_CACHE_DIR_HELP = (
    "JAX's persistent compilation cache: compiled programs are kept on disk and reused by the next run of the "
    "same shapes (and by the run after the pre-run fit check). auto = $JAX_COMPILATION_CACHE_DIR if set, else "
    "$XDG_CACHE_HOME/grpax/jax, else ~/.cache/grpax/jax; a folder to move it; '' = off"
)


# The key of every command that compiles; acted on in grpax.cli.common.set_optimization_level.
XLA_OPTIMIZATION_LEVEL_HELP = (
    "auto | O0 | O1 | O2 | O3: XLA's optimization level of the programs a command compiles (JAX's "
    "jax_optimization_level, openxla.org/xla/effort_levels); auto = the compiler's default (or "
    "$JAX_OPTIMIZATION_LEVEL). O1 and O0 compile faster and run slower (on a TPU: the update's compile about a "
    "third, its run 1.5-2.4x longer; docs/benchmarks.md): for smoke runs, not for training"
)


HARDWARE_HELP = (
    "auto | cpu | gpu | tpu | gpu_multiprocess: auto = the accelerator JAX finds (TPU, then GPU), else the CPU; "
    "a JAX_PLATFORMS set in the environment wins"
)
# to_native and to_huggingface: conversion is host work (numpy and file I/O), and an accelerator is held by one
# process at a time, so they leave it to a job that may be running.
HOST_HARDWARE_HELP = (
    "cpu | auto | gpu | tpu | gpu_multiprocess: cpu by default, since conversion is host work and leaves the "
    "accelerator to a job that may hold it; auto = the accelerator JAX finds; a JAX_PLATFORMS set wins"
)


# MaxText keys that some grpax commands do not need: accepted everywhere (so MaxText command lines work
# unchanged) with a note, instead of an unknown-key error.
MAXTEXT_KEYS = frozenset(
    {
        "model_name",
        "hf_access_token",
        "base_output_directory",
        "scan_layers",
        "use_multimodal",
        "hardware",
        "jax_cache_dir",
        "skip_jax_distributed_system",
        "checkpoint_storage_use_zarr3",
        "checkpoint_storage_use_ocdbt",
        "lazy_load_tensors",
        "load_parameters_path",
        "run_name",
        "chips_per_vm",
        "num_batches",
        "num_test_batches",
        "rollout_data_parallelism",
        "rollout_tensor_parallelism",
        "weight_dtype",
        "tokenizer_path",
        "tokenizer_type",
        "async_checkpointing",
        "enable_checkpointing",
        "use_pathways",
    }
)


@dataclasses.dataclass(frozen=True)
class Foreign:
    """A key of another stack (MaxText's RL trainer) that a command has no field for: given one of ``accepted``
    (lower-case text; a leading ``*`` matches a suffix; () = any value) it is dropped with an INFO note saying
    ``why``; any other value is refused naming ``fix``. A command lists them in ``FOREIGN_KEYS``."""

    why: str
    accepted: tuple[str, ...] = ()
    fix: str = ""

    def allows(self, value: Any) -> bool:
        text = "" if value is None else str(value).strip().lower()
        return not self.accepted or any(_same_text(text, a) for a in self.accepted)


def _same_text(text: str, accepted: str) -> bool:
    """``text`` is ``accepted`` (numbers as numbers: 1.0 is 1; ``*x``: ends with x)."""
    if accepted.startswith("*"):
        return text.endswith(accepted[1:])
    try:
        return float(text) == float(accepted)
    except ValueError:
        return text == accepted


# Keys whose values are secrets (hf_access_token, an API key, a password): never printed or written in clear.
_SECRET_KEY = re.compile(r"secret|password|passwd|credential|api_?key|(^|_)token$", re.IGNORECASE)
REDACTED = "<redacted>"


def is_secret(key: str) -> bool:
    """Whether ``key`` names a secret (``*token``, ``*secret*``, ``*password*``, ``*api_key*``; not
    ``tokenizer_path`` or ``stop_token_ids``)."""
    return bool(_SECRET_KEY.search(key))


def redact(key: str, value: Any) -> Any:
    """``value``, or ``REDACTED`` when ``key`` names a secret and the value is set."""
    return REDACTED if is_secret(key) and value not in ("", None) else value


def redacted(record: dict) -> dict:
    """``record`` with the values of its secret keys replaced (``redact``); nested dicts too."""
    return {k: redacted(v) if isinstance(v, dict) else redact(k, v) for k, v in record.items()}


# The keys that name a command's checkpoint (whose config.json can tell which model it is).
_CHECKPOINT_KEYS = ("load_parameters_path", "hf_model_path")


def _shown(value: Any, limit: int = 120) -> str:
    """``value`` as a note prints it: cut to ``limit`` characters (MaxText's logical_axis_rules runs to 3,000)."""
    text = str(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def _drop_maxtext_only(values: dict, fields: dict, where: str, foreign: dict | None = None) -> dict:
    kept = {}
    for key, value in values.items():
        if key not in fields and key in (foreign or {}):
            rule = foreign[key]
            if not rule.allows(value):
                literal = [a for a in rule.accepted if not a.startswith("*")]
                override = (
                    f" (or give {key}={literal[0]} on the command line, which wins over {where})"
                    if literal and where != "the command line"
                    else ""
                )
                raise ConfigError(f"{key}={_shown(value)} ({where}): {rule.why}; {rule.fix}{override}")
            done = "what grpax does anyway" if rule.accepted else "ignored"
            logging.getLogger("grpax.config").info(
                "%s=%s (%s): %s; %s", key, _shown(value), where, rule.why, done
            )
        elif key in fields or key not in MAXTEXT_KEYS:
            kept[key] = value
        elif key == "use_multimodal" and str(value).strip().lower() in ("1", "true", "yes", "on"):
            raise ConfigError(
                "use_multimodal=true: multimodal models are not supported by grpax (use_multimodal=false)"
            )
        else:
            logging.getLogger("grpax.config").info(
                "%s=%s (%s): a MaxText key this command does not use; ignored", key, redact(key, value), where
            )
    return kept


def preset_path(model_name: str) -> Path | None:
    """The preset YAML of a registered ``model_name`` (its ``MODELS`` row names it), or None."""
    row = MODELS.get(model_name)
    return CONFIG_DIR / f"{row.preset}.yml" if row else None


def _preset_note(name: str) -> str:
    preset = preset_path(name)
    if preset is None or not preset.exists():
        return ""
    lines = [line.strip() for line in preset.read_text().splitlines()]
    keys = [line.replace(": ", "=") for line in lines if line and not line.startswith("#")]
    return f" (its preset grpax/configs/{preset.name}: {', '.join(keys)})"


def unregistered_name_error(model_name: str, checkpoint: str = "") -> ConfigError:
    """The error for a ``model_name`` that is not in ``MODELS``: no preset (prompt, rewards, dtypes) would apply.

    Args:
      model_name: the unregistered name.
      checkpoint: the command's checkpoint path, if any; when its ``config.json`` has a registered model's
        shapes, the error names that model and its preset, else the closest registered names.
    """
    head = f"model_name={model_name!r} is not registered, so no model preset would apply"
    config = find_hf_config(checkpoint) if checkpoint else None
    try:
        matches = registered_names_of(load_hf_config(config)) if config else []
    except ConfigError:
        matches = []
    if matches:
        return ConfigError(
            f"{head}; the checkpoint's {config} is {' or '.join(matches)}: pass model_name={matches[0]}"
            f"{_preset_note(matches[0])}, or model_name='' to run it without a preset"
        )
    repos = {row.hf_repo.lower(): name for name, row in MODELS.items()}
    lower = {name.lower(): name for name in MODELS}
    close = [repos[model_name.lower()]] if model_name.lower() in repos else []
    close += [lower[c] for c in difflib.get_close_matches(model_name.lower(), lower, n=3, cutoff=0.3)]
    close = list(dict.fromkeys(close))[:3] or list(MODELS)[:3]
    return ConfigError(
        f"{head}; closest registered names: {', '.join(close)} (all: grpax/models/registry.py MODELS); pass "
        "one of them, or model_name='' for a checkpoint grpax does not register (its own config.json, no preset)"
    )


def _check_model_name(model_name: str, checkpoint: str = "") -> None:
    """Refuses a model_name that is not registered (it would silently run without the model's preset).

    ``checkpoint`` (the command's load_parameters_path or hf_model_path) lets the error name the registered
    model whose shapes that checkpoint's config.json has.
    """
    if model_name not in MODELS:
        raise unregistered_name_error(model_name, checkpoint)


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (YAML keeps the last one silently)."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"key {key!r} is given twice (lines {seen[key] + 1} and {key_node.start_mark.line + 1}); "
                    "keep one",
                    key_node.start_mark,
                )
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def _read_yaml(path: Path) -> dict:
    try:
        data = yaml.load(path.read_text(), Loader=_UniqueKeyLoader) or {}  # noqa: S506 - a SafeLoader
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = " ".join(str(getattr(e, "problem", None) or e).split())
        raise ConfigError(f"config file {path} is not valid YAML{where}: {problem}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of key: value")
    return data


def _flatten(data: dict) -> dict:
    """Flattens MaxText's nested sections (``rl: {num_generations: 2}``) into top-level keys, a key given both in
    a section and outside it spelled ``rl.<key>`` for ``_resolve_aliases`` to refuse if the two differ."""
    flat: dict = {}
    for key, value in data.items():
        if isinstance(value, dict) and key in ("rl", "debug"):
            flat.update({(f"{key}.{k}" if k in data else k): v for k, v in _flatten(value).items()})
        else:
            flat[key] = value
    return flat


def _resolve_aliases(
    values: dict, aliases: dict[str, str], where: str, refuse_twice: bool
) -> tuple[dict, dict[str, str]]:
    """``values`` keyed by field names: each alias (MaxText's spelling, or ``rl.<key>``) replaced by the key it
    stands for; on a command line the last spelling wins, as the last of a key given twice does. Returned with
    each key's spelling as given, for the errors of its value to name.

    Raises:
      ConfigError: with ``refuse_twice`` (a YAML file, where a key given twice is refused too), two spellings
        of one key with different values (the last one won without a word).
    """
    resolved: dict = {}
    spelled: dict[str, str] = {}
    for given, value in values.items():
        key = aliases.get(given.removeprefix("rl."), given.removeprefix("rl."))
        if refuse_twice and key in resolved and str(resolved[key]) != str(value):
            raise ConfigError(
                f"{spelled[key]}={resolved[key]} and {given}={value} ({where}) both set {key}: keep one"
            )
        resolved[key], spelled[key] = value, given
    return resolved, spelled


def parse_overrides(argv: list[str]) -> tuple[dict[str, str], Path | None]:
    """Splits ``key=value`` tokens; a bare ``*.yml`` token or ``config=`` names a user YAML file."""
    overrides: dict[str, str] = {}
    user_yaml = None
    for token in argv:
        path = None
        if "=" not in token:
            if not token.endswith((".yml", ".yaml")):
                raise ConfigError(
                    f"argument {token!r} is not key=value (e.g. model_name=smollm2-135m-Instruct)"
                )
            path = Path(token)
        else:
            key, value = token.split("=", 1)
            key = key.strip().lstrip("-").replace("-", "_")
            if key != "config":
                overrides[key] = value
                continue
            path = Path(value)
        if user_yaml is not None:  # before: the last file won and the other was dropped without a word
            raise ConfigError(
                f"two config files, {user_yaml} and {path}: pass one (copy the keys of one into the other, or "
                "give them as key=value)"
            )
        user_yaml = path
    return overrides, user_yaml


SEED_MAX = 2**63 - 1  # jax.random.PRNGKey takes an int64


def build_config(cls: type, argv: list[str] | None = None, **explicit: Any):
    """Builds a frozen dataclass ``cls`` from defaults, model preset, user YAML and ``key=value`` tokens.

    Args:
      cls: a dataclass type whose fields are the command's keys; an optional class attribute
        ``ALIASES: ClassVar[dict[str, str]]`` maps other spellings (MaxText's) to field names,
        ``FOREIGN_KEYS: ClassVar[dict[str, Foreign]]`` names other stacks' keys it drops or refuses,
        ``NULL_MEANS: ClassVar[dict[str, Any]]`` the value a key's null (YAML ``null``, ``none``) stands for, and
        ``PRESET_IGNORES: ClassVar[tuple[str, ...]]`` names keys the model preset does not set for it.
      argv: ``key=value`` tokens (MaxText style).
      **explicit: values that win over everything (used by tests and library callers).

    Returns:
      An instance of ``cls``.

    Raises:
      ConfigError: an unknown key (with a did-you-mean), a value of the wrong type, or a seed outside
        [0, 2**63 - 1].
    """
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    aliases: dict[str, str] = getattr(cls, "ALIASES", {})
    overrides, user_yaml = parse_overrides(list(argv or []))
    overrides, spelled = _resolve_aliases(overrides, aliases, "the command line", refuse_twice=False)
    foreign = getattr(cls, "FOREIGN_KEYS", {})
    given = set(overrides)  # another stack's key given here is not read from the YAML file too
    overrides = _drop_maxtext_only(overrides, fields, "the command line", foreign)
    for key in list(overrides) + list(explicit):
        if key not in fields:
            raise ConfigError(
                f"unknown key '{key}' for this command.{suggest(key, fields)} "
                f"(run with --help to list the keys)"
            )
    layers: list[tuple[dict, dict[str, str]]] = []  # (key: value, key: its spelling as given)
    model_name = explicit.get("model_name", overrides.get("model_name"))
    user_data = _flatten(_read_yaml(user_yaml)) if user_yaml else {}
    user_data, spelled_in_yaml = _resolve_aliases(user_data, aliases, str(user_yaml), refuse_twice=True)
    model_name = model_name or user_data.get("model_name")
    if model_name is None and "model_name" in fields:
        model_name = fields["model_name"].default
    if model_name:
        sources = (explicit, overrides, user_data)
        checkpoint = next((s[k] for k in _CHECKPOINT_KEYS for s in sources if s.get(k)), "")
        _check_model_name(str(model_name), str(checkpoint))
    preset_file = preset_path(str(model_name)) if model_name else None
    if preset_file is not None and preset_file.exists():
        preset = _read_yaml(preset_file)
        ignored = getattr(cls, "PRESET_IGNORES", ())
        layers.append(({k: v for k, v in preset.items() if k in fields and k not in ignored}, {}))
    if user_yaml:
        shadowed = {k for k in user_data if k in given and k in foreign and k not in fields}
        user_data = {k: v for k, v in user_data.items() if k not in shadowed}
        user_data = _drop_maxtext_only(user_data, fields, str(user_yaml), foreign)
        for key in user_data:
            if key not in fields:
                raise ConfigError(f"unknown key '{key}' in {user_yaml}.{suggest(key, fields)}")
        layers.append((user_data, spelled_in_yaml))
    layers.append((overrides, spelled))
    values: dict[str, Any] = {}
    nulls = getattr(cls, "NULL_MEANS", {})
    for layer, spellings in layers:
        for key, value in layer.items():
            if key in nulls and (value is None or str(value).strip().lower() in ("null", "none")):
                value = nulls[key]
            values[key] = _coerce(
                spellings.get(key, key), value, hints[key]
            )  # the error names the key as given
    values.update(explicit)
    seed = values.get("seed")
    if "seed" in fields and seed is not None and not 0 <= seed <= SEED_MAX:
        # numpy's permutation refuses a negative seed and jax's PRNG key one past int64, each only after the
        # model has loaded, with a message that names no key ("expected non-negative integer").
        raise ConfigError(f"seed={seed}: expected an integer in [0, 2**63 - 1]")
    return cls(**values)


def describe(cls: type, values: Any = None) -> str:
    """Lists a config's keys, types, defaults and one-line help (from ``metadata['help']``) for --help.

    Args:
      cls: the config dataclass.
      values: an instance whose values are shown instead of the bare defaults (e.g. with the model preset
        applied), so --help shows what a run would use.
    """
    lines = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if values is not None:
            default = redact(f.name, getattr(values, f.name))
        elif f.default is not dataclasses.MISSING:
            default = f.default
        else:
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else "(required)"
        type_name = getattr(hints[f.name], "__name__", str(hints[f.name])).replace("typing.", "")
        lines.append((f"  {f.name}={default!s}", f"[{type_name}] {f.metadata.get('help', '')}"))
    width = max(len(left) for left, _ in lines) + 2
    return "\n".join(f"{left:<{width}}{right}" for left, right in lines)


def field(default: Any, help: str) -> Any:  # noqa: A002 - mirrors argparse
    """A dataclass field with a one-line help text shown by --help."""
    if isinstance(default, (list, dict, set)):
        # Each instance its own copy; a mapping is left out of the frozen config's hash (a dict has none), so the
        # config stays hashable (equality still compares it).
        return dataclasses.field(
            default_factory=lambda: copy.deepcopy(default),
            hash=False if isinstance(default, dict) else None,
            metadata={"help": help},
        )
    return dataclasses.field(default=default, metadata={"help": help})


def new_default(config: type, key: str, default: Any) -> Any:
    """The field ``key`` of the config dataclass ``config`` with another default, its help kept: how a command
    whose default differs takes a key declared once elsewhere (``grpax serve``'s 32 decode slots:
    ``max_num_seqs: int = new_default(EngineKeys, "max_num_seqs", 32)``). The key keeps its place in --help."""
    return field(default, config.__dataclass_fields__[key].metadata["help"])


def values_of(config: Any, keys: type, **renamed: str) -> dict:
    """``config``'s values of the keys that the dataclass ``keys`` declares, each under its own name or the one
    ``renamed`` gives it: a group of keys as the arguments of what it sets (``ModelKeys.model_keys``)."""
    return {renamed.get(f.name, f.name): getattr(config, f.name) for f in dataclasses.fields(keys)}


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes")


ATTENTION_HELP = (
    "attention implementation (MaxText key): dot_product (XLA einsums) | jax_nn (jax.nn.dot_product_attention) | "
    "cudnn (its cuDNN flash kernel: NVIDIA GPU, bfloat16/float16 dtype) | flash (Pallas's splash attention "
    "kernel: TPU, no sliding-window layers; the update and reference pass)"
)


@dataclasses.dataclass(frozen=True)
class RuntimeKeys:
    """Where a command runs (MaxText's keys): the JAX platform, the compilation cache, several hosts."""

    hardware: str = field("auto", HARDWARE_HELP)
    jax_cache_dir: str = field("auto", JAX_CACHE_DIR_HELP)
    xla_optimization_level: str = field("auto", XLA_OPTIMIZATION_LEVEL_HELP)
    skip_jax_distributed_system: bool = field(True, "do not call jax.distributed.initialize (single host)")
    debug: bool = field(False, "log grpax's DEBUG messages too (MaxText key)")


@dataclasses.dataclass(frozen=True)
class ModelKeys:
    """The keys a command reads a checkpoint's config.json with (``ModelConfig``'s layout, dtypes and attention):
    train_rl, evaluate and generate take them alike (``read_model_config``)."""

    scan_layers: bool = field(True, "stack the layers and scan over them (compile time independent of depth)")
    weight_dtype: str = field("float32", "params' storage dtype: float32 | bfloat16 | float16")
    dtype: str = field(
        "float32",
        "compute dtype: activations, matmul inputs, KV cache (the accelerator presets: bfloat16); float32 is "
        "faster than bfloat16 on CPU",
    )
    attention: str = field("dot_product", ATTENTION_HELP)

    def model_keys(self) -> dict:
        """These keys as ``load_hf_config``'s overrides."""
        return values_of(self, ModelKeys)


SAMPLER_PROGRAMS = ("auto", "fixed", "adaptive")  # SamplerConfig.programs' values


@dataclasses.dataclass(frozen=True)
class EngineKeys:
    """The rollout engine's KV memory and decode slots (``grpax.sampler.engine``: a paged cache, continuously
    batched): train_rl, evaluate, generate and serve take them alike (``engine_keys``), checked once by
    ``check_engine_keys``; serve with its own default of max_num_seqs (``new_default``) and its own program set
    (``grpax.serve.worker.bounded``), which each help names."""

    page_size: int = field(
        32,
        "tokens per page of the sampler's paged KV cache (16-128): a sequence holds ceil(its tokens / page_size) "
        "pages, taken as it grows and freed when it ends",
    )
    num_pages: int = field(
        0,
        "pages in the sampler's KV pool (page_size tokens each, one of them scratch); 0 = every decode slot holds "
        "max_target_length tokens (the static engine's memory); fewer give the same rollouts while the running "
        "sequences' real lengths fit (else the newest is preempted and restarted); at least 1 + "
        "ceil(max_target_length / page_size)",
    )

    NULL_MEANS: ClassVar[dict[str, Any]] = {"max_num_seqs": 0}  # MaxText rl.yml's null: the engine decides

    max_num_seqs: int = field(
        0,
        "decode slots (vLLM's and MaxText rl.yml's key): sequences sampled at once at most, the rest queued and "
        "started as slots free (continuous batching); 0 (or null) = every sequence of a batch at once (train_rl: "
        "batch_size x num_generations; serve: at least 1)",
    )

    hbm_utilization_vllm: float = field(
        0.0,
        "the fraction of each accelerator's memory (JAX's bytes_limit) the rollout's params and KV pool may take "
        "together (MaxText rl.yml's key, vLLM's gpu_memory_utilization): the pool gets the pages that fit after "
        "the params and any pool already alive (a kept rollout engine's, while an evaluation builds its own), at "
        "most the num_pages=0 pool; 0 = off (num_pages sizes it); GPU and TPU only",
    )

    slot_count_step: int = field(
        0,
        "the step between the decode slot counts the engine compiles (with nothing queued, a decode runs on the "
        "smallest count that holds its running sequences): 0 = max(2, slots // 8), e.g. 32 slots: 32, 28, ..., "
        "4, 2, 1 (serve: max_num_seqs // 2, the halvings 32, 16, 8, 4, 2, 1, each warmed up); 1 = every count: "
        "no idle slot in the tail, one decode compile per count",
    )

    sampler_programs: str = field(
        "auto",
        "the programs the sampler compiles: fixed = one decode slot count, the whole page table, one prompt "
        "padding, sampling settings as data (a small set known before the run, shared by every sampling call of "
        "the command: rollout, evaluation, request; compiled once); adaptive = slot counts, page-table widths and "
        "64-token prompt buckets that follow the work (one compile each); auto = fixed on an accelerator, "
        "adaptive on CPU (serve: adaptive always, its own bounded set; fixed is refused)",
    )

    def engine_keys(self) -> dict:
        """These keys as ``SamplerConfig`` fields (two of them named otherwise there)."""
        return values_of(
            self, EngineKeys, hbm_utilization_vllm="hbm_utilization", sampler_programs="programs"
        )


@dataclasses.dataclass(frozen=True)
class SamplingKeys(EngineKeys, ModelKeys, RuntimeKeys):
    """The keys of every command that samples a checkpoint on the rollout engine (train_rl, evaluate, generate,
    serve): where it runs, how it reads the checkpoint's config.json, the engine's KV memory and slots."""


def check_engine_keys(
    keys: EngineKeys, context_length: int, what: str, group_sizes: tuple[tuple[str, int], ...] = ()
) -> None:
    """Checks the KV memory keys against the longest sequence, ``context_length`` tokens (prompt + completion;
    ``what`` names the keys that set it), and the decode slots against the command's group sizes
    (``group_sizes``: (key, completions per prompt) pairs; a prompt's completions start together), before any
    model loads.

    Raises:
      ConfigError: page_size < 1, num_pages < 0, max_num_seqs < 0 or below a group size, slot_count_step < 0,
        hbm_utilization_vllm outside [0, 1] or set with num_pages, or a pool (num_pages > 0) that holds no whole
        sequence: one line naming the key, its value and the fix.
    """
    if keys.page_size < 1:
        raise ConfigError(
            f"page_size={keys.page_size}: expected >= 1 tokens per page of the KV cache (e.g. 32)"
        )
    if keys.num_pages < 0:
        raise ConfigError(f"num_pages={keys.num_pages}: expected >= 0 (0: pages for every decode slot)")
    if keys.max_num_seqs < 0:
        raise ConfigError(
            f"max_num_seqs={keys.max_num_seqs}: expected >= 0 decode slots (0: every sequence of a batch at once)"
        )
    if keys.sampler_programs not in SAMPLER_PROGRAMS:
        raise ConfigError(
            f"sampler_programs={keys.sampler_programs!r}: expected one of {', '.join(SAMPLER_PROGRAMS)}"
        )
    if keys.slot_count_step < 0:
        raise ConfigError(
            f"slot_count_step={keys.slot_count_step}: expected >= 0 (0: max(2, slots // 8); 1: every slot count)"
        )
    if not 0.0 <= keys.hbm_utilization_vllm <= 1.0:
        raise ConfigError(
            f"hbm_utilization_vllm={keys.hbm_utilization_vllm}: expected a fraction in [0, 1] of each device's "
            "memory (0: off, num_pages sizes the KV pool)"
        )
    if keys.hbm_utilization_vllm and keys.num_pages:
        raise ConfigError(
            f"num_pages={keys.num_pages} and hbm_utilization_vllm={keys.hbm_utilization_vllm} both size the KV "
            "pool: pass one (the other 0)"
        )
    for key, size in group_sizes:
        if 0 < keys.max_num_seqs < size:
            raise ConfigError(
                f"max_num_seqs={keys.max_num_seqs} is below {key}={size}: a prompt's completions start together in "
                f"the decode slots; pass max_num_seqs >= {size}, or 0 (every sequence of a batch at once)"
            )
    need = 1 + -(-context_length // keys.page_size)  # a whole sequence and the scratch page
    if 0 < keys.num_pages < need:
        raise ConfigError(
            f"num_pages={keys.num_pages}: the KV pool holds no sequence of {what} = {context_length} tokens in "
            f"pages of page_size={keys.page_size}; pass num_pages >= {need}, or 0 (pages for every decode slot)"
        )


def read_model_config(
    path: str, keys: ModelKeys, context_length: int, what: str
) -> tuple[ModelConfig | None, Path | None]:
    """A command's model, read once before anything loads: the nearest config.json at or above ``path`` with the
    command's ``keys``, and a check that ``context_length`` tokens (``what`` names the keys that set it) fit the
    model's context.

    Returns:
      (the ModelConfig, its config.json), or (None, None) when no config.json is found (the load says so).

    Raises:
      ConfigError: ``context_length`` above the model's (``check_context_length``: the keys and the limit named).
    """
    model_cfg, source = checkpoint_config(path, **keys.model_keys())
    check_context_length(context_length, what, model_cfg, source)
    return model_cfg, source
