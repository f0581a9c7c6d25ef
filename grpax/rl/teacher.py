"""The distillation teacher: its keys' checks, its model read and compared with the student's, its frozen params.

On-policy distillation (``grpax.rl.distill``) scores the student's sampled tokens under a frozen teacher, so the
teacher must share the student's vocabulary and tokenizer (a token id means the same string to both): a
teacher of another size of the same family, e.g. llama3.1-8b-Instruct teaching llama3.2-1b-Instruct. Its params
are loaded once at the start like the student's (a native Orbax checkpoint, ``teacher_parameters_path``), placed
on the trainer's mesh by the same rules table, rounded as the forward reads them, and held as the reference is
(``grpax.rl.reference.FrozenParams``: on the devices, or mapped from ``<run>/.teacher`` on a CPU host).
"""

from __future__ import annotations

import contextlib
import filecmp
from pathlib import Path
from typing import Any

import jax

from grpax import sharding
from grpax.checkpoint.orbax import load_model
from grpax.config import read_model_config
from grpax.errors import ConfigError, suggest
from grpax.models.llama import round_as_read
from grpax.models.registry import MODELS, ModelConfig, registered_names_of, shape_diffs
from grpax.rl.reference import FrozenParams


def validate_teacher_keys(cfg: Any) -> None:
    """``distillation_coef``, ``teacher_parameters_path`` and ``teacher_model_name`` agree (``TrainConfig``).

    Raises:
      ConfigError: a coefficient > 0 without a teacher (``compile_topology`` plans one from its name alone), a
        teacher without a coefficient, ``reward_preset=none`` without one (nothing to learn from), or an
        unregistered ``teacher_model_name``; one line naming the fix.
    """
    coef, path, name = cfg.distillation_coef, cfg.teacher_parameters_path, cfg.teacher_model_name
    if (
        coef > 0
        and not path
        and not cfg.compile_topology
        and not (cfg.convert_checkpoint_if_possible and name)
    ):
        raise ConfigError(
            f"distillation_coef={coef} needs teacher_parameters_path=<the teacher's native checkpoint, <base>/0/items "
            "from grpax to_native> (or convert_checkpoint_if_possible=true teacher_model_name=<registered name>; "
            "or distillation_coef=0: GRPO alone)"
        )
    if coef == 0 and (path or name):
        given = f"teacher_parameters_path={path!r}" if path else f"teacher_model_name={name!r}"
        raise ConfigError(
            f"{given} names a distillation teacher, read only with distillation_coef > 0: set distillation_coef "
            "(e.g. 1.0) or drop the teacher keys"
        )
    if coef == 0 and cfg.task == "gsm8k" and cfg.reward_preset == "none":
        raise ConfigError(
            "reward_preset=none scores every completion 0, so GRPO alone learns nothing: set distillation_coef > 0 "
            "with teacher_parameters_path (on-policy distillation), or another reward_preset"
        )
    if name and name not in MODELS:
        raise ConfigError(
            f"teacher_model_name={name!r} is not a registered model.{suggest(name, MODELS)} Pass a registered "
            "name (grpax models lists them), or leave it unset to check the teacher against model_name"
        )


def teacher_name(cfg: Any) -> str:
    """The registered name the teacher's checkpoint is checked against: ``teacher_model_name``, else the
    student's ``model_name`` ('' = none)."""
    return cfg.teacher_model_name or cfg.model_name


def read_teacher(cfg: Any, student: ModelConfig | None, student_source: Any) -> ModelConfig | None:
    """The teacher's model (its config.json with the run's model keys), checked against its registered name and
    the student's vocabulary and tokenizer; None without a teacher (``distillation_coef`` 0).

    Raises:
      ConfigError: no config.json at or above ``teacher_parameters_path``, a teacher that is not its registered
        name, or a teacher whose vocabulary size or tokenizer differs from the student's (both models named).
    """
    if cfg.distillation_coef <= 0 or not cfg.teacher_parameters_path:
        return None
    path = cfg.teacher_parameters_path
    what = f"max_target_length={cfg.max_target_length} (the teacher's context)"
    teacher, source = read_model_config(path, cfg, cfg.max_target_length, what)
    if teacher is None:
        raise ConfigError(
            f"teacher_parameters_path={path!r}: no config.json at or above it; pass a checkpoint converted with "
            "grpax to_native (<base>/0/items) or a trained actor's model_params"
        )
    _check_name(teacher, teacher_name(cfg), source)
    if student is not None:
        check_same_vocabulary(teacher, source, student, student_source)
    return teacher


def _check_name(teacher: ModelConfig, name: str, source: Path) -> None:
    """Refuses a teacher checkpoint whose shapes are not those of the registered ``name`` ('' = no check)."""
    diffs = shape_diffs(teacher, name) if name else []
    if diffs:
        own = registered_names_of(teacher)
        fix = f"teacher_model_name={own[0]}" if own else "teacher_model_name=<the teacher's registered name>"
        raise ConfigError(f"the teacher {source} does not match {name} ({'; '.join(diffs)}): pass {fix}")


def _describe(cfg: ModelConfig, source: Any) -> str:
    names = registered_names_of(cfg)
    name = names[0] if names else cfg.family
    return f"{name} ({source})" if source else name


def check_same_vocabulary(
    teacher: ModelConfig, teacher_source: Any, student: ModelConfig, source: Any
) -> None:
    """Refuses a teacher whose vocabulary differs from the student's: vocab_size from the configs, then the
    tokenizers' token -> id tables where both folders hold a tokenizer.json (the files beside config.json) and
    the two files differ.

    Raises:
      ConfigError: one line naming both models and the fix.
    """
    both = f"the teacher {_describe(teacher, teacher_source)} and the student {_describe(student, source)}"
    fix = "pass a teacher of the student's tokenizer (another size of its family) as teacher_parameters_path"
    if teacher.vocab_size != student.vocab_size:
        raise ConfigError(
            f"{both} have different vocabularies (vocab_size {teacher.vocab_size} vs {student.vocab_size}): "
            f"distillation scores the student's tokens under the teacher; {fix}"
        )
    if not (teacher_source and source):  # a plan's registered names: no files to compare
        return
    files = [Path(teacher_source).parent / "tokenizer.json", Path(source).parent / "tokenizer.json"]
    if not all(f.is_file() for f in files) or _same_file(*files):
        return
    if _vocab(files[0]) != _vocab(files[1]):
        raise ConfigError(
            f"{both} have different tokenizers (their tokenizer.json map tokens to other ids): distillation "
            f"scores the student's tokens under the teacher; {fix}"
        )


def load_teacher(
    cfg: Any,
    teacher_cfg: ModelConfig,
    mesh: jax.sharding.Mesh,
    folder: Path | None,
    closing: contextlib.ExitStack,
) -> FrozenParams:
    """The teacher's params, loaded once: placed on ``mesh`` by the rules table, rounded as the forward reads
    them (the logprobs are the same, bit for bit), frozen: in host memory with ``teacher_memory=pinned_host``
    (copied to the devices for each pass), else mapped from ``folder`` on a CPU host, else held on the devices;
    its files go when ``closing`` closes."""
    params, teacher_cfg, _ = load_model(cfg.teacher_parameters_path, teacher_cfg)
    params = round_as_read(sharding.shard_params(params, teacher_cfg, mesh), teacher_cfg)
    on_host = cfg.teacher_on_host
    teacher = FrozenParams(params, None if on_host else folder, host_memory=on_host)
    closing.callback(teacher.close)
    return teacher


def _same_file(a: Path, b: Path) -> bool:
    """The same file, or byte for byte the same (a converted teacher's copy of the student's tokenizer)."""
    return a.resolve() == b.resolve() or filecmp.cmp(a, b, shallow=False)


def _vocab(file: Path) -> dict[str, int]:
    """A tokenizer.json's token -> id table, its added tokens included (what ``load_tokenizer(...).get_vocab()``
    returns, without transformers)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(file)).get_vocab(with_added_tokens=True)
