"""The keys of ``grpax train_rl`` (``TrainConfig``) and their checks, made before any model is loaded.

``validate`` checks the values (the GRPO keys are checked by ``GRPOConfig`` itself, the evaluation keys by
``grpax.eval.keys``); ``check_inputs`` reads the datasets the run needs, so that no run trains and then fails.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, ClassVar

import jax

from grpax import sharding
from grpax.compiles import effort_options
from grpax.config import ConfigError, SamplingKeys, check_engine_keys, field, read_model_config
from grpax.data.datasets import dataset_files, too_few_rows
from grpax.errors import suggest
from grpax.eval.keys import EvalKeys, validate_eval_keys
from grpax.models.lora import LoraConfig, check_rank
from grpax.models.quantize import QUANT_DTYPES, require_qwix
from grpax.models.registry import ModelConfig
from grpax.rl.config import GRPOConfig
from grpax.rl.maxtext_keys import MAXTEXT_RL_KEYS
from grpax.rl.policy import LORA_SAMPLERS
from grpax.rl.profiling import PROFILERS
from grpax.rl.remat_keys import RematKeys, check_remat_keys
from grpax.rl.teacher import read_teacher, validate_teacher_keys
from grpax.sampler.keys import SamplerConfig, sampler_config
from grpax.tasks import Task, TaskConfig, validate_task_keys

log = logging.getLogger("grpax.train")

# remat_policy's values from the least recompute (and the most memory) to the most: auto's order of preference.
REMAT_ORDER = ("none", "minimal", "dots", "full")
REFERENCE_DTYPES = ("compute", "weight")
REFERENCE_MEMORIES = ("auto", "device", "pinned_host")
TRAINING_COMPILE_EFFORTS = ("auto", "full", "low")
# A short run (training_compile_effort=auto): its updates' work, 6 x params x tokens of every update (Kaplan et
# al. 2020's count), under this many FLOPs per chip: seconds of a TPU's time, less than the compile saved.
SHORT_RUN_FLOPS = 1e15
# XLA's effort on run time halved (``grpax.compiles.effort_options``; a JAX without it: no option). On one TPU
# v5e (qwen3-0.6b's update, docs/benchmarks.md): -0.5 compiles in 8.7 s instead of 23.8 and runs 1.5x longer;
# -1 compiles in 8.1 s and runs 2.4x longer.
LOW_EFFORT_OPTIONS = effort_options(-0.5)


@dataclasses.dataclass(frozen=True)
class TrainConfig(GRPOConfig, EvalKeys, TaskConfig, sharding.MeshConfig, SamplingKeys, RematKeys):
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
        "lora.lora_rank": "lora_rank",  # MaxText's SFT LoRA (lora.enable_lora is lora_rank > 0 here)
        "lora.lora_alpha": "lora_alpha",
        "lora.lora_weight_qtype": "lora_base_dtype",  # MaxText's QLoRA (its lora_tile_size is fixed here)
        "train_micro_batch_size": "micro_batch_size",  # Tunix's prompts per micro-batch of the update
        "profiler_start_invocation": "skip_first_n_steps_for_profiler",  # rl.profiler_*: Tunix's spelling
        "profiler_num_invocations": "profiler_steps",
        "off_policy_steps": "max_staleness",  # rl.off_policy_steps: Tunix's agentic learner's staleness
    }
    FOREIGN_KEYS: ClassVar[dict] = MAXTEXT_RL_KEYS  # MaxText keys without a field here: no-ops, or refused

    model_name: str = field(
        "smollm2-135m-Instruct",
        "registered model name: picks the model preset, checked against the checkpoint; '' = no preset",
    )
    load_parameters_path: str = field(
        "",
        "converted checkpoint <base>/0/items (from grpax to_native) or an actor "
        "checkpoint .../actor/<step>/model_params",
    )
    convert_checkpoint_if_possible: bool = field(
        False,
        "MaxText key: without load_parameters_path, train from base_output_directory/0/items, converting model_name "
        "there first (grpax to_native; the Hub with hf_access_token) when it is not there yet; one host. A "
        "distillation teacher without teacher_parameters_path: teacher_model_name in base_output_directory/teacher",
    )
    hf_access_token: str = field("", "Hugging Face token for convert_checkpoint_if_possible's download")
    base_output_directory: str = field("outputs", "root folder of all runs")
    run_name: str = field("grpo", "run folder under base_output_directory; the same name resumes the run")
    weight_dtype: str = field(
        "float32",
        "params' storage dtype (float32 | bfloat16 | float16): float32 = the params are the master weights AdamW "
        "updates (12 bytes/param with m and v); a 16-bit dtype keeps a float32 master copy in the optimizer "
        "state (14 bytes/param; the reference and the sampler read the 16-bit copy); docs/algorithm.md, Dtypes; a "
        "resumed run cannot change it",
    )
    reference_dtype: str = field(
        "compute",
        "the frozen reference's copy (beta > 0, full fine-tune): compute = rounded to dtype as the forward reads "
        "every weight (the same reference logprobs bit for bit; float32 weights, bfloat16 compute: half the "
        "memory), weight = as stored (weight_dtype)",
    )
    reference_memory: str = field(
        "auto",
        "where the frozen reference's copy lives: device | pinned_host (host memory, copied to the devices for "
        "each reference pass: its bytes over the host link every step) | auto (device, unless the memory plan "
        "fits with a 10% margin only with it in host memory; device on CPU)",
    )
    teacher_parameters_path: str = field(
        "",
        "on-policy distillation's teacher (distillation_coef > 0): a native checkpoint as load_parameters_path "
        "(<base>/0/items from grpax to_native, or an actor's model_params), frozen, loaded once; of the student's "
        "vocabulary and tokenizer",
    )
    teacher_model_name: str = field(
        "", "the teacher's registered model name, checked against its checkpoint; '' = model_name"
    )
    teacher_memory: str = field(
        "auto",
        "where the distillation teacher's params live: device | pinned_host (host memory, copied to the devices "
        "for each teacher pass: its bytes over the host link every step) | auto (device, unless the memory plan "
        "fits with a 10% margin only with it, after the reference, in host memory; device on CPU)",
    )
    remat_policy: str = field(
        "auto",
        "rematerialisation of each layer in the backward pass: auto | none | minimal | dots | full | custom (full: "
        "the least memory, and on CPU also the fastest; auto: on CPU full, on an accelerator the one with the "
        "least recompute, in that order, that the memory plan fits with a 10% margin, full if the fit check "
        "refuses it; custom: MaxText's, the named activations kept as decoder_layer_input, query_proj, ... say)",
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
    hf_train_files: str = field(
        "",
        "the training rows' files (MaxText key), read instead of dataset_name's train_split: a path or glob of "
        ".jsonl / .parquet files, or hf://datasets/<owner>/<name>/<glob> (the datasets library, online)",
    )
    hf_eval_files: str = field(
        "", "the evaluation rows' files, as hf_train_files, read instead of the eval dataset's eval_split"
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
    eval_batch_size: int = field(
        16, "questions per evaluation batch; -1 = batch_size (MaxText rl.yml's default)"
    )
    eval_interval: int = field(0, "evaluate every N steps (0: only before and after)")
    eval_before: bool = field(True, "evaluate before the first step")
    max_prefill_predict_length: int = field(256, "max prompt tokens; longer prompts are dropped (counted)")
    max_target_length: int = field(512, "max prompt + completion tokens")
    decode_sampling_top_k: int = field(
        0,
        "top-k of rollout sampling (0 = off, the unbiased default: the GRPO ratio and KL treat the samples as "
        "draws from the unfiltered softmax; a filter biases them by -log(kept mass))",
    )
    decode_sampling_nucleus_p: float = field(
        1.0, "top-p of rollout sampling (1.0 = off; any other value biases as top-k)"
    )
    decode_retire_rows: bool = field(
        True,
        "when no sequence waits for a decode slot, decode the running ones on the fewest slots that hold them "
        "(a ladder of slot counts); the same rollout as false, with less decode work on idle slots",
    )
    seed: int = field(42, "seed of data order, sampling and init (MaxText data_shuffle_seed)")
    checkpoint_period: int = field(10, "save a checkpoint every N steps (and at the end)")
    enable_checkpointing: bool = field(
        True,
        "MaxText's: false saves no checkpoint at all (no resume point, no step folder: the trained weights "
        "end with the run; export_hf refused); a checkpoint already in the run folder is still resumed",
    )
    async_checkpointing: bool = field(
        False,
        "MaxText's (its default is true): write each checkpoint's files in a background thread while training "
        "goes on (the arrays are first copied to host memory, the state's size again until the write ends); the "
        "next save and the run's end wait for it, and a failed write stops the run naming its step. Off by "
        "default: on a TPU the README's job gained nothing, the write slowing the next rollout as much as it "
        "saved (docs/benchmarks.md); worth it where a write takes minutes",
    )
    max_num_checkpoints_to_keep: int = field(3, "step checkpoints kept")
    checkpoint_storage_use_zarr3: bool = field(True, "Orbax zarr3 storage")
    checkpoint_storage_use_ocdbt: bool = field(True, "Orbax OCDBT storage")
    log_period: int = field(1, "write metrics every N steps")
    profiler: str = field(
        "",
        "'' = off; xplane: a JAX profiler trace of profiler_steps training steps into <run>/tensorboard/plugins/"
        "profile (TensorBoard's profile plugin, Perfetto) (MaxText key; its nsys: run under nsys profile instead)",
    )
    skip_first_n_steps_for_profiler: int = field(1, "steps this run executes before the trace (they compile)")
    profiler_steps: int = field(5, "steps traced")
    export_hf: str = field(
        "", "after training, also export the actor to this new folder in Hugging Face format (bfloat16)"
    )
    compile_topology: str = field(
        "",
        "compile the whole job for this TPU slice (v6e-8, v5e-8, v5p-8, v6e:2x4, ...; needs the tpu extra, no "
        "TPU, no weights; h200-1, h100-8, a100-N: an estimate) and print its per-chip memory instead of training "
        "(with lora_rank: the base, adapters, their optimizer state, no reference copy); exit 1 if it does not fit",
    )
    compile_topology_num_slices: int = field(1, "slices of compile_topology joined over DCN (multislice)")
    check_fit: bool = field(
        True,
        "on an accelerator, compile the job first and stop if it cannot fit in device memory (the run's first "
        "update then reads that program from the jax_cache_dir cache)",
    )
    training_compile_effort: str = field(
        "auto",
        "XLA's effort on the update's and the logprob passes' run time (the sampler's programs always get the "
        "compiler's default): full = the default; low = exec_time_optimization_effort -0.5 (on a TPU the update "
        "compiles 2-3x faster and runs 1.5-2x longer, docs/benchmarks.md); auto = low on a TPU for a short run "
        "(its updates under 1 PFLOP per chip, e.g. the README's job), else full",
    )
    lora_rank: int = field(
        0,
        "r: rank of the LoRA adapters trained on a frozen base that is also the reference (0 = full fine-tune)",
    )
    lora_alpha: float = field(8.0, "alpha: LoRA scale numerator, scale = alpha / r (PEFT lora_alpha)")
    lora_target_modules: tuple[str, ...] = field(
        ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
        "PEFT module names adapted in every layer (q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj)",
    )
    use_rslora: bool = field(False, "rank-stabilised LoRA: scale = alpha / sqrt(r) (PEFT use_rslora)")
    lora_base_dtype: str = field(
        "",
        "QLoRA: the frozen base's projection weights held as int8 (per-channel scales) or nf4 (blocks of 64), "
        "dequantised in the matmul; the reference is then this quantised base; needs lora_rank > 0, and int8 "
        "needs qwix (pip install 'grpax[qlora]'); unset = the base in weight_dtype",
    )
    lora_sampler: str = field(
        "auto",
        "what the LoRA rollout decodes: merged (W + s A B built per rollout, a whole copy of the weights; the "
        "base's decode speed, any backend), adapters (the base and its adapters, nothing copied, the XLA "
        "backend), or auto: merged on CPU computing in float32, else adapters (a merged sampler in a 16-bit dtype "
        "rounds away most of a young adapter's update)",
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

    def model_keys(self) -> dict:
        """``ModelKeys.model_keys`` and ``remat_policy`` (``remat``: auto read as full until the plan chooses)."""
        return {**super().model_keys(), "remat_policy": self.remat, "remat_names": self.remat_names()}

    @property
    def remat(self) -> str:
        """``remat_policy`` as the model takes it: ``auto`` before ``grpax.plan.memory_plan`` resolves it is full
        (the least memory)."""
        return "full" if self.remat_policy == "auto" else self.remat_policy

    @property
    def reference_on_host(self) -> bool:
        """The frozen reference's copy lives in host memory (``reference_memory=pinned_host``; auto before
        ``grpax.plan.memory_plan`` resolves it is the devices)."""
        return self.reference_memory == "pinned_host"

    @property
    def teacher_on_host(self) -> bool:
        """The distillation teacher's params live in host memory (``teacher_memory=pinned_host``; auto before
        ``grpax.plan.memory_plan`` resolves it is the devices)."""
        return self.teacher_memory == "pinned_host"

    def lora(self) -> LoraConfig | None:
        """The adapters' config, or None for a full fine-tune (lora_rank=0)."""
        if self.lora_rank == 0:
            return None
        return LoraConfig(self.lora_rank, self.lora_alpha, self.lora_target_modules, self.use_rslora)

    def __post_init__(self):
        if self.eval_batch_size == -1:  # MaxText rl.yml's default: the training batch_size
            object.__setattr__(self, "eval_batch_size", self.batch_size)
        super().__post_init__()

    def train_dataset(self) -> tuple[str, str]:
        """(the key that names the training rows, its value): hf_train_files when set, else dataset_name."""
        return (
            ("hf_train_files", self.hf_train_files)
            if self.hf_train_files
            else ("dataset_name", self.dataset_name)
        )

    def eval_dataset(self) -> tuple[str, str]:
        """(the key that names the evaluation rows, its value): hf_eval_files, eval_dataset_name or
        dataset_name, the first set."""
        for key in ("hf_eval_files", "eval_dataset_name"):
            if getattr(self, key):
                return key, getattr(self, key)
        return "dataset_name", self.dataset_name

    def training_compile_options(
        self, model_cfg: ModelConfig, platform: str, num_chips: int
    ) -> tuple[tuple[str, float], ...]:
        """The compile options of the update and the logprob passes (``training_compile_effort``), for a run on
        ``num_chips`` devices of ``platform``: ``LOW_EFFORT_OPTIONS``, or () for the compiler's defaults."""
        effort = self.training_compile_effort
        if effort == "auto":
            tokens = self.batch_size * self.num_generations * self.max_target_length
            flops = 6 * model_cfg.num_params() * tokens * self.num_batches * self.num_iterations / num_chips
            effort = "low" if platform == "tpu" and flops < SHORT_RUN_FLOPS else "full"
        return () if effort == "full" else LOW_EFFORT_OPTIONS

    def grpo(self) -> GRPOConfig:
        return GRPOConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(GRPOConfig)})

    def mesh(self) -> sharding.MeshConfig:
        return sharding.MeshConfig(
            **{f.name: getattr(self, f.name) for f in dataclasses.fields(sharding.MeshConfig)}
        )

    def sampler_config(self, stop_token_ids: tuple[int, ...], pad_token_id: int | None) -> SamplerConfig:
        """The rollout sampler's config (``pad_token_id``: the model's; None: ``grpax.sampler.keys``'s)."""
        return sampler_config(
            self.max_prefill_predict_length,
            self.max_completion_length,
            stop_token_ids,
            pad_token_id,
            temperature=self.temperature,
            top_k=self.decode_sampling_top_k,
            top_p=self.decode_sampling_nucleus_p,
            greedy=False,
            retire_rows=self.decode_retire_rows,
            record_routes=self.router_replay != "none",
            prefill_group=self.num_generations,  # the evaluation's prefills run the rollout's program
            **self.engine_keys(),
        )


def _validate_profiler(cfg: TrainConfig) -> None:
    if cfg.profiler not in PROFILERS:
        hint = ": run the command under `nsys profile` instead" if cfg.profiler == "nsys" else ""
        raise ConfigError(f"profiler={cfg.profiler!r}: expected '' (off) or xplane{hint}")
    if cfg.skip_first_n_steps_for_profiler < 0 or cfg.profiler_steps < 1:
        raise ConfigError(
            f"skip_first_n_steps_for_profiler={cfg.skip_first_n_steps_for_profiler} and profiler_steps="
            f"{cfg.profiler_steps}: expected >= 0 steps skipped and >= 1 traced"
        )


def validate(cfg: TrainConfig) -> None:
    """Raises ConfigError naming the key for settings that cannot work (each key's own range here; LoRA's,
    the choices', the evaluation and export's and the micro-batches' in the checks below)."""
    if not cfg.load_parameters_path and not cfg.compile_topology and not cfg.convert_checkpoint_if_possible:
        raise ConfigError(
            "load_parameters_path is required: convert a model first with "
            "`grpax to_native ... base_output_directory=DIR` and pass DIR/0/items (or convert_checkpoint_if_possible="
            "true: model_name converted into base_output_directory)"
        )
    name = cfg.run_name
    if not name or name in (".", "..") or "/" in name or "\\" in name or name != name.strip():
        raise ConfigError(
            f"run_name={name!r}: expected one folder name inside base_output_directory (no '/', not '..' or "
            "empty); put the path in base_output_directory, e.g. base_output_directory=outputs/exp run_name=grpo1"
        )
    if cfg.max_completion_length < 1:
        raise ConfigError(
            f"max_target_length={cfg.max_target_length} must exceed "
            f"max_prefill_predict_length={cfg.max_prefill_predict_length}"
        )
    check_remat_keys(cfg, cfg.remat_policy)
    groups = (("num_generations", cfg.num_generations), ("num_eval_passes", cfg.num_eval_passes))
    check_engine_keys(cfg, cfg.max_target_length, "max_target_length", groups)
    if cfg.overlong_buffer_length > cfg.max_completion_length:
        raise ConfigError(
            f"overlong_buffer_length={cfg.overlong_buffer_length} exceeds max_completion_length="
            f"{cfg.max_completion_length} (max_target_length - max_prefill_predict_length): lower it"
        )
    if cfg.environment and (cfg.filter_zero_std_groups or cfg.overlong_buffer_length):
        raise ConfigError(
            f"environment={cfg.environment!r} runs multi-turn rollouts, which do not support "
            "filter_zero_std_groups or overlong_buffer_length yet: drop those keys"
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
    _validate_profiler(cfg)
    if cfg.decode_sampling_top_k < 0:
        raise ConfigError(
            f"decode_sampling_top_k={cfg.decode_sampling_top_k}: expected >= 0 tokens (0 = off)"
        )
    if not 0 < cfg.decode_sampling_nucleus_p <= 1:  # NaN too
        raise ConfigError(
            f"decode_sampling_nucleus_p={cfg.decode_sampling_nucleus_p}: expected a mass in (0, 1] (1 = off)"
        )
    _validate_lora(cfg)
    validate_teacher_keys(cfg)
    _validate_choices(cfg)
    _warn_on_biased_choices(cfg)
    validate_eval_keys(cfg, allow_no_eval=True)
    validate_task_keys(cfg)
    _validate_eval_and_export(cfg)
    _validate_micro_batches(cfg)


def _validate_lora(cfg: TrainConfig) -> None:
    """lora_rank, lora_alpha, the LoRA-only keys without lora_rank, the target modules and lora_base_dtype."""
    if cfg.lora_rank < 0:
        raise ConfigError(
            f"lora_rank={cfg.lora_rank}: expected >= 0 (0 = full fine-tune, else the adapters' rank)"
        )
    if cfg.lora_rank and not cfg.lora_alpha > 0:
        raise ConfigError(f"lora_alpha={cfg.lora_alpha}: expected > 0 (scale = lora_alpha / lora_rank)")
    if not cfg.lora_rank:
        defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
        lora_only = ("lora_alpha", "lora_target_modules", "use_rslora", "lora_sampler")
        shown = {k: list(v) if isinstance(v, tuple) else v for k in lora_only for v in [getattr(cfg, k)]}
        given = [f"{k}={shown[k]!r}" for k in lora_only if getattr(cfg, k) != defaults[k]]
        if given:
            raise ConfigError(
                f"{', '.join(given)} shape{'s' if len(given) == 1 else ''} LoRA adapters, but lora_rank=0 trains "
                "all the weights (the full fine-tune): set lora_rank > 0 (e.g. lora_rank=16) or drop "
                f"{'it' if len(given) == 1 else 'them'}"
            )
    cfg.lora()  # the target modules' names
    if cfg.lora_base_dtype:
        if cfg.lora_base_dtype not in QUANT_DTYPES:
            raise ConfigError(
                f"lora_base_dtype={cfg.lora_base_dtype!r}: expected {' or '.join(QUANT_DTYPES)} (QLoRA's quantised "
                "base), or unset for the base in weight_dtype"
            )
        if not cfg.lora_rank:
            raise ConfigError(
                f"lora_base_dtype={cfg.lora_base_dtype} quantises the frozen base under LoRA adapters, but "
                "lora_rank=0 trains all the weights: set lora_rank > 0 (e.g. lora_rank=16) or drop lora_base_dtype"
            )
        if cfg.lora_base_dtype == "int8":  # nf4 is grpax's own (grpax.models.quantize)
            require_qwix()


def _validate_choices(cfg: TrainConfig) -> None:
    """remat_policy, reference_dtype, reference_memory, teacher_memory, training_compile_effort and lora_sampler
    name one of their choices."""
    choices = {
        "remat_policy": ("auto", *REMAT_ORDER, "custom"),
        "reference_dtype": REFERENCE_DTYPES,
        "reference_memory": REFERENCE_MEMORIES,
        "teacher_memory": REFERENCE_MEMORIES,
        "training_compile_effort": TRAINING_COMPILE_EFFORTS,
    }
    for key, allowed in choices.items():
        if getattr(cfg, key) not in allowed:
            raise ConfigError(
                f"{key}={getattr(cfg, key)!r}: expected one of {', '.join(allowed)}"
                f".{suggest(str(getattr(cfg, key)), allowed)}"
            )
    if cfg.lora_sampler not in LORA_SAMPLERS:
        raise ConfigError(
            f"lora_sampler={cfg.lora_sampler!r}: expected {', '.join(LORA_SAMPLERS)} (what a LoRA rollout decodes)"
        )


def _validate_eval_and_export(cfg: TrainConfig) -> None:
    """eval_interval >= 0; export_hf single-process and a new or empty folder."""
    if cfg.eval_interval < 0:
        raise ConfigError(
            f"eval_interval={cfg.eval_interval}: expected >= 0 (0 = evaluate only before and after training)"
        )
    if cfg.export_hf and jax.process_count() > 1:
        raise ConfigError(
            f"export_hf={cfg.export_hf!r} runs in single-process jobs only (the export restores the checkpoint on "
            "one process); export a multi-process run afterwards with grpax to_huggingface"
        )
    if cfg.export_hf and not cfg.enable_checkpointing:
        raise ConfigError(
            f"export_hf={cfg.export_hf!r} exports the final checkpoint, but enable_checkpointing=false saves none: "
            "drop enable_checkpointing=false, or export_hf"
        )
    export = Path(cfg.export_hf) if cfg.export_hf else None
    if export is not None and export.exists() and (not export.is_dir() or any(export.iterdir())):
        raise ConfigError(
            f"export_hf={cfg.export_hf!r} already exists and is not an empty folder; the export never "
            "overwrites: delete it or choose another folder"
        )


def _validate_micro_batches(cfg: TrainConfig) -> None:
    """micro_batch_size divides batch_size; num_micro_batches divides the step's rows."""
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


def _warn_on_biased_choices(cfg: TrainConfig) -> None:
    """One line for settings that run but train a biased objective (docs/algorithm.md says why)."""
    filters = [f"decode_sampling_top_k={cfg.decode_sampling_top_k}"] if cfg.decode_sampling_top_k else []
    if cfg.decode_sampling_nucleus_p < 1:
        filters.append(f"decode_sampling_nucleus_p={cfg.decode_sampling_nucleus_p}")
    if filters and cfg.temperature >= 1:
        log.warning(
            "%s with temperature=%s: rollouts come from the filtered distribution, but the GRPO ratio and KL "
            "score them under the unfiltered one (a bias of -log(kept mass) per token, largest at high "
            "temperature; logged as mismatch/*): set decode_sampling_top_k=0 decode_sampling_nucleus_p=1 for "
            "unbiased rollouts",
            " and ".join(filters),
            cfg.temperature,
        )
    if cfg.adv_estimator == "rloo" and cfg.scale_rewards != "none":
        log.warning(
            "adv_estimator=rloo with scale_rewards=%s divides the leave-one-out advantage by a std: it is GRPO's "
            "advantage times G/(G-1); set scale_rewards=none for RLOO as TRL and verl define it",
            cfg.scale_rewards,
        )
    if cfg.importance_sampling_level == "sequence" and cfg.loss_agg_mode == "token-mean":
        log.warning(
            "importance_sampling_level=sequence (GSPO) with loss_agg_mode=token-mean weights each sequence's "
            "single ratio by its length (GSPO averages per sequence): set "
            "loss_agg_mode=sequence-mean-token-mean"
        )


def _sources(key: str, dataset: str, split: str) -> set[str]:
    """What ``read_rows(dataset, split)`` reads, as a set: its resolved files (a glob's each), or the Hub name and
    split; ``dataset_files``' errors naming the key (they are raised again when the rows are read)."""
    try:
        files = dataset_files(dataset, split)
    except FileNotFoundError as e:
        raise ConfigError(f"{key}={dataset!r}: {e}") from None
    return {str(f.resolve()) for f in files} if files else {f"hub:{dataset}:{split}"}


def _check_held_out(cfg: TrainConfig, train: tuple[str, str], evaluation: tuple[str, str]) -> None:
    """Refuses evaluation rows read from a file the training rows are read from too (two globs may share some),
    unless allow_eval_on_train_rows."""
    (train_key, train_dataset), (key, dataset) = train, evaluation
    train_sources = _sources(train_key, train_dataset, cfg.train_split)
    eval_sources = _sources(key, dataset, cfg.eval_split)
    shared = eval_sources & train_sources
    if not shared or cfg.allow_eval_on_train_rows:
        return
    which = (
        "the training rows"
        if shared == eval_sources
        else f"training rows (both read {', '.join(sorted(Path(s).name for s in shared))})"
    )
    raise ConfigError(
        f"{key}={dataset!r} (eval_split={cfg.eval_split!r}) holds {which} ({train_key}={train_dataset!r}, "
        f"train_split={cfg.train_split!r}; a file has no splits): set "
        f"{'hf_eval_files' if key == 'hf_eval_files' else 'eval_dataset_name'}=<held-out file or folder>, or "
        "allow_eval_on_train_rows=true to evaluate on training rows anyway (num_test_batches=0: no evaluation)"
    )


def _load_rows(task: Task, key: str, dataset: str, split: str, split_key: str) -> list[dict]:
    """``task.load_rows`` with its errors naming the key that chose the dataset."""
    try:
        return task.load_rows(dataset, split)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"{key}={dataset!r} ({split_key}={split!r}): {e}") from None


@dataclasses.dataclass(frozen=True)
class Inputs:
    """What ``check_inputs`` read, for the run to use instead of reading it again.

    Attributes:
      model_cfg: the checkpoint's model with the run's dtype, layout and attention keys, from its config.json
        (None: no config.json at or above load_parameters_path; the load says so).
      train_rows: the training split's rows (``task.load_rows``).
      eval_rows: the evaluation split's rows; [] with num_test_batches=0.
      teacher_cfg: the distillation teacher's model (``grpax.rl.teacher.read_teacher``), or None.
    """

    model_cfg: ModelConfig | None
    train_rows: list[dict]
    eval_rows: list[dict]
    teacher_cfg: ModelConfig | None = None


def check_router_replay(cfg: TrainConfig, model_cfg: ModelConfig | None, source: Any) -> None:
    """Refuses ``router_replay`` other than none where no routing is recorded: a dense model (its config.json
    ``source``) or a multi-turn run (its sampler does not record routing).

    Raises:
      ConfigError: one line naming the key and the fix.
    """
    if cfg.router_replay == "none":
        return
    if model_cfg is not None and not model_cfg.num_experts:
        raise ConfigError(
            f"router_replay={cfg.router_replay}: {source} is a dense {model_cfg.family} model, with no router to "
            "record or replay; pass router_replay=none"
        )
    if cfg.environment:
        raise ConfigError(
            f"router_replay={cfg.router_replay}: the multi-turn rollout (environment={cfg.environment}) does not "
            "record routing; pass router_replay=none"
        )


def check_inputs(cfg: TrainConfig, task: Task) -> Inputs:
    """Reads the checkpoint's config.json and the rows the run needs with ``task`` before any model loads: no
    run trains and then fails; the run takes what was read from the returned ``Inputs``.

    Raises:
      ConfigError: a dataset that cannot be read, fewer training rows than batch_size, an empty evaluation
        split, evaluation on the training rows without eval_dataset_name or allow_eval_on_train_rows, or a
        distillation teacher of another vocabulary or tokenizer than the student's.
    """
    what = f"max_target_length={cfg.max_target_length}"
    model_cfg, source = read_model_config(cfg.load_parameters_path, cfg, cfg.max_target_length, what)
    lora = cfg.lora()
    if lora is not None and model_cfg is not None:
        check_rank(lora, model_cfg, str(source))
    check_router_replay(cfg, model_cfg, source)
    teacher_cfg = read_teacher(cfg, model_cfg, source)
    train_key, train_dataset = cfg.train_dataset()
    rows = _load_rows(task, train_key, train_dataset, cfg.train_split, "train_split")
    if len(rows) < cfg.batch_size:
        fix = "lower batch_size or pass a larger dataset"
        got, need = f"{len(rows)} rows", f"batch_size={cfg.batch_size} (prompts per step)"
        raise too_few_rows(train_key, train_dataset, "train_split", cfg.train_split, got, need, fix)
    if cfg.num_test_batches == 0:
        return Inputs(model_cfg, rows, [], teacher_cfg)
    key, dataset = cfg.eval_dataset()
    _check_held_out(cfg, (train_key, train_dataset), (key, dataset))
    eval_rows = _load_rows(task, key, dataset, cfg.eval_split, "eval_split")
    if not eval_rows:
        fix = "pass a dataset with evaluation rows, or num_test_batches=0 for no evaluation"
        raise too_few_rows(key, dataset, "eval_split", cfg.eval_split, "0 rows", "1 question", fix)
    return Inputs(model_cfg, rows, eval_rows, teacher_cfg)
