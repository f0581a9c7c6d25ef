"""The GRPO training loop (``grpax train_rl``): rollout -> rewards -> advantages -> clipped update, repeated.

Each step takes ``batch_size`` GSM8K prompts, samples ``num_generations`` (G) completions of each with the
KV-cache sampler on the trainer's own parameters (no copy), scores them with the reward functions, turns rewards
into group-relative advantages, scores the completions under the frozen reference model (when beta > 0) and
applies ``num_iterations`` AdamW updates of the clipped GRPO objective (DeepSeekMath, Shao et al. 2024,
eq. 3; DAPO and Dr. GRPO variants in ``grpax.rl.losses``). Evaluation runs before, every ``eval_interval``
steps and after. Checkpoints hold everything a bit-exact resume needs: params, optimizer state, step,
data-iterator position and RNG seed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from grpax import distributed, sharding
from grpax.checkpoint.convert import to_huggingface
from grpax.checkpoint.orbax import load_model
from grpax.checkpoint.train_state import TrainCheckpointer
from grpax.config import ConfigError, field
from grpax.data.gsm8k import (
    PromptIterator,
    dataset_source,
    filter_by_length,
    load_dataset_rows,
    render_prompt,
    tokenize_prompts,
)
from grpax.data.prompts import get_prompt_preset
from grpax.data.tokenizer import save_tokenizer, stop_token_ids
from grpax.models.registry import ModelConfig, check_context_length, check_matches, to_hf_config
from grpax.rewards.gsm8k import get_reward_config, score_completions
from grpax.rl.advantages import compute_advantages
from grpax.rl.compare import compare_eval_folders
from grpax.rl.config import GRPOConfig
from grpax.rl.evaluate import decode_completions, evaluate
from grpax.rl.metrics_writer import MetricsWriter
from grpax.rl.optim import optimizer_from_config
from grpax.rl.reference import FrozenParams, offload_folder, release_host_memory
from grpax.rl.run_folder import claim_run_folder
from grpax.rl.train_step import TrainState, compute_logprobs, make_train_step
from grpax.sampler.engine import (
    GenerateOutput,
    SamplerConfig,
    generate,
)

log = logging.getLogger("grpax.train")


@dataclasses.dataclass(frozen=True)
class TrainConfig(GRPOConfig, sharding.MeshConfig):
    """All keys of ``grpax train_rl`` (MaxText names where MaxText has the key)."""

    ALIASES: ClassVar[dict[str, str]] = {  # MaxText rl.yml spellings
        **getattr(GRPOConfig, "ALIASES", {}),
        "data_shuffle_seed": "seed",
        "grpo_beta": "beta",
        "grpo_epsilon": "epsilon",
        "adam_b1": "b1",
        "adam_b2": "b2",
        "gradient_clipping_threshold": "max_grad_norm",
        "decode_sampling_temperature": "temperature",
    }

    model_name: str = field(
        "smollm2-135m-Instruct",
        "registered model name: picks the model preset, checked against the checkpoint; '' = no preset",
    )
    load_parameters_path: str = field(
        "",
        "converted checkpoint <base>/0/items (from grpax to_native) or an actor "
        "checkpoint .../actor/<step>/model_params",
    )
    base_output_directory: str = field("outputs", "root folder of all runs")
    run_name: str = field("grpo", "run folder under base_output_directory; the same name resumes the run")
    hardware: str = field("cpu", "cpu | gpu | tpu | gpu_multiprocess (sets the JAX platform when unset)")
    skip_jax_distributed_system: bool = field(True, "do not call jax.distributed.initialize (single host)")
    scan_layers: bool = field(True, "stack layers and scan over them (compile time independent of depth)")
    weight_dtype: str = field("float32", "parameter dtype (float32 | bfloat16 | float16)")
    dtype: str = field("float32", "activation / matmul dtype; float32 is faster than bfloat16 on CPU")
    remat_policy: str = field(
        "full",
        "rematerialisation of each layer in the backward pass: none | full | dots | minimal (full: the "
        "least memory, and on CPU also the fastest)",
    )
    dataset_name: str = field("openai/gsm8k", "Hub name, a folder with train.jsonl/test.jsonl, or a file")
    eval_dataset_name: str = field(
        "", "dataset for evaluation (default: dataset_name; needed when dataset_name is one file)"
    )
    allow_eval_on_train_rows: bool = field(
        False, "allow evaluating on the training rows (same file, or the same split as train_split)"
    )
    train_split: str = field("train", "split used for training")
    eval_split: str = field("test", "split used for evaluation")
    prompt_preset: str = field("maxtext", "prompt wording: maxtext | smollm2_demo (model presets pick one)")
    reward_preset: str = field(
        "maxtext", "reward values: maxtext | tunix | simple | smollm2_demo (model presets pick one)"
    )
    batch_size: int = field(4, "prompts per step (rows per step = batch_size * num_generations)")
    micro_batch_size: int = field(
        -1,
        "prompts per micro-batch of the reference and update passes (x num_generations rows; MaxText key); "
        "the update equals the full-batch one; -1 = use num_micro_batches (default 1: the whole batch at once, "
        "with remat the least memory: each micro-batch beyond one adds a gradient accumulator)",
    )
    num_batches: int = field(20, "training steps")
    num_test_batches: int = field(
        4,
        "evaluation batches (questions = num_test_batches * eval_batch_size); -1 = the whole split; "
        "0 = no evaluation",
    )
    eval_batch_size: int = field(16, "questions per evaluation batch")
    eval_interval: int = field(0, "evaluate every N steps (0: only before and after)")
    eval_before: bool = field(True, "evaluate before the first step")
    num_eval_passes: int = field(1, "samples per evaluation question (k of pass@k / maj@k)")
    eval_sampling_strategy: str = field("greedy", "greedy | standard (T 0.7, top-k 50, top-p 0.95) | liberal")
    max_prefill_predict_length: int = field(256, "max prompt tokens; longer prompts are dropped (counted)")
    max_target_length: int = field(512, "max prompt + completion tokens")
    decode_sampling_top_k: int = field(50, "top-k of rollout sampling (0 = off)")
    decode_sampling_nucleus_p: float = field(1.0, "top-p of rollout sampling (1.0 = off)")
    seed: int = field(42, "seed of data order, sampling and init (MaxText data_shuffle_seed)")
    checkpoint_period: int = field(10, "save a checkpoint every N steps (and at the end)")
    max_num_checkpoints_to_keep: int = field(3, "step checkpoints kept")
    checkpoint_storage_use_zarr3: bool = field(True, "Orbax zarr3 storage")
    checkpoint_storage_use_ocdbt: bool = field(True, "Orbax OCDBT storage")
    log_period: int = field(1, "write metrics every N steps")
    export_hf: str = field(
        "", "after training, also export the actor to this new folder in Hugging Face format (bfloat16)"
    )

    @property
    def micro_batches(self) -> int:
        """Micro-batches of the reference and update passes: from micro_batch_size, else num_micro_batches."""
        if self.micro_batch_size > 0:
            return self.batch_size // self.micro_batch_size
        return self.num_micro_batches

    @property
    def max_completion_length(self) -> int:
        return self.max_target_length - self.max_prefill_predict_length

    def grpo(self) -> GRPOConfig:
        return GRPOConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(GRPOConfig)})

    def mesh(self) -> sharding.MeshConfig:
        return sharding.MeshConfig(
            **{f.name: getattr(self, f.name) for f in dataclasses.fields(sharding.MeshConfig)}
        )


EVAL_STRATEGIES = {  # MaxText rl.yml generation_configs
    "greedy": dict(greedy=True, temperature=1.0, top_k=0, top_p=1.0),
    "standard": dict(greedy=False, temperature=0.7, top_k=50, top_p=0.95),
    "liberal": dict(greedy=False, temperature=0.85, top_k=2000, top_p=1.0),
}


def validate_eval_keys(cfg: Any, *, allow_no_eval: bool) -> None:
    """Checks the evaluation keys that ``grpax train_rl`` and ``grpax evaluate`` share.

    Args:
      allow_no_eval: accept num_test_batches=0, no evaluation (train_rl; evaluating nothing is no evaluate run).

    Raises:
      ConfigError: num_test_batches not >= 1 or -1 (or 0 with allow_no_eval), eval_batch_size or
        num_eval_passes < 1, or an unknown eval_sampling_strategy (the key, value and accepted values named).
    """
    if cfg.num_test_batches < (0 if allow_no_eval else 1) and cfg.num_test_batches != -1:
        raise ConfigError(
            f"num_test_batches={cfg.num_test_batches}: expected >= 1 evaluation batches, or -1 for the "
            f"whole {cfg.eval_split!r} split{', or 0 for no evaluation' if allow_no_eval else ''}"
        )
    for key, meaning in (
        ("eval_batch_size", "questions per evaluation batch"),
        ("num_eval_passes", "samples per evaluation question"),
    ):
        if getattr(cfg, key) < 1:
            raise ConfigError(f"{key}={getattr(cfg, key)}: expected >= 1 ({meaning})")
    if cfg.eval_sampling_strategy not in EVAL_STRATEGIES:
        raise ConfigError(
            f"eval_sampling_strategy={cfg.eval_sampling_strategy!r}: expected one of "
            f"{', '.join(EVAL_STRATEGIES)}"
        )


def validate(cfg: TrainConfig) -> None:
    """Raises ConfigError naming the key for settings that cannot work."""
    if not cfg.load_parameters_path:
        raise ConfigError(
            "load_parameters_path is required: convert a model first with "
            "`grpax to_native ... base_output_directory=DIR` and pass DIR/0/items"
        )
    if cfg.max_completion_length < 1:
        raise ConfigError(
            f"max_target_length={cfg.max_target_length} must exceed "
            f"max_prefill_predict_length={cfg.max_prefill_predict_length}"
        )
    if cfg.num_generations < 2:
        raise ConfigError(
            f"num_generations={cfg.num_generations}: GRPO needs at least 2 completions per prompt"
        )
    at_least_one = {
        "num_batches": "training steps",
        "batch_size": "prompts per step",
        "checkpoint_period": "save every N steps; the last step is always saved",
        "log_period": "write metrics every N steps; the last step is always written",
        "max_num_checkpoints_to_keep": "step checkpoints kept; the last step's is one of them",
    }
    for key, meaning in at_least_one.items():
        if getattr(cfg, key) < 1:
            raise ConfigError(f"{key}={getattr(cfg, key)}: expected >= 1 ({meaning})")
    validate_eval_keys(cfg, allow_no_eval=True)
    if cfg.eval_interval < 0:
        raise ConfigError(
            f"eval_interval={cfg.eval_interval}: expected >= 0 (0 = evaluate only before and after training)"
        )
    if cfg.export_hf and jax.process_count() > 1:
        raise ConfigError(
            f"export_hf={cfg.export_hf!r} runs in single-process jobs only (the export restores the checkpoint on "
            "one process); export a multi-process run afterwards with grpax to_huggingface"
        )
    export = Path(cfg.export_hf) if cfg.export_hf else None
    if export is not None and export.exists() and (not export.is_dir() or any(export.iterdir())):
        raise ConfigError(
            f"export_hf={cfg.export_hf!r} already exists and is not an empty folder; the export never "
            "overwrites: delete it or choose another folder"
        )
    if cfg.micro_batch_size < 1 and cfg.micro_batch_size != -1:
        raise ConfigError(
            f"micro_batch_size={cfg.micro_batch_size}: expected >= 1 prompts per micro-batch, or -1 to use "
            "num_micro_batches"
        )
    rows = cfg.batch_size * cfg.num_generations
    if cfg.micro_batch_size > 0 and cfg.batch_size % cfg.micro_batch_size:
        raise ConfigError(
            f"micro_batch_size={cfg.micro_batch_size} must divide batch_size={cfg.batch_size} (prompts per step)"
        )
    if rows % cfg.micro_batches:
        raise ConfigError(
            f"num_micro_batches={cfg.num_micro_batches} must divide batch_size * num_generations = {rows}"
        )


class NonFiniteError(RuntimeError):
    """Loss or gradients became NaN/inf; the last good checkpoint is kept."""


@dataclasses.dataclass
class RunPaths:
    run_dir: Path
    checkpoints: Path
    eval_dir: Path

    @classmethod
    def of(cls, cfg: TrainConfig) -> RunPaths:
        run_dir = Path(cfg.base_output_directory) / cfg.run_name
        return cls(run_dir, run_dir / "checkpoints", run_dir / "eval")


# Keys a resumed run cannot change: the saved data order, groups and weights (and their layout, scan_layers)
# follow from them. The dataset keys may change (a new dataset continues at the saved position).
RESUME_FIXED_KEYS = (
    "batch_size",
    "num_generations",
    "seed",
    "model_name",
    "load_parameters_path",
    "scan_layers",
)


def _config_record(cfg: TrainConfig) -> dict[str, Any]:
    """The config as ``config.json`` holds it (JSON types; ``load_parameters_path`` made absolute, so that a
    resume from another working folder compares the same folder)."""
    record = json.loads(json.dumps(dataclasses.asdict(cfg)))
    if record["load_parameters_path"]:
        record["load_parameters_path"] = str(Path(record["load_parameters_path"]).absolute())
    return record


def check_resume(cfg: TrainConfig, paths: RunPaths, latest: int) -> dict[str, tuple[Any, Any]]:
    """Checks that ``cfg`` can continue the run whose latest checkpoint is at step ``latest``.

    Returns:
      ``{key: (saved, current)}`` for each key that differs from the run's ``config.json`` (empty without one).

    Raises:
      ConfigError: ``num_batches`` is below ``latest``, or a key of ``RESUME_FIXED_KEYS`` changed.
    """
    if cfg.num_batches < latest:
        raise ConfigError(
            f"run {paths.run_dir} already has a checkpoint at step {latest}, past num_batches="
            f"{cfg.num_batches}: raise num_batches to >= {latest} to continue (or re-evaluate) it, or pass a "
            "new run_name"
        )
    saved_path = paths.run_dir / "config.json"
    if not saved_path.exists():
        return {}
    try:
        saved = json.loads(saved_path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"{saved_path} is not valid JSON ({e}): restore it, or delete it to resume without the key check"
        ) from None
    current = _config_record(cfg)
    unset = "<unset>"
    changes = {
        key: (saved.get(key, unset), current.get(key, unset))
        for key in sorted({*saved, *current})
        if saved.get(key, unset) != current.get(key, unset)
    }
    old_path = changes.get("load_parameters_path", ("", ""))[0]
    # The same folder spelled differently is no change; a relative path saved by an older grpax cannot be
    # compared (it was relative to the folder that run started in), so it is not held against the resume.
    if old_path and (
        not Path(old_path).is_absolute()
        or Path(old_path).resolve() == Path(cfg.load_parameters_path).resolve()
    ):
        del changes["load_parameters_path"]
    fixed = [key for key in RESUME_FIXED_KEYS if key in changes and key in saved]
    if fixed:
        listed = ", ".join(f"{key}={changes[key][0]!r} (now {changes[key][1]!r})" for key in fixed)
        raise ConfigError(
            f"run {paths.run_dir} was started with {listed}; a resumed run cannot change "
            f"{', '.join(fixed)}: pass the saved values to continue it, or pass a new run_name"
        )
    return changes


def _write_config(paths: RunPaths, cfg: TrainConfig) -> None:
    """Writes ``config.json`` atomically (other processes may read it to check a resume)."""
    tmp = paths.run_dir / "config.json.tmp"
    tmp.write_text(json.dumps(_config_record(cfg), indent=2) + "\n")
    tmp.replace(paths.run_dir / "config.json")


def _write_model_files(folder: Path, model_cfg: ModelConfig, tokenizer: Any) -> None:
    """config.json and tokenizer beside the actor checkpoints, so ``load_model`` finds them."""
    if jax.process_index() != 0 or (folder / "config.json").exists():
        return
    tmp = folder.with_name(folder.name + ".tmp-model-files")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / "config.json").write_text(json.dumps(to_hf_config(model_cfg, model_cfg.weight_dtype), indent=2))
    save_tokenizer(tokenizer, tmp)
    folder.mkdir(parents=True, exist_ok=True)
    for item in tmp.iterdir():
        item.rename(folder / item.name)
    tmp.rmdir()


def _load_rows(key: str, dataset: str, split: str, split_key: str) -> list[dict]:
    """``load_dataset_rows`` with its errors naming the key that chose the dataset."""
    try:
        return load_dataset_rows(dataset, split)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"{key}={dataset!r} ({split_key}={split!r}): {e}") from None


def _too_few(
    key: str, dataset: str, split_key: str, split: str, got: str, need: str, fix: str
) -> ConfigError:
    return ConfigError(f"{key}={dataset!r} ({split_key}={split!r}) has {got}, fewer than {need}: {fix}")


def check_inputs(cfg: TrainConfig) -> None:
    """Reads the rows the run needs before any model is loaded, so that no run trains and then fails.

    Raises:
      ConfigError: a dataset that cannot be read, fewer training rows than batch_size, an empty evaluation
        split, or evaluation on the training rows without eval_dataset_name or allow_eval_on_train_rows.
    """
    check_context_length(
        cfg.max_target_length, f"max_target_length={cfg.max_target_length}", cfg.load_parameters_path
    )
    rows = _load_rows("dataset_name", cfg.dataset_name, cfg.train_split, "train_split")
    if len(rows) < cfg.batch_size:
        fix = "lower batch_size or pass a larger dataset"
        got, need = f"{len(rows)} rows", f"batch_size={cfg.batch_size} (prompts per step)"
        raise _too_few("dataset_name", cfg.dataset_name, "train_split", cfg.train_split, got, need, fix)
    if cfg.num_test_batches == 0:
        return
    key, dataset = (
        ("eval_dataset_name", cfg.eval_dataset_name)
        if cfg.eval_dataset_name
        else ("dataset_name", cfg.dataset_name)
    )
    train_source = dataset_source(cfg.dataset_name, cfg.train_split)
    if dataset_source(dataset, cfg.eval_split) == train_source and not cfg.allow_eval_on_train_rows:
        raise ConfigError(
            f"{key}={dataset!r} (eval_split={cfg.eval_split!r}) holds the training rows (dataset_name="
            f"{cfg.dataset_name!r}, train_split={cfg.train_split!r}; a file has no splits): set "
            "eval_dataset_name=<held-out file or folder>, or allow_eval_on_train_rows=true to evaluate on "
            "training rows anyway (num_test_batches=0: no evaluation)"
        )
    if not _load_rows(key, dataset, cfg.eval_split, "eval_split"):
        fix = "pass a dataset with evaluation rows, or num_test_batches=0 for no evaluation"
        raise _too_few(key, dataset, "eval_split", cfg.eval_split, "0 rows", "1 question", fix)


def prepare_rows(
    tokenizer: Any,
    dataset: str,
    split: str,
    preset,
    max_prompt_length: int,
    limit: int = -1,
    *,
    need: tuple[str, str, int] = ("dataset_name", "split", 0),
) -> list[dict]:
    """Loads a split, renders and tokenizes its prompts (``row["prompt_ids"]``), drops over-long ones.

    Args:
      limit: keep the first ``limit`` rows after filtering (-1: all).
      need: ``(dataset key, split key, rows)``: refuse fewer rows than that after the length filter.

    Raises:
      ConfigError: fewer rows than ``need`` fit max_prefill_predict_length (the keys, counts and fix named).
    """
    rows = load_dataset_rows(dataset, split)
    texts = [render_prompt(tokenizer, row["question"], preset) for row in rows]
    ids = tokenize_prompts(tokenizer, texts)
    rows, ids, dropped = filter_by_length(rows, ids, max_prompt_length)
    log.info(
        "%s/%s: %d prompts (%d longer than max_prefill_predict_length=%d dropped)",
        dataset,
        split,
        len(rows),
        dropped,
        max_prompt_length,
    )
    key, split_key, count = need
    if len(rows) < count:
        got = f"{len(rows)} prompts of at most max_prefill_predict_length={max_prompt_length} tokens ({dropped} longer)"
        fix = "raise max_prefill_predict_length or pass a larger dataset"
        raise _too_few(key, dataset, split_key, split, got, f"the {count} needed", fix)
    for row, row_ids in zip(rows, ids, strict=True):
        row["prompt_ids"] = row_ids
    return rows if limit < 0 else rows[:limit]


def _mesh_context(mesh: jax.sharding.Mesh | None):
    """``jax.set_mesh(mesh)`` (activation sharding constraints apply inside), or nothing."""
    return jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()


def grpo_step(
    state: TrainState,
    ref_params: Any,
    prompts: list[list[int]],
    reward_fn: Callable[[GenerateOutput], dict[str, Any]],
    *,
    model_cfg: ModelConfig,
    sampler_cfg: SamplerConfig,
    grpo: GRPOConfig,
    train_step: Callable,
    num_micro_batches: int,
    key: jax.Array,
    mesh: jax.sharding.Mesh | None = None,
    rollout_mesh: jax.sharding.Mesh | None = None,
) -> tuple[TrainState, GenerateOutput, dict[str, np.ndarray], dict[str, float]]:
    """One GRPO iteration: rollout, rewards, advantages, reference logprobs, ``num_iterations`` updates.

    Args:
      state: the policy's TrainState (donated to ``train_step``).
      ref_params: the frozen reference params (a tree, or ``FrozenParams``), or None when beta == 0.
      prompts: P token-id lists; each is sampled G = ``grpo.num_generations`` times, rows grouped contiguously.
      reward_fn: ``GenerateOutput -> {name: [P * G] points}`` with a ``"total"`` entry (NaN = abstain).
      model_cfg, sampler_cfg, grpo: model, sampling and algorithm configs.
      train_step: from ``make_train_step``.
      num_micro_batches: gradient-accumulation blocks for the reference / old logprob passes.
      key: PRNG key of this step's sampling.
      mesh: the trainer's mesh (the batch is sharded over its data/fsdp axes); None = default placement.
      rollout_mesh: the sampler's mesh; when its layout differs from the trainer's the weights are resharded
        once per step (``time/reshard_s``), otherwise the sampler reads the trainer's arrays.

    Returns:
      (new state, the rollout, the reward dict as numpy arrays, host metrics: everything ``train_step``
      reports plus rewards per function, advantage stats, completion lengths, truncated fraction,
      ``time/{rollout,reference,train,step}_s`` and ``tokens_per_s``).
    """
    t_start = time.perf_counter()
    rollout_params, reshard_s = state.params, 0.0
    if mesh is not None and rollout_mesh is not None:
        rollout_params, reshard_s = sharding.reshard_for_rollout(state.params, mesh, rollout_mesh)
    with _mesh_context(rollout_mesh or mesh):
        out = generate(
            rollout_params, prompts, model_cfg, sampler_cfg, key, num_generations=grpo.num_generations
        )
    del rollout_params
    release_host_memory()
    t_rollout = time.perf_counter()
    scores = {name: np.asarray(values, np.float64) for name, values in reward_fn(out).items()}
    advantages = compute_advantages(
        scores["total"].astype(np.float32), grpo.num_generations, scale_rewards=grpo.scale_rewards
    )
    batch = {
        # one prompt row per group: the update and the reference pass run each prompt once
        "prompt_ids": jnp.asarray(out.prompt_ids[:: grpo.num_generations]),
        "prompt_mask": jnp.asarray(out.prompt_mask[:: grpo.num_generations]),
        "completion_ids": jnp.asarray(out.completion_ids),
        "completion_mask": jnp.asarray(out.completion_mask),
        "advantages": jnp.asarray(advantages, jnp.float32),
        "old_logprobs": jnp.asarray(out.logprobs),
        "truncated": jnp.asarray([r == "length" for r in out.finish_reason]),
    }
    if mesh is not None:
        # Every process holds the whole rollout and computed the same rewards: each keeps its devices' rows.
        batch = sharding.shard_global_batch(batch, mesh)
    t_scored = time.perf_counter()
    with _mesh_context(mesh):
        if ref_params is not None:
            reference = ref_params if isinstance(ref_params, FrozenParams) else FrozenParams(ref_params)
            batch["ref_logprobs"] = reference.apply(  # mapped from files on a CPU host, unmapped after
                compute_logprobs, batch, model_cfg, grpo.temperature, num_micro_batches
            )
            release_host_memory()
        if grpo.num_iterations > 1:
            batch["old_logprobs"] = compute_logprobs(
                state.params, batch, model_cfg, grpo.temperature, num_micro_batches
            )
        t_ref = time.perf_counter()
        for _ in range(grpo.num_iterations):
            state, step_metrics = train_step(state, batch)
    step_metrics = distributed.fetch(step_metrics)
    release_host_memory()
    t_train = time.perf_counter()

    mask = np.asarray(out.completion_mask)
    lengths = mask.sum(axis=1)
    metrics: dict[str, Any] = {k: float(v) for k, v in step_metrics.items() if np.ndim(v) == 0}
    metrics["nonfinite"] = bool(step_metrics.get("nonfinite", False))
    for name, values in scores.items():
        finite = values[np.isfinite(values)]
        metrics[f"rewards/{name}/mean"] = float(finite.mean()) if finite.size else math.nan
        metrics[f"rewards/{name}/std"] = float(finite.std()) if finite.size else math.nan
    metrics.update(
        {
            "advantages/mean": float(np.mean(advantages)),
            "advantages/std": float(np.std(advantages)),
            "advantages/abs_max": float(np.max(np.abs(advantages))),
            "completion_length/mean": float(lengths.mean()),
            "completion_length/max": float(lengths.max()),
            "truncated_fraction": float(np.mean([r == "length" for r in out.finish_reason])),
            "time/rollout_s": t_rollout - t_start,
            "time/reshard_s": reshard_s,
            "time/rewards_s": t_scored - t_rollout,
            "time/reference_s": t_ref - t_scored,
            "time/train_s": t_train - t_ref,
            "time/step_s": t_train - t_start,
            "tokens_per_s": float(mask.sum() + np.asarray(out.prompt_mask).sum()) / (t_train - t_start),
        }
    )
    return state, out, scores, metrics


def train(cfg: TrainConfig) -> dict:
    """Runs GRPO as configured; returns ``{"before": summary, "after": summary, "run_dir": str, ...}``.

    A summary is None where that evaluation did not run (num_test_batches=0, or eval_before=false for
    "before"); with both, ``paired`` holds their paired test (``grpax.rl.compare.compare``).

    The same ``run_name`` resumes from the latest checkpoint (changed keys are logged, recorded in
    ``config_changes.jsonl`` and ``config.json`` is rewritten); ``num_batches`` equal to that step evaluates the
    finished run again. ``results`` also holds ``actor_path``, ``reward_history`` (``rewards/total/mean`` of
    each logged step of the whole run) and, with ``export_hf``, ``hf_path``.

    Raises:
      ConfigError: invalid keys or paths (message names the key); a resume with ``num_batches`` below the
        latest checkpoint's step or a changed key of ``RESUME_FIXED_KEYS``; a run folder that another job
        holds or that is not a grpax run (``grpax.rl.run_folder``).
      NonFiniteError: NaN/inf loss or gradients (the last good checkpoint is kept).
    """
    validate(cfg)
    check_inputs(cfg)
    distributed.maybe_initialize(cfg.skip_jax_distributed_system)
    paths = RunPaths.of(cfg)
    main_process = jax.process_index() == 0
    if not main_process:  # one process logs; the others only warn
        logging.getLogger("grpax").setLevel(logging.WARNING)
    # Before anything in the run folder is read or written: another job may be writing it (run_folder.py).
    # The checkpointer and the metrics files are closed on any exit, a Ctrl-C included (closing waits for
    # Orbax's writes), before the folder is released.
    with claim_run_folder(paths.run_dir, main_process), contextlib.ExitStack() as closing:
        return _train(cfg, paths, main_process, closing)


def _train(cfg: TrainConfig, paths: RunPaths, main_process: bool, closing: contextlib.ExitStack) -> dict:
    """``train`` inside the claimed run folder; ``closing`` closes the checkpointer and metrics writer."""
    grpo = cfg.grpo()
    checkpointer = TrainCheckpointer(
        paths.checkpoints,
        cfg.max_num_checkpoints_to_keep,
        cfg.checkpoint_storage_use_zarr3,
        cfg.checkpoint_storage_use_ocdbt,
    )
    closing.callback(checkpointer.close)
    latest = checkpointer.latest_step()
    changes = check_resume(cfg, paths, latest) if latest is not None else {}
    if changes:
        log.warning(
            "resuming %s with changed keys (recorded in config_changes.jsonl once restored): %s",
            paths.run_dir,
            "; ".join(f"{key}: {old!r} -> {new!r}" for key, (old, new) in changes.items()),
        )

    params, model_cfg, tokenizer = load_model(
        cfg.load_parameters_path,
        scan_layers=cfg.scan_layers,
        weight_dtype=cfg.weight_dtype,
        dtype=cfg.dtype,
        remat_policy=cfg.remat_policy,
    )
    if cfg.model_name:
        check_matches(model_cfg, cfg.model_name, cfg.load_parameters_path)
    mesh_cfg = cfg.mesh()
    mesh = sharding.create_mesh(mesh_cfg)
    rollout_mesh = sharding.create_rollout_mesh(mesh_cfg)
    params = sharding.shard_params(params, model_cfg, mesh)
    log.info("trainer mesh %s, sampler mesh %s", dict(mesh.shape), dict(rollout_mesh.shape))
    ref_params = None
    if grpo.beta > 0:  # the state is donated: in device memory the reference is a copy
        folder = offload_folder(paths.run_dir)
        ref_params = FrozenParams(params if folder else jax.tree.map(jnp.copy, params), folder)
        closing.callback(ref_params.close)  # its files go on any exit (an interrupt ends with os._exit)

    preset = get_prompt_preset(cfg.prompt_preset)
    reward_config = get_reward_config(cfg.reward_preset)
    train_rows = prepare_rows(
        tokenizer,
        cfg.dataset_name,
        cfg.train_split,
        preset,
        cfg.max_prefill_predict_length,
        need=("dataset_name", "train_split", cfg.batch_size),
    )
    eval_limit = cfg.num_test_batches * cfg.eval_batch_size if cfg.num_test_batches >= 0 else -1
    evaluating = cfg.num_test_batches != 0
    eval_dataset = cfg.eval_dataset_name or cfg.dataset_name
    eval_rows = (
        prepare_rows(
            tokenizer,
            eval_dataset,
            cfg.eval_split,
            preset,
            cfg.max_prefill_predict_length,
            eval_limit,
            need=("eval_dataset_name" if cfg.eval_dataset_name else "dataset_name", "eval_split", 1),
        )
        if evaluating
        else []
    )
    # Every process reads the same prompts in the same order (docs/scaling.md, "Several processes").
    iterator = PromptIterator(train_rows, cfg.batch_size, seed=cfg.seed)

    stops = stop_token_ids(tokenizer, model_cfg)
    pad_id = model_cfg.pad_token_id if model_cfg.pad_token_id is not None else stops[0]
    sampler_cfg = SamplerConfig(
        max_prompt_length=cfg.max_prefill_predict_length,
        max_completion_length=cfg.max_completion_length,
        temperature=grpo.temperature,
        top_k=cfg.decode_sampling_top_k,
        top_p=cfg.decode_sampling_nucleus_p,
        greedy=False,
        stop_token_ids=stops,
        pad_token_id=pad_id,
    )
    eval_sampler_cfg = dataclasses.replace(sampler_cfg, **EVAL_STRATEGIES[cfg.eval_sampling_strategy])

    num_train_steps = cfg.num_batches * grpo.num_iterations
    optimizer, lr_schedule = optimizer_from_config(grpo, num_train_steps)
    state = TrainState(
        params=params,
        opt_state=sharding.init_optimizer_state(optimizer, params, mesh),
        step=jnp.zeros((), jnp.int32),
    )
    train_step = make_train_step(model_cfg, grpo, optimizer, cfg.micro_batches, lr_schedule)

    writer = MetricsWriter(paths.run_dir)
    closing.callback(writer.close)
    results: dict[str, Any] = {"run_dir": str(paths.run_dir), "before": None}
    start_step = 0
    if latest is not None:
        new_params, opt_state, meta = checkpointer.restore(latest, state.params, state.opt_state)
        state = TrainState(params=new_params, opt_state=opt_state, step=jnp.asarray(meta["optimizer_step"]))
        iterator.load_state_dict(meta["iterator"])
        start_step = meta["step"]
        results["before"] = meta.get("eval_before")
        # A finished run (start_step == num_batches) is evaluated again: its old "after" line goes too.
        writer.truncate_after(start_step, drop_eval_at_step=start_step == cfg.num_batches)
        if changes and main_process:
            record = {"step": start_step, "time": round(time.time(), 3), "changes": changes}
            with (paths.run_dir / "config_changes.jsonl").open("a") as f:
                f.write(json.dumps(record) + "\n")
            _write_config(paths, cfg)
        elif main_process and not (paths.run_dir / "config.json").exists():  # so later resumes can be checked
            _write_config(paths, cfg)
        log.info("resumed %s from step %d", paths.checkpoints, start_step)
    else:
        # A fresh start re-runs everything: lines of an attempt killed before its first checkpoint go.
        if stale := len(writer.records()):
            log.warning(
                "%s has no checkpoint: starting afresh, its %d metrics lines (and TensorBoard points) are dropped",
                paths.run_dir,
                stale,
            )
        writer.truncate_after(-1)
        if main_process:
            paths.run_dir.mkdir(parents=True, exist_ok=True)
            _write_config(paths, cfg)
        _write_model_files(paths.checkpoints, model_cfg, tokenizer)

    def run_eval(tag: str, step: int) -> dict:
        t0 = time.perf_counter()
        with _mesh_context(mesh):
            summary = evaluate(
                state.params,
                model_cfg,
                tokenizer,
                eval_rows,
                prompt_preset=preset,
                reward_config=reward_config,
                sampler_cfg=eval_sampler_cfg,
                batch_size=cfg.eval_batch_size,
                num_eval_passes=cfg.num_eval_passes,
                seed=cfg.seed,
                output_path=paths.eval_dir / tag,
                desc=f"eval {tag}",
            )
        release_host_memory()
        writer.write(step, {k: v for k, v in summary.items() if isinstance(v, (int, float))}, prefix="eval/")
        log.info(
            "eval %s (step %d, %.0f s): accuracy %.3f, format %.3f, mean reward %.3f over %d questions",
            tag,
            step,
            time.perf_counter() - t0,
            summary["accuracy"],
            summary["format_accuracy"],
            summary["mean_reward"],
            summary["num_questions"],
        )
        return summary

    if start_step == 0 and cfg.eval_before and evaluating:
        results["before"] = run_eval("before", 0)

    base_key = jax.random.key(cfg.seed)
    bar = tqdm(
        range(start_step, cfg.num_batches),
        initial=start_step,
        total=cfg.num_batches,
        desc="grpo",
        unit="step",
        disable=not main_process,
    )
    reward_history: list[float] = []

    def gsm8k_rewards(rows, out):
        completions = decode_completions(tokenizer, out.completion_ids, out.completion_mask)
        golds = [row["gold"] for row in rows for _ in range(grpo.num_generations)]
        questions = [row["question"] for row in rows for _ in range(grpo.num_generations)]
        return score_completions(
            questions, completions, golds, reward_config, response_prefix=preset.response_prefix
        )

    for step in bar:
        rows = next(iterator)
        prompts = [row["prompt_ids"] for row in rows]
        state, _, scores, metrics = grpo_step(
            state,
            ref_params,
            prompts,
            lambda out, rows=rows: gsm8k_rewards(rows, out),
            model_cfg=model_cfg,
            sampler_cfg=sampler_cfg,
            grpo=grpo,
            train_step=train_step,
            num_micro_batches=cfg.micro_batches,
            key=jax.random.fold_in(base_key, step),
            mesh=mesh,
            rollout_mesh=rollout_mesh,
        )
        if metrics["nonfinite"]:
            raise NonFiniteError(
                f"step {step + 1}: loss or gradients are NaN/inf (loss={metrics.get('loss')}); the update was "
                f"skipped and the last good checkpoint in {paths.checkpoints} is kept. Lower learning_rate or "
                "check the rewards."
            )
        if "answer_correct" in scores:
            metrics["accuracy"] = float(
                np.mean(np.asarray(scores["answer_correct"]) >= reward_config.answer_exact)
            )
        reward_history.append(metrics["rewards/total/mean"])
        if (step + 1) % cfg.log_period == 0 or step + 1 == cfg.num_batches:
            writer.write(step + 1, metrics)
        bar.set_postfix(
            reward=f"{metrics['rewards/total/mean']:.3f}",
            acc=f"{metrics.get('accuracy', 0):.2f}",
            kl=f"{metrics.get('kl', 0):.4f}",
            len=f"{metrics['completion_length/mean']:.0f}",
            s=f"{metrics['time/step_s']:.1f}",
        )

        done = step + 1
        if evaluating and cfg.eval_interval and done % cfg.eval_interval == 0 and done != cfg.num_batches:
            run_eval(f"step_{done}", done)
        if done % cfg.checkpoint_period == 0 or done == cfg.num_batches:
            meta = {
                "step": done,
                "optimizer_step": int(state.step),
                "iterator": iterator.state_dict(),
                "seed": cfg.seed,
                "eval_before": results.get("before"),
            }
            checkpointer.save(done, state.params, state.opt_state, meta)
            release_host_memory()  # the serialisation's buffers
    bar.close()
    final_step = cfg.num_batches
    results["after"] = run_eval("after", final_step) if evaluating else None
    results["actor_path"] = str(checkpointer.step_dir(final_step) / "model_params")
    if writer.enabled:  # the whole run's, not only this invocation's steps
        reward_history = [
            r["rewards/total/mean"]
            for r in writer.records()
            if "rewards/total/mean" in r and r["step"] <= final_step
        ]
    results["reward_history"] = reward_history
    checkpointer.close()
    writer.close()
    if not main_process:
        return results

    both = results["before"] and results["after"]
    results["paired"] = (
        compare_eval_folders(paths.eval_dir / "before", paths.eval_dir / "after") if both else None
    )

    def write_results() -> None:
        (paths.run_dir / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n")

    write_results()  # before the export, so that a failed export loses nothing
    if cfg.export_hf:
        summary = to_huggingface(results["actor_path"], cfg.export_hf)  # bfloat16, as grpax to_huggingface
        results["hf_path"] = summary["output_dir"]
        log.info("exported the step-%d actor to %s (Hugging Face format)", final_step, results["hf_path"])
        write_results()
    return results


def format_before_after(before: dict | None, after: dict | None, paired: dict | None = None) -> str:
    """The evaluation metrics before and after training, each with its 95% interval, and the paired test.

    Args:
      before, after: ``summarize`` dicts (None: that evaluation did not run).
      paired: ``grpax.rl.compare.compare`` of the two evaluations' records (None: no paired test). Its
        sign-test p-values fill the last column, and a final line names the proportions whose change
        (after - before) is larger than the noise (p < its alpha) and those within it.

    Returns:
      The table as text; one line when neither evaluation ran (num_test_batches=0).
    """
    if before is None and after is None:
        return "evaluation skipped (num_test_batches=0): no before/after metrics"
    keys = ["accuracy", "partial_accuracy", "format_accuracy", "mean_reward"]
    keys += [k for k in (after or before) if k.startswith(("pass@", "maj@")) and not k.endswith("ci95")]
    tests = (paired or {}).get("metrics", {})

    def cell(summary: dict | None, key: str) -> str:
        value, ci = (summary or {}).get(key), (summary or {}).get(f"{key}_ci95")
        if value is None:
            return f"{'-':>22}"
        return f"{value:.3f} [{ci[0]:.2f}, {ci[1]:.2f}]".rjust(22) if ci else f"{value:>22.3f}"

    lines = [f"{'metric':<18}{'before':>22}{'after':>24}{'change':>10}{'paired p':>10}"]
    for k in keys:
        change = f"{after[k] - before[k]:>+10.3f}" if before and after else f"{'-':>10}"
        p = f"{tests[k]['p_value']:>10.3g}" if k in tests else f"{'-':>10}"
        lines.append(f"{k:<18}{cell(before, k)}  {cell(after, k)}{change}{p}")
    count = lambda s: (s or {}).get("num_questions", "-")  # noqa: E731
    lines.append(f"{'questions':<18}{count(before):>22}  {count(after):>22}")
    if paired and tests:
        alpha = paired["alpha"]
        larger = [k for k, t in tests.items() if t["p_value"] < alpha]
        within = [k for k, t in tests.items() if t["p_value"] >= alpha]
        lines.append(
            f"change larger than the noise (exact sign test on the {paired['num_questions']} paired questions, "
            f"p < {alpha}): {', '.join(larger) or 'none'}; within the noise: {', '.join(within) or 'none'}"
        )
    elif after is None:
        lines.append("evaluation after training skipped (num_test_batches=0)")
    return "\n".join(lines)
