"""The GRPO training loop (``grpax train_rl``): rollout -> rewards -> advantages -> clipped update, repeated.

Each step takes ``batch_size`` prompts of the task (``grpax.tasks``: GSM8K by default, math, or the user's own
data and reward functions), samples ``num_generations`` (G) completions of each with the KV-cache sampler on the
trainer's own parameters (no copy; LoRA: the merged weights; ``max_staleness`` >= 1: a copy per version, sampled
ahead in ``grpax.rl.ahead``'s thread; ``environment``: multi-turn, ``grpax.rl.multi_turn``), scores them with the task's reward functions (DAPO's dynamic sampling and
overlong punishment optional, ``grpax.rl.dapo``), turns rewards into group-relative advantages, scores the
completions under the frozen reference model (when beta > 0) and, for on-policy distillation
(``distillation_coef`` > 0), under a frozen teacher (``grpax.rl.teacher``, ``grpax.rl.distill``), and applies
``num_iterations`` AdamW updates of the clipped GRPO objective (DeepSeekMath, Shao et al. 2024, eq. 3; DAPO and Dr. GRPO variants in ``grpax.rl.losses``). Evaluation runs before, every ``eval_interval``
steps and after. Checkpoints hold everything a bit-exact resume needs: params, optimizer state, step,
data-iterator position and RNG seed.

The step is ``batch = rollout(rows, key); state, metrics = update(state, batch)``: ``grpax.rl.rollout.Rollout``
samples, scores and builds the ``grpax.rl.batch.Batch``; ``grpax.rl.train_step.make_update`` applies it.
With ``lora_rank > 0`` the update trains LoRA adapters on the frozen base, which is also the reference
(``grpax.rl.policy``; with ``lora_base_dtype``, QLoRA: the base quantised, and the reference that quantised
base). The keys and their checks are in ``grpax.rl.train_config``, the run folder's resume bookkeeping in
``grpax.rl.resume``, what a finished run leaves (``results.json``, the export) in ``grpax.rl.results``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm.auto import tqdm

from grpax import distributed, interrupts, prng, sharding
from grpax.checkpoint.orbax import load_model
from grpax.checkpoint.train_state import TrainCheckpointer
from grpax.compiles import CompileLog
from grpax.data.iterator import PromptIterator
from grpax.data.prompts import prepare_rows
from grpax.data.token_cache import cache_folder
from grpax.data.tokenizer import stop_token_ids
from grpax.errors import ConfigError
from grpax.eval.evaluate import evaluate
from grpax.eval.keys import eval_sampling
from grpax.eval.metrics import EVAL_MODES
from grpax.models.llama import round_as_read
from grpax.models.registry import ModelConfig, check_matches
from grpax.rl.ahead import AheadRollouts
from grpax.rl.batch import Batch
from grpax.rl.config import GRPOConfig
from grpax.rl.metrics_writer import MetricsWriter
from grpax.rl.multi_turn import MultiTurnRollout
from grpax.rl.policy import Policy
from grpax.rl.profiling import StepProfiler
from grpax.rl.reference import FrozenParams, offload_folder, release_host_memory
from grpax.rl.results import publish, reward_history
from grpax.rl.resume import RunPaths, check_resume, restore_or_start, write_model_files
from grpax.rl.rollout import Rollout, task_scorer
from grpax.rl.run_folder import claim_run_folder
from grpax.rl.teacher import load_teacher
from grpax.rl.train_config import Inputs, TrainConfig, check_inputs, validate
from grpax.rl.train_step import TrainState, make_run_update, make_update
from grpax.sampler.keys import SamplerConfig
from grpax.sampler.multi_turn import prompt_renderer, trajectory_sampler
from grpax.sampler.paging import check_memory_fraction
from grpax.sampler.program_set import describe_programs, fixed_programs
from grpax.sharding import mesh_context
from grpax.tasks import RewardFunctionError, Task, build_task, environment_factory, multi_turn_config

log = logging.getLogger("grpax.train")


class NonFiniteError(ConfigError):
    """Loss, gradients or the updated weights became NaN/inf: nothing of that step is saved, the last good
    checkpoint is kept."""


def converted_base(cfg: TrainConfig) -> TrainConfig:
    """MaxText's ``convert_checkpoint_if_possible``: without ``load_parameters_path``, ``cfg`` reading
    ``base_output_directory/0/items``, where ``model_name`` is converted first (``grpax to_native``, in
    ``weight_dtype``) unless a conversion is there already; likewise a distillation teacher without
    ``teacher_parameters_path``: ``teacher_model_name`` converted into ``base_output_directory/teacher/0/items``.
    ``cfg`` itself otherwise.

    Called after ``validate``, which lets an empty ``load_parameters_path`` (``teacher_parameters_path``) through
    with this key.

    Raises:
      ConfigError: no ``model_name`` to convert, or the conversion's own errors (no network for the Hub, ...) in
        one line with the ``grpax to_native`` command that takes that error's keys.
    """
    if not cfg.convert_checkpoint_if_possible or cfg.compile_topology:
        return cfg
    base = Path(cfg.base_output_directory)
    if not cfg.load_parameters_path:
        if not cfg.model_name:
            raise ConfigError(
                "convert_checkpoint_if_possible=true without load_parameters_path needs model_name=<registered "
                "name> to convert (or pass load_parameters_path)"
            )
        cfg = dataclasses.replace(cfg, load_parameters_path=_converted(cfg, cfg.model_name, base, "load"))
    if cfg.distillation_coef > 0 and not cfg.teacher_parameters_path:  # validate: teacher_model_name is set
        items = _converted(cfg, cfg.teacher_model_name, base / "teacher", "teacher")
        cfg = dataclasses.replace(cfg, teacher_parameters_path=items)
    return cfg


def _converted(cfg: TrainConfig, model_name: str, base: Path, key: str) -> str:
    """``base/0/items``, ``model_name`` converted there first unless a conversion is there already; ``key``
    names the checkpoint key the fix passes (``load`` or ``teacher``)."""
    items = base / "0" / "items"
    if items.exists():
        return str(items)
    from grpax.checkpoint.convert import to_native  # noqa: PLC0415 - only for this key

    log.info("convert_checkpoint_if_possible: converting %s into %s", model_name, items)
    try:
        to_native(
            model_name=model_name,
            base_output_directory=str(base),
            hf_access_token=cfg.hf_access_token or None,
            weight_dtype=cfg.weight_dtype,
            scan_layers=cfg.scan_layers,
        )
    except (ConfigError, OSError, ValueError) as e:  # its fixes name to_native's keys (hf_model_path, ...)
        raise ConfigError(
            f"convert_checkpoint_if_possible=true: converting model_name={model_name} into {items} failed: {e} "
            f"(the keys named are grpax to_native's: convert with grpax to_native model_name={model_name} "
            f"base_output_directory={base} and them, then pass {key}_parameters_path={items})"
        ) from None
    return str(items)


def train(cfg: TrainConfig, fit: Callable[[TrainConfig], TrainConfig] | None = None) -> dict:
    """Runs GRPO as configured; returns ``{"before": summary, "after": summary, "run_dir": str, ...}``.

    ``fit``: the plan's check before any weight is read (``grpax.plan.memory_plan.fit_before_run``, which
    ``grpax train_rl`` passes): the run's keys with the auto ones chosen, or a ConfigError when the job cannot fit
    the devices. Without it the auto keys take their least-memory meaning (``TrainConfig.remat``) and nothing is
    compiled ahead.

    A summary is None where that evaluation did not run (num_test_batches=0, or eval_before=false for
    "before"); with both, ``paired`` holds their paired test (``grpax.eval.compare.compare``).

    The same ``run_name`` resumes from the latest checkpoint (changed keys are logged, recorded in
    ``config_changes.jsonl`` and ``config.json`` is rewritten); ``num_batches`` equal to that step evaluates the
    finished run again. ``results`` also holds ``actor_path`` (None with ``enable_checkpointing=false``),
    ``reward_history`` (``rewards/total/mean`` of each logged step of the whole run) and, with ``export_hf``,
    ``hf_path``.

    Raises:
      ConfigError: invalid keys or paths (message names the key); a resume with ``num_batches`` below the
        latest checkpoint's step or a changed key of ``RESUME_FIXED_KEYS``; a run folder that another job
        holds or that is not a grpax run (``grpax.rl.run_folder``).
      NonFiniteError: NaN/inf loss or gradients (the last good checkpoint is kept).
      RewardFunctionError: a user reward function raised or returned a bad value (before that step's update;
        the last checkpoint is kept).
    """
    with CompileLog() as programs:
        return _train_logged(cfg, fit, programs)


def _train_logged(cfg: TrainConfig, fit: Callable | None, programs: CompileLog) -> dict:
    """``train`` with its programs filed per phase in ``programs`` (``grpax.compiles``)."""
    validate(cfg)  # a bad key stops the run before a conversion's minutes of download, not after
    cfg = converted_base(cfg)
    task = build_task(cfg)
    inputs = check_inputs(cfg, task)
    distributed.maybe_initialize(cfg.skip_jax_distributed_system)
    check_memory_fraction(cfg.hbm_utilization_vllm)
    if cfg.max_staleness > 0 and jax.process_count() > 1:
        raise ConfigError(
            f"max_staleness={cfg.max_staleness} runs in single-process jobs only (two threads issuing collectives "
            "could interleave differently across processes and hang); use max_staleness=0 with several hosts"
        )
    if (
        fit is not None
    ):  # the auto keys chosen; an accelerator run that cannot fit stops before any weight is read
        with programs.phase("fit check"):
            cfg = fit(cfg)
        if inputs.model_cfg is not None:
            inputs = dataclasses.replace(
                inputs, model_cfg=dataclasses.replace(inputs.model_cfg, remat_policy=cfg.remat)
            )
    paths = RunPaths.of(cfg)
    main_process = jax.process_index() == 0
    if not main_process:  # one process logs; the others only warn
        logging.getLogger("grpax").setLevel(logging.WARNING)
    # Before anything in the run folder is read or written: another job may be writing it (run_folder.py).
    # The checkpointer and the metrics files are closed on any exit, a Ctrl-C included (closing waits for
    # Orbax's writes), before the folder is released.
    with claim_run_folder(paths.run_dir, main_process), contextlib.ExitStack() as closing:
        with programs.phase("load and save"):
            return _train(cfg, task, paths, main_process, closing, inputs, programs)


@dataclasses.dataclass
class _Run:
    """What the step loop and the evaluations of one ``train`` call read; built once in ``_train``."""

    cfg: TrainConfig
    grpo: GRPOConfig
    paths: RunPaths
    main_process: bool
    model_cfg: ModelConfig
    tokenizer: Any
    mesh: jax.sharding.Mesh
    rollout_mesh: jax.sharding.Mesh
    task: Task
    eval_rows: list[dict]
    sampler_cfg: SamplerConfig
    eval_sampler_cfg: SamplerConfig
    rollout: Rollout
    update: Callable  # (state, batch) -> (state, metrics): train_step.make_update
    policy: Policy  # the trained tree -> the sampler's params (LoRA: adapters on the frozen base)
    checkpointer: TrainCheckpointer
    writer: MetricsWriter
    mismatch_warned: bool = False  # the sampler/trainer mismatch alarm is given once per run
    ahead: AheadRollouts | None = None  # max_staleness >= 1: the rollout thread (``_loop`` starts it)
    programs: CompileLog = dataclasses.field(default_factory=CompileLog)  # the programs obtained, per phase

    @property
    def evaluating(self) -> bool:
        return self.cfg.num_test_batches != 0


def _train(
    cfg: TrainConfig,
    task: Task,
    paths: RunPaths,
    main_process: bool,
    closing: contextlib.ExitStack,
    inputs: Inputs,
    programs: CompileLog,
) -> dict:
    """``train`` inside the claimed run folder; ``closing`` closes the checkpointer and metrics writer."""
    grpo = cfg.grpo()
    checkpointer, changes = _open_checkpointer(cfg, paths, closing)
    params, model_cfg, tokenizer, mesh, rollout_mesh = _load_policy(cfg, inputs.model_cfg)
    policy = _policy(cfg, params, model_cfg, checkpointer)
    # LoRA: the reference is the frozen base itself (QLoRA: the quantised base the adapters train on).
    frozen = policy.lora is not None
    ref_params = _reference(cfg, policy.base if frozen else params, model_cfg, paths, closing, frozen=frozen)
    iterator, eval_rows = _load_rows(cfg, tokenizer, task, inputs)
    sampler_cfg, eval_sampler_cfg = _sampler_configs(cfg, grpo, tokenizer, model_cfg)
    trainable = policy.init_trainable(params, model_cfg, mesh, cfg.seed)
    del params  # LoRA: the policy holds the base
    options = _training_compile_options(cfg, model_cfg, mesh)
    state, train_step = _init_state(cfg, grpo, trainable, model_cfg, mesh, policy, options)
    teacher = None
    if inputs.teacher_cfg is not None:  # distillation_coef > 0: frozen, loaded once
        folder = offload_folder(paths.run_dir)
        teacher = load_teacher(
            cfg, inputs.teacher_cfg, mesh, folder and folder.with_name(".teacher"), closing
        )
    placement = dict(
        mesh=mesh,
        rollout_mesh=rollout_mesh,
        reference=ref_params,
        teacher=teacher,
        teacher_cfg=inputs.teacher_cfg,
        num_micro_batches=cfg.micro_batches,
        logprobs_options=options,
    )
    rollout = _rollout(cfg, grpo, model_cfg, sampler_cfg, task, tokenizer, placement)
    uses = {"rollout": (cfg.batch_size, cfg.num_generations)}
    if cfg.num_test_batches != 0:
        uses["evaluation"] = (cfg.eval_batch_size, cfg.num_eval_passes)
    fixed = fixed_programs(sampler_cfg, trainable)
    log.info("sampler programs, %s", describe_programs(sampler_cfg, fixed, uses))
    writer = MetricsWriter(paths.run_dir)
    closing.callback(writer.close)
    run = _Run(
        cfg=cfg,
        grpo=grpo,
        paths=paths,
        main_process=main_process,
        model_cfg=model_cfg,
        tokenizer=tokenizer,
        mesh=mesh,
        rollout_mesh=rollout_mesh,
        task=task,
        eval_rows=eval_rows,
        sampler_cfg=sampler_cfg,
        eval_sampler_cfg=eval_sampler_cfg,
        rollout=rollout,
        update=make_update(train_step, grpo.num_iterations),
        policy=policy,
        checkpointer=checkpointer,
        writer=writer,
        programs=programs,
    )
    fresh = checkpointer.latest_step() is None
    state, start_step, before = restore_or_start(
        cfg, paths, main_process, checkpointer, writer, state, iterator, changes
    )
    if fresh:
        write_model_files(paths.checkpoints, model_cfg, tokenizer)
    results: dict[str, Any] = {"run_dir": str(paths.run_dir), "before": before}
    if start_step == 0 and cfg.eval_before and run.evaluating:
        results["before"] = _evaluate(run, policy.sampler_params(state.params), "before", 0)
    state, history = _loop(run, state, iterator, start_step, results["before"])
    return _finish(run, state, history, results)


def _policy(cfg: TrainConfig, params: Any, model_cfg: ModelConfig, checkpointer: TrainCheckpointer) -> Policy:
    """What the run trains (all the weights, or LoRA adapters on ``params`` as the frozen base), refused in one
    line when the run folder's latest checkpoint was trained on another base or in another mode."""
    policy = Policy()
    if cfg.lora_rank:
        path = str(Path(cfg.load_parameters_path).absolute())
        policy = Policy(cfg.lora(), params, path, cfg.lora_base_dtype, cfg.lora_sampler, model_cfg)
    latest = checkpointer.latest_step()
    if latest is not None:  # before anything is restored: adapters on other base weights are refused
        policy.check_resume(checkpointer.check_meta(latest), str(checkpointer.step_dir(latest)))
    return policy


def _rollout(cfg, grpo, model_cfg, sampler_cfg, task, tokenizer, placement: dict) -> Rollout:
    """The run's ``Rollout``: single-turn, or with ``environment`` multi-turn (the same Batch, observation
    tokens masked out: ``grpax.rl.multi_turn``); ``placement``: its meshes, reference, distillation teacher and
    micro-batches."""
    if not cfg.environment:
        return Rollout(model_cfg, sampler_cfg, grpo, task_scorer(task, tokenizer), **placement)
    env, turns = environment_factory(cfg), multi_turn_config(cfg)
    return MultiTurnRollout(model_cfg, sampler_cfg, grpo, task, tokenizer, env, turns, **placement)


def _open_checkpointer(
    cfg: TrainConfig, paths: RunPaths, closing: contextlib.ExitStack
) -> tuple[TrainCheckpointer, dict[str, tuple[Any, Any]]]:
    """The run's checkpointer (closed on any exit), and the keys a resume changes (``check_resume``)."""
    checkpointer = TrainCheckpointer(
        paths.checkpoints,
        cfg.max_num_checkpoints_to_keep,
        cfg.checkpoint_storage_use_zarr3,
        cfg.checkpoint_storage_use_ocdbt,
        background=cfg.async_checkpointing,
    )
    closing.callback(checkpointer.close)
    if not cfg.enable_checkpointing:
        log.warning(
            "enable_checkpointing=false: no checkpoint will be saved in %s (the run cannot resume; the trained "
            "weights end with it)", paths.checkpoints,
        )  # fmt: skip
    latest = checkpointer.latest_step()
    changes = check_resume(cfg, paths, latest) if latest is not None else {}
    if changes:
        log.warning(
            "resuming %s with changed keys (recorded in config_changes.jsonl once restored): %s",
            paths.run_dir,
            "; ".join(f"{key}: {old!r} -> {new!r}" for key, (old, new) in changes.items()),
        )
    return checkpointer, changes


def _load_policy(cfg: TrainConfig, model_cfg: ModelConfig | None):
    """The policy's params sharded over the trainer's mesh, its config (``model_cfg``: read by
    ``check_inputs``), tokenizer, and both meshes."""
    params, model_cfg, tokenizer = load_model(cfg.load_parameters_path, model_cfg)
    if cfg.model_name:
        check_matches(model_cfg, cfg.model_name, cfg.load_parameters_path)
    mesh_cfg = cfg.mesh()
    mesh, rollout_mesh = sharding.create_meshes(mesh_cfg)
    params = sharding.shard_params(params, model_cfg, mesh)
    log.info("trainer mesh %s, sampler mesh %s", dict(mesh.shape), dict(rollout_mesh.shape))
    return params, model_cfg, tokenizer, mesh, rollout_mesh


def _reference(
    cfg: TrainConfig,
    params: Any,
    model_cfg: ModelConfig,
    paths: RunPaths,
    closing: contextlib.ExitStack,
    frozen: bool = False,
) -> Any:
    """The frozen reference (``FrozenParams``), or None when beta == 0. ``frozen``: ``params`` never change
    (LoRA's base): the reference is those very arrays, no copy. Otherwise a copy (the state is donated), rounded
    as the forward reads it with ``reference_dtype=compute`` (``round_as_read``: the same logprobs), in host
    memory with ``reference_memory=pinned_host``, else on the devices (a single CPU process: mapped files)."""
    if cfg.beta <= 0:
        return None
    if frozen:
        return FrozenParams(params)
    ref = round_as_read(params, model_cfg) if cfg.reference_dtype == "compute" else params
    folder = None if cfg.reference_on_host else offload_folder(paths.run_dir)
    if folder is None and not cfg.reference_on_host:  # on the devices: no leaf may be a donated one of params
        # a copy where it lives, no program (an eager jnp.copy compiled one per leaf shape: 8 on a TPU); its own
        # sharding named: without it device_put refuses an array of several processes (jax.distributed)
        ref = jax.tree.map(
            lambda r, p: jax.device_put(r, r.sharding, may_alias=False) if r is p else r, ref, params
        )
    ref_params = FrozenParams(ref, folder, host_memory=cfg.reference_on_host)
    closing.callback(ref_params.close)  # its files go on any exit (an interrupt ends with os._exit)
    return ref_params


def _load_rows(
    cfg: TrainConfig, tokenizer: Any, task: Task, inputs: Inputs
) -> tuple[PromptIterator, list[dict]]:
    """The training prompt iterator and the evaluation rows (none with num_test_batches=0), from the rows
    ``check_inputs`` read; with ``environment`` a prompt is measured as the environment renders it."""
    render = prompt_renderer(tokenizer, environment_factory(cfg), task.preset) if cfg.environment else None
    cache_dir = cache_folder(cfg.jax_cache_dir)
    (train_key, train_dataset), (eval_key, eval_dataset) = cfg.train_dataset(), cfg.eval_dataset()
    train_rows = prepare_rows(
        tokenizer,
        train_dataset,
        cfg.train_split,
        task.preset,
        cfg.max_prefill_predict_length,
        need=(train_key, "train_split", cfg.batch_size),
        load=lambda dataset, split: inputs.train_rows,
        render=render,
        cache_dir=cache_dir,
    )
    eval_limit = cfg.num_test_batches * cfg.eval_batch_size if cfg.num_test_batches >= 0 else -1
    eval_rows = (
        prepare_rows(
            tokenizer,
            eval_dataset,
            cfg.eval_split,
            task.preset,
            cfg.max_prefill_predict_length,
            eval_limit,
            need=(eval_key, "eval_split", 1),
            load=lambda dataset, split: inputs.eval_rows,
            render=render,
            cache_dir=cache_dir,
        )
        if cfg.num_test_batches != 0
        else []
    )
    # Every process reads the same prompts in the same order (docs/scaling.md, "Several processes").
    return PromptIterator(train_rows, cfg.batch_size, seed=cfg.seed), eval_rows


def _sampler_configs(
    cfg: TrainConfig, grpo: GRPOConfig, tokenizer: Any, model_cfg: ModelConfig
) -> tuple[SamplerConfig, SamplerConfig]:
    """The rollout sampler's config and the evaluation sampler's (``eval_sampling_strategy``)."""
    sampler_cfg = cfg.sampler_config(stop_token_ids(tokenizer, model_cfg), model_cfg.pad_token_id)
    return sampler_cfg, dataclasses.replace(sampler_cfg, **eval_sampling(cfg))


def _training_compile_options(cfg: TrainConfig, model_cfg: ModelConfig, mesh: jax.sharding.Mesh) -> tuple:
    """The update's and logprob passes' XLA options on ``mesh``'s devices (``training_compile_effort``), said in
    the log where they are not the compiler's defaults."""
    options = cfg.training_compile_options(model_cfg, mesh.devices.flat[0].platform, mesh.size)
    if options:
        why = "a short run on a TPU" if cfg.training_compile_effort == "auto" else "as set"
        log.info(
            "the update and the logprob passes compile with %s (training_compile_effort=%s: %s; "
            "training_compile_effort=full compiles them for speed)",
            ", ".join(f"{k}={v}" for k, v in options), cfg.training_compile_effort, why,
        )  # fmt: skip
    return options


def _init_state(
    cfg: TrainConfig,
    grpo: GRPOConfig,
    params: Any,
    model_cfg: ModelConfig,
    mesh: jax.sharding.Mesh,
    policy: Policy | None = None,
    compiler_options: tuple = (),
) -> tuple[TrainState, Callable]:
    """A fresh TrainState at step 0 (optimizer state sharded as the params) and the jitted update.

    ``params`` is what the optimizer trains: the weights, or with LoRA the float32 adapters (``policy``; None =
    the full fine-tune); ``compiler_options``: the update's (``TrainConfig.training_compile_options``)."""
    policy = Policy() if policy is None else policy
    optimizer, _, train_step = make_run_update(
        grpo,
        model_cfg,
        cfg.num_batches,
        cfg.micro_batches,
        cfg.max_completion_length,
        lora=policy.lora,
        base=policy.base,
        compiler_options=compiler_options,
    )
    state = TrainState(
        params=params,
        opt_state=sharding.init_optimizer_state(optimizer, params, mesh),
        # Placed as the update returns it: an unplaced step made the second update compile again.
        # From numpy: an eager jnp.zeros compiles a program of its own.
        step=jax.device_put(np.zeros((), np.int32), NamedSharding(mesh, P())),
    )
    return state, train_step


def _trajectories(run: _Run, sampler_cfg: SamplerConfig):
    """The multi-turn sampler of evaluations with ``environment`` (the training environment), or None."""
    if not run.cfg.environment:
        return None
    env, turns = environment_factory(run.cfg), multi_turn_config(run.cfg)
    return trajectory_sampler(run.task, run.tokenizer, env, run.model_cfg, sampler_cfg, turns)


def _evaluate(run: _Run, params: Any, tag: str, step: int) -> dict:
    """Evaluates ``params`` into ``eval/<tag>``, writes its ``eval/`` metrics at ``step`` and logs them."""
    cfg = run.cfg
    t0 = time.perf_counter()
    with mesh_context(run.mesh), run.programs.phase(f"eval {tag}"):
        summary = evaluate(
            params,
            run.model_cfg,
            run.tokenizer,
            run.eval_rows,
            task=run.task,
            sampler_cfg=run.eval_sampler_cfg,
            batch_size=cfg.eval_batch_size,
            num_eval_passes=cfg.num_eval_passes,
            eval_mode=cfg.eval_mode,
            seed=cfg.seed,
            output_path=run.paths.eval_dir / tag,
            desc=f"eval {tag}",
            trajectories=_trajectories(run, run.eval_sampler_cfg),
        )
    release_host_memory()
    run.writer.write(step, {k: v for k, v in summary.items() if isinstance(v, (int, float))}, prefix="eval/")
    log.info(
        "eval %s (step %d, %.0f s): score %.3f (eval_mode=%s: %s), accuracy %.3f, format %.3f, mean reward %.3f "
        "over %d questions",
        tag,
        step,
        time.perf_counter() - t0,
        summary["score"],
        cfg.eval_mode,
        EVAL_MODES[cfg.eval_mode],
        summary["accuracy"],
        summary["format_accuracy"],
        summary["mean_reward"],
        summary["num_questions"],
    )
    return summary


def _loop(
    run: _Run, state: TrainState, iterator: PromptIterator, start_step: int, before: dict | None
) -> tuple[TrainState, list[float]]:
    """Steps ``start_step`` .. ``num_batches``: update, log, evaluate and checkpoint on their periods.

    Returns:
      The final state and ``rewards/total/mean`` of each step this call ran.
    """
    cfg = run.cfg
    base_key = prng.key(cfg.seed)
    bar = tqdm(
        range(start_step, cfg.num_batches),
        initial=start_step,
        total=cfg.num_batches,
        desc="grpo",
        unit="step",
        disable=not run.main_process,
    )
    history: list[float] = []
    if run.grpo.max_staleness > 0:
        run.ahead = AheadRollouts(
            run.rollout,
            iterator,
            lambda step: prng.fold_in(base_key, step),
            run.grpo.max_staleness,
            start_step,
            cfg.num_batches,
        )
        run.ahead.publish(state.params, start_step, run.policy.sampler_params)
    profile = StepProfiler(
        cfg.profiler, run.paths.run_dir / "tensorboard", start_step, cfg.skip_first_n_steps_for_profiler,
        cfg.profiler_steps, cfg.num_batches,
    )  # fmt: skip
    with contextlib.ExitStack() as stop_thread:
        if run.ahead is not None:
            stop_thread.callback(run.ahead.close)
        stop_thread.callback(profile.close)
        for step in bar:
            profile.before(step)
            with run.programs.phase(f"step {step + 1}"):
                state, metrics = _one_step(run, state, iterator, step, prng.fold_in(base_key, step))
            metrics.update(compile_metrics(run.programs, f"step {step + 1}"))
            profile.after(step, state)
            _after_step(run, state, iterator, step, metrics, bar, history, before)
    bar.close()
    return state, history


def _after_step(
    run: _Run,
    state: TrainState,
    iterator: PromptIterator,
    step: int,
    metrics: dict[str, Any],
    bar: Any,
    history: list[float],
    before: dict | None,
) -> None:
    """Logs, evaluates and checkpoints after ``step`` as their periods say."""
    cfg = run.cfg
    interrupts.raise_pending()  # a Ctrl-C whose exception was lost mid-step: this step is not recorded
    history.append(metrics["rewards/total/mean"])
    done = step + 1
    if done % cfg.log_period == 0 or done == cfg.num_batches:
        run.writer.write(done, metrics)
    bar.set_postfix(
        reward=f"{metrics['rewards/total/mean']:.3f}",
        acc=f"{metrics.get('accuracy', 0):.2f}",
        kl=f"{metrics.get('kl', 0):.4f}",
        len=f"{metrics['completion_length/mean']:.0f}",
        s=f"{metrics['time/step_s']:.1f}",
    )
    if run.evaluating and cfg.eval_interval and done % cfg.eval_interval == 0 and done != cfg.num_batches:
        _evaluate(run, run.policy.sampler_params(state.params), f"step_{done}", done)
    if cfg.enable_checkpointing and (done % cfg.checkpoint_period == 0 or done == cfg.num_batches):
        _save(run, state, iterator, done, before)


def _one_step(
    run: _Run, state: TrainState, iterator: PromptIterator, step: int, key: jax.Array
) -> tuple[TrainState, dict[str, Any]]:
    """One GRPO step: ``batch = rollout(rows, key); state, metrics = update(state, batch)``.

    Raises:
      NonFiniteError: the update's loss, gradients or updated weights are NaN/inf (nothing is saved).
      RewardFunctionError: a user reward function misbehaved; no update was applied.
    """
    t_start = time.perf_counter()
    try:
        batch = _next_batch(run, state, iterator, step, key)
    except RewardFunctionError as e:
        raise RewardFunctionError(
            f"step {step + 1}: {e}; no update was applied and the last checkpoint in {run.paths.checkpoints} "
            "is kept: fix the function and run the same command again to resume"
        ) from None
    t_update = time.perf_counter()
    with mesh_context(run.mesh):
        state, update_metrics = run.update(state, batch)
    if run.ahead is not None:  # before the next update donates these params
        run.ahead.publish(state.params, step + 1, run.policy.sampler_params)
    release_host_memory()
    t_end = time.perf_counter()
    metrics = step_metrics(
        batch, update_metrics, {"time/train_s": t_end - t_update, "time/step_s": t_end - t_start}
    )
    metrics["staleness"] = float(step - batch.host.policy_version)  # updates between sampling and training
    if run.ahead is not None:
        metrics["time/rollout_wait_s"] = t_update - t_start  # the rollout's time the update did not hide
    if metrics["nonfinite"] or metrics["nonfinite_params"]:
        _stop_non_finite(run, metrics, step)
    if not run.mismatch_warned:
        platform = run.mesh.devices.flat[0].platform
        run.mismatch_warned = warn_on_mismatch(metrics, run.model_cfg.dtype, run.sampler_cfg, platform)
    return state, metrics


def _next_batch(run: _Run, state: TrainState, iterator: PromptIterator, step: int, key: jax.Array) -> Batch:
    """``step``'s batch: sampled now with ``state.params``, or (max_staleness >= 1) the rollout thread's."""
    if run.ahead is not None:
        return run.ahead.get(step)
    run.rollout.update_params(run.policy.sampler_params(state.params), step)
    batch = run.rollout(next(iterator), key, extra_rows=iterator)
    if run.policy.lora is not None:  # the merged weights go before the update runs
        run.rollout.update_params(None, step)
    return batch


def _stop_non_finite(run: _Run, metrics: dict[str, Any], step: int) -> None:
    """Raises the one-line NonFiniteError of a step whose loss, gradients or updated weights are NaN/inf."""
    latest = run.checkpointer.latest_step()
    kept = (
        f"the last checkpoint {run.checkpointer.step_dir(latest)} (step {latest}) is kept"
        if latest is not None
        else "no checkpoint had been written yet"
    )
    what = (
        f"loss or gradients are NaN/inf (loss={metrics.get('loss')}); the update was skipped"
        if metrics["nonfinite"]
        else "the update made weights NaN/inf"
    )
    again = (
        "run the same command to resume"
        if run.cfg.enable_checkpointing
        else "run again (enable_checkpointing=false: it starts over)"
    )
    raise NonFiniteError(
        f"step {step + 1}: {what} and nothing of this step was saved; {kept}. Lower learning_rate or check "
        f"the rewards, then {again}"
    )


# Mean |sampler - trainer logprob| (nats per token) above which a run warns: in float32 the two agree to ~1e-5;
# bfloat16 compute differs by ~0.03 on SmolLM2 from the order of operations alone (docs/algorithm.md).
MISMATCH_ALARM = {"float32": 1e-2, "bfloat16": 0.1, "float16": 0.1}
# XLA's default precision of the float32 matmuls on a TPU: one bfloat16 pass (JAX's precision "default"; the
# README's job on a v5e: 0.0122 nats per token between its sampler's and trainer's programs, docs/benchmarks.md).
_ONE_BFLOAT16_PASS = (None, "default", "bfloat16", "fastest")


def matmul_dtype(dtype: str, platform: str) -> str:
    """The dtype the compute ``dtype``'s matmuls round to on ``platform``: bfloat16 for float32 on a TPU at
    JAX's default matmul precision (``jax_default_matmul_precision``), else ``dtype``."""
    if (
        dtype == "float32"
        and platform == "tpu"
        and jax.config.jax_default_matmul_precision in _ONE_BFLOAT16_PASS
    ):
        return "bfloat16"
    return dtype


def warn_on_mismatch(
    metrics: dict[str, Any], dtype: str, sampler_cfg: SamplerConfig, platform: str = "cpu"
) -> bool:
    """Warns (one line; returns True) when the sampler's logprobs are further from the trainer's than
    ``MISMATCH_ALARM`` allows for the dtype the compute ``dtype``'s matmuls round to on ``platform``
    (``matmul_dtype``), naming the likely causes."""
    diff = metrics.get("mismatch/logprob_diff_mean", 0.0)
    rounded = matmul_dtype(dtype, platform)
    limit = MISMATCH_ALARM.get(rounded, 0.1)
    if not diff > limit:
        return False
    causes = ["a sampler that computes another distribution (a miscompiled decode, wrong cache or weights)"]
    if sampler_cfg.top_k or sampler_cfg.top_p < 1.0:
        causes.insert(0, "the top-k / top-p filter (the sampler's logprobs are of the filtered distribution)")
    if rounded != "float32":
        tells = "dtype=float32" + (" and JAX_DEFAULT_MATMUL_PRECISION=highest" if platform == "tpu" else "")
        causes.append(f"{rounded} rounding ({tells} tells)")
    if rounded != dtype:
        dtype = f"{dtype}, whose matmuls take one {rounded} pass on a {platform.upper()}"
    log.warning(
        "the sampler's logprobs differ from the trainer's by %.3g nats per token on average (max %.3g; alarm "
        "above %g for dtype=%s): likely %s; the GRPO ratio and KL assume they agree (metrics mismatch/*)",
        diff,
        metrics.get("mismatch/logprob_diff_max", float("nan")),
        limit,
        dtype,
        "; or ".join(causes),
    )
    return True


def _save(run: _Run, state: TrainState, iterator: PromptIterator, done: int, before: dict | None) -> None:
    """Checkpoints step ``done``: params, optimizer state and what a bit-exact resume needs."""
    meta = {
        "step": done,
        "optimizer_step": int(state.step),
        # with rollouts ahead, the position after the last trained batch: those in flight are sampled again
        "iterator": run.ahead.position if run.ahead is not None else iterator.state_dict(),
        "seed": run.cfg.seed,
        "eval_before": before,
        **run.policy.meta(),
    }
    run.checkpointer.save(done, state.params, state.opt_state, meta)
    release_host_memory()  # the serialisation's buffers


def _finish(run: _Run, state: TrainState, history: list[float], results: dict[str, Any]) -> dict[str, Any]:
    """The evaluation after training, the results (``grpax.rl.results.publish`` on the main process)."""
    final_step = run.cfg.num_batches
    results["after"] = (
        _evaluate(run, run.policy.sampler_params(state.params), "after", final_step)
        if run.evaluating
        else None
    )
    run.checkpointer.wait()  # the last step's write, beside the evaluation until here
    saved = run.cfg.enable_checkpointing or run.checkpointer.latest_step() == final_step
    results["actor_path"] = str(run.checkpointer.step_dir(final_step) / "model_params") if saved else None
    results["reward_history"] = reward_history(run.writer, final_step, history)  # the whole run's
    results["compiles"] = run.programs.summary()
    log.info(
        "programs obtained per phase (compiled, or read from the persistent cache):\n%s", run.programs.table()
    )
    run.checkpointer.close()
    run.writer.close()
    if run.main_process:
        publish(
            results, run.paths.run_dir, run.paths.eval_dir, run.cfg.export_hf, final_step, run.task.is_correct
        )
    return results


def compile_metrics(programs: CompileLog, phase: str) -> dict[str, float]:
    """A phase's ``compile/programs`` (obtained), ``compile/compiled`` (by the backend, not read from the cache)
    and ``compile/seconds``: from step 2 on, a run of the fixed program set compiles nothing."""
    row = programs.summary().get(phase, {"programs": 0, "compiled": 0, "seconds": 0.0})
    return {f"compile/{k}": float(row[k]) for k in ("programs", "compiled", "seconds")}


def step_metrics(batch: Batch, update_metrics: dict[str, Any], times: dict[str, float]) -> dict[str, Any]:
    """One step's metrics: the update's scalars (``nonfinite`` flags as bools), the rollout's host metrics
    (``RolloutInfo.summary``), ``times`` (``time/train_s``, ``time/step_s``) and ``tokens_per_s`` (completion
    tokens plus prompt tokens, each prompt counted once per completion as the sampler attends to it)."""
    metrics: dict[str, Any] = {k: float(v) for k, v in update_metrics.items() if np.ndim(v) == 0}
    for flag in ("nonfinite", "nonfinite_params"):
        metrics[flag] = bool(update_metrics.get(flag, False))
    info = batch.host
    metrics.update(info.summary())
    metrics.update(times)
    tokens = int(info.completion_lengths.sum()) + info.prompt_tokens
    metrics["tokens_per_s"] = float(tokens) / times["time/step_s"]
    return metrics
