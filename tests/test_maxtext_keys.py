"""MaxText's RL keys on grpax train_rl: a real MaxText command line runs unchanged (each key honoured, or a
no-op for a stack grpax does not run, with a note), or stops at once naming grpax's key; MaxText's reward values
change the GSM8K rewards."""

import json
import logging

import pytest

from grpax.cli.main import main
from grpax.config import ConfigError, build_config
from grpax.rl.train_config import TrainConfig, validate
from grpax.tasks import build_task

# The keys of MaxText's run_qwen3_30b_rl.sh (src/maxtext/trainers/post_train/rl/scripts), paths replaced; its
# model (an MoE on 64 chips) and dataset names are left out.
QWEN3_30B = """async_scheduling=True chips_per_vm=8 num_batches=500 num_test_batches=10 rl.num_generations=8
rl.grpo_beta=0.05 rl.grpo_epsilon=0.2 gradient_clipping_threshold=1.0 decode_sampling_temperature=0.8
decode_sampling_top_k=50 decode_sampling_nucleus_p=0.95 hf_train_files=data/train_1M-*.parquet
train_split=train_1M eval_mode=pass_at_1 num_eval_passes=4 max_target_length=8192
max_prefill_predict_length=512 learning_rate=1e-6 batch_size=128 train_micro_batch_size=32
rollout_micro_batch_size=128 rollout_data_parallelism=16 rollout_tensor_parallelism=4 enable_dp_attention=True
hbm_utilization_vllm=0.75 max_num_seqs=256 max_num_batched_tokens=8192 scan_layers=True
allow_split_physical_axes=True enable_tunix_perf_metrics=True checkpoint_period=2 max_num_checkpoints_to_keep=1000
enable_checkpointing=true profiler=xplane rl.profiler_start_invocation=5 rl.profiler_num_invocations=2
vllm_hf_overrides={architectures:[MaxTextForCausalLM]} vllm_additional_config={}""".split()


def test_maxtexts_qwen3_30b_command_line_parses_and_each_key_lands(caplog):
    with caplog.at_level(logging.INFO, logger="grpax.config"):
        cfg = build_config(TrainConfig, ["model_name=", "load_parameters_path=ckpt", *QWEN3_30B])
    honoured = dict(
        num_generations=8, beta=0.05, epsilon=0.2, max_grad_norm=1.0, temperature=0.8, decode_sampling_top_k=50,
        decode_sampling_nucleus_p=0.95, num_eval_passes=4, max_target_length=8192, max_prefill_predict_length=512,
        learning_rate=1e-6, batch_size=128, micro_batch_size=32, rollout_data_parallelism=16,
        rollout_tensor_parallelism=4, hbm_utilization_vllm=0.75, max_num_seqs=256, allow_split_physical_axes=True,
        checkpoint_period=2, max_num_checkpoints_to_keep=1000, profiler="xplane", skip_first_n_steps_for_profiler=5,
        profiler_steps=2, num_batches=500, num_test_batches=10, hf_train_files="data/train_1M-*.parquet",
        train_split="train_1M", eval_mode="pass_at_1",
    )  # fmt: skip
    assert {key: getattr(cfg, key) for key in honoured} == honoured
    sc = cfg.sampler_config((2,), 0)
    assert (sc.max_num_seqs, sc.hbm_utilization) == (256, 0.75)
    noted = {r.getMessage().split("=")[0] for r in caplog.records if r.getMessage().endswith("; ignored")}
    assert noted == {
        "async_scheduling", "rollout_micro_batch_size", "enable_dp_attention", "max_num_batched_tokens",
        "enable_tunix_perf_metrics", "vllm_hf_overrides", "vllm_additional_config",
    }  # fmt: skip
    # honoured (tests/test_trainer.py: false saves nothing)
    assert build_config(TrainConfig, ["enable_checkpointing=false"]).enable_checkpointing is False


@pytest.mark.parametrize(
    "arg, fix",
    [
        ("trainer_devices_fraction=0.5", "pass rollout_devices=<devices for the sampler> instead"),
        ("sampler_devices_fraction=0.25", "pass rollout_devices=<devices for the sampler> instead"),
        ("num_epoch=2", "grpax trains num_batches steps (the data repeats): pass num_batches"),
        (
            "loss_algo=gspo-token",
            "pass importance_sampling_level=sequence loss_agg_mode=sequence-mean-token-mean",
        ),
        ("reasoning_start_token=<think>", "for other tags write your own prompt (prompt_template_path=)"),
        ("chat_template_path=my_template.json", "for another prompt pass prompt_template_path="),
        ("stop_strings=[###]", "an environment's stop strings end a tool call (environment=)"),
        ("train_fraction=0.8", "choose the splits"),
        ("rollout_enable_single_controller=true", "grpax runs one controller per host (jax.distributed)"),
        ("use_agentic_rollout=true", "grpax overlaps rollouts with the update by max_staleness=1"),
        (
            "reasoning_start_token_in_prompt=true",
            "pass prompt_template_path= with response_prefix: '<reasoning>'",
        ),
        ("dataset_processor_path=process.py", "pass prompt_field= and answer_field="),
        ("data_template_path=my_template.json", "for another prompt pass prompt_template_path="),
        ("debug_converter=true", "export with grpax to_huggingface and load the folder in vLLM"),
    ],
)
def test_maxtext_keys_grpax_does_otherwise_are_refused_naming_its_key(arg, fix, capsys):
    with pytest.raises(ConfigError, match=rf"^{arg.split('=')[0]}=.* \(the command line\): .*") as err:
        build_config(TrainConfig, [arg])
    assert fix in str(err.value) and "\n" not in str(err.value)
    assert main(["train_rl", "load_parameters_path=ckpt", arg]) == 2
    assert fix in capsys.readouterr().err


@pytest.mark.parametrize(
    "arg",
    [
        "trainer_devices_fraction=1.0", "num_epoch=1", "loss_algo=grpo", "reasoning_start_token=<reasoning>",
        "solution_end_token=</answer>", "chat_template_path=maxtext/examples/chat_templates/gsm8k_rl.json",
        "stop_strings=null", "train_fraction=1.0", "test_batch_start_index=0", "num_trainer_slices=-1",
        "debug.rl=True", "kv_cache_buffer=256", "swap_space_vllm_gb=2", "num_epoch=1.0", "train_fraction=1",
        "rl.use_agentic_rollout=false", "rl.max_concurrency=256", "rl.reshard_chunk_size=420",
        "math_verify_timeout=120", "math_verify_num_procs=null", "reasoning_start_token_in_prompt=false",
        "data_template_path=maxtext/examples/chat_templates/gsm8k_rl.json", "dataset_processor_path=",
        "vllm_load_format=dummy", "debug_converter=false", "gcs_debug_path=", "max_num_seqs=null",
        "logical_axis_rules=[[activation_batch,[data,fsdp]]]",
    ],
)  # fmt: skip
def test_maxtext_keys_at_what_grpax_does_anyway_are_accepted(arg):
    assert build_config(TrainConfig, [arg]) == build_config(TrainConfig, [])


def test_maxtexts_rl_yml_blocks_load_from_a_user_yaml(tmp_path):
    """A YAML holding MaxText rl.yml's inference, reward and tag blocks (and debug: {rl: true}) loads; the
    reward values reach the GSM8K rewards."""
    (tmp_path / "rl.yml").write_text(
        "debug:\n  rl: True\nkv_cache_buffer: 256\nhbm_utilization_vllm: 0.72\nswap_space_vllm_gb: 2\n"
        "async_scheduling: True\nmax_num_batched_tokens: null\nstop_strings: null\n"
        "reward_exact_format_match: 3.0\nreward_white_space_format_match: 1.5\nreward_partial_format_match: 0.5\n"
        "reward_ratio_guess_to_answer_high: 0.5\nreward_ratio_guess_to_answer_low: 0.25\n"
        "penalty_incorrect_format: -0.5\npenalty_incorrect_answer: -1.0\nreasoning_start_token: '<reasoning>'\n"
        "reasoning_end_token: '</reasoning>'\nsolution_start_token: '<answer>'\nsolution_end_token: '</answer>'\n"
        "chat_template_path: 'maxtext/examples/chat_templates/gsm8k_rl.json'\n"
    )
    cfg = build_config(TrainConfig, [f"config={tmp_path / 'rl.yml'}", "reward_preset=smollm2_demo"])
    assert cfg.hbm_utilization_vllm == 0.72 and cfg.penalty_incorrect_answer == -1.0
    rewards = build_task(cfg).reward_config
    # MaxText's values replace smollm2_demo's (format_exact 1.0, answer_exact 2.0, answer_wrong 0.0, ...)
    assert (rewards.format_exact, rewards.answer_exact, rewards.answer_whitespace) == (3.0, 3.0, 1.5)
    assert (rewards.format_tag_present, rewards.format_tag_penalty, rewards.answer_unparseable) == (
        0.5,
        -0.5,
        -0.5,
    )
    assert (rewards.answer_ratio_high, rewards.answer_ratio_low, rewards.answer_wrong) == (0.5, 0.25, -1.0)


def test_maxtexts_reward_values_change_the_points(tmp_path):
    """Hand-scored: a well-formed wrong answer, a well-formed right one, and a tagless answer, under
    reward_preset=smollm2_demo with three of MaxText's values set (the prompt pre-fills <reasoning>)."""
    rows = [{"question": "q", "gold": "2"}] * 3
    completions = [
        "I think</reasoning>\n<answer>5</answer>",
        "so</reasoning>\n<answer>2</answer>",
        "no tags 2",
    ]
    keys = ["load_parameters_path=x", "reward_preset=smollm2_demo"]
    base = build_task(build_config(TrainConfig, keys)).score(rows, completions)
    set_ = ["reward_exact_format_match=7", "penalty_incorrect_answer=-2", "penalty_incorrect_format=-0.75"]
    scores = build_task(build_config(TrainConfig, [*keys, *set_])).score(rows, completions)
    assert base["format_exact"] == [1.0, 1.0, 0.0] and scores["format_exact"] == [7.0, 7.0, 0.0]
    assert base["answer_correct"] == [0.0, 2.0, 0.0] and scores["answer_correct"] == [0.0, 7.0, 0.0]
    assert base["answer_close"] == [0.0, 0.0, 0.0] and scores["answer_close"] == [-2.0, 0.0, 0.0]
    # the tagless answer: <reasoning> (pre-filled) once = 0.25, three tags missing = 3 x -0.75
    assert scores["format_approximate"] == [1.0, 1.0, 0.25 - 3 * 0.75]
    assert scores["total"] == [7.0 + 1.0 - 2.0, 7.0 + 1.0 + 7.0 + 0.5, -2.0 + 0.5]


@pytest.mark.parametrize(
    "args, message",
    [
        (["task=math", "penalty_incorrect_answer=-2"], "the built-in GSM8K rewards' points, not task=math's"),
        (
            ["reward_functions_path=r.py", "reward_functions=[f]", "reward_exact_format_match=2"],
            "reward_functions_path=r.py replaces the built-in GSM8K rewards these points are for: drop one",
        ),
        (
            ["penalty_incorrect_format=nan"],
            "penalty_incorrect_format=nan: expected a finite number of points",
        ),
    ],
)
def test_reward_values_that_would_not_be_read_are_refused(args, message, capsys):
    assert main(["train_rl", "load_parameters_path=ckpt", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_a_profiler_that_cannot_start_says_so(tmp_path, caplog):
    from grpax.rl.profiling import StepProfiler

    with caplog.at_level(logging.WARNING, logger="grpax.rl.profiling"):
        profile = StepProfiler("xplane", tmp_path, 2, 5, 1, 4)  # resumed at step 3 of 4, skipping 5
    assert (
        "no trace: this run executes steps 3-4 and skip_first_n_steps_for_profiler=5 skips them all"
        in caplog.text
    )
    for step in (2, 3):
        profile.before(step)
        profile.after(step, None)
    assert not profile.active and not any(tmp_path.iterdir())


def test_maxtexts_newer_rl_yml_keys_load_from_a_user_yaml_and_land(tmp_path):
    """The keys MaxText's rl.yml gained (its agentic learner, math-verify pool, converter checks, dataset
    subset, evaluation configs): a YAML of them at MaxText's defaults loads; each honoured one lands."""
    (tmp_path / "rl.yml").write_text(
        "rl:\n  use_agentic_rollout: false\n  max_concurrency: 256\n  off_policy_steps: 1\n"
        "  system_prompt: 'Answer briefly.'\n  reshard_chunk_size: null\nconvert_checkpoint_if_possible: true\n"
        "debug: false\ngeneration_configs:\n  greedy:\n    eval_temperature: 0.01\n    eval_top_k: 1\n"
        "    eval_top_p: 1.0\n  standard:\n    eval_temperature: 0.6\n    eval_top_k: 20\n    eval_top_p: 0.9\n"
        "eval_sampling_strategy: standard\nmax_num_batched_tokens: null\nmax_num_seqs: null\n"
        "reward_exact_answer: 2.5\nreward_exact_format_match: 0.1\nmath_verify_timeout: 120\n"
        "math_verify_num_procs: null\nreasoning_start_token_in_prompt: false\n"
        "data_template_path: 'maxtext/examples/chat_templates/gsm8k_rl.json'\ndataset_processor_path: ''\n"
        "hf_subset: 'socratic'\nvllm_load_format: dummy\ndebug_converter: false\ngcs_debug_path: ''\n"
        "eval_mode: maj\nhf_train_files: ''\n"
    )
    cfg = build_config(TrainConfig, [f"config={tmp_path / 'rl.yml'}"])
    assert (cfg.max_staleness, cfg.max_num_seqs, cfg.convert_checkpoint_if_possible, cfg.eval_mode) == (
        1, 0, True, "maj",
    )  # fmt: skip
    task = build_task(cfg)
    assert task.preset.system_prompt == "Answer briefly." and task.hf_subset == "socratic"
    # reward_exact_answer scores the exact answer, reward_exact_format_match the layout alone
    assert (task.reward_config.answer_exact, task.reward_config.format_exact) == (2.5, 0.1)
    from grpax.eval.keys import eval_sampling

    assert eval_sampling(cfg) == dict(greedy=False, temperature=0.6, top_k=20, top_p=0.9)
    greedy = build_config(TrainConfig, [f"config={tmp_path / 'rl.yml'}", "eval_sampling_strategy=greedy"])
    assert eval_sampling(greedy) == dict(greedy=True, temperature=1.0, top_k=0, top_p=1.0)  # top-k 1: argmax


def test_reward_exact_format_match_alone_scores_the_answer_too():
    """MaxText's older rl.yml had no reward_exact_answer: its exact-format value scored the exact answer too."""
    older = build_task(build_config(TrainConfig, ["reward_exact_format_match=3"])).reward_config
    newer = build_task(build_config(TrainConfig, ["reward_exact_format_match=3", "reward_exact_answer=4"]))
    assert (older.format_exact, older.answer_exact) == (3.0, 3.0)
    assert (newer.reward_config.format_exact, newer.reward_config.answer_exact) == (3.0, 4.0)


def test_hf_subset_picks_the_hub_datasets_config(monkeypatch):
    from grpax.data import datasets

    seen = []
    monkeypatch.setattr(datasets, "_load_from_hub", lambda name, split, config: seen.append(config) or [])
    for keys, config in ((["hf_subset=socratic"], "socratic"), ([], "main")):
        build_task(build_config(TrainConfig, keys)).load_rows("openai/gsm8k", "train")
        assert seen.pop() == config


def test_system_prompt_replaces_the_presets_system_turn():
    from grpax.data.prompts import build_messages

    preset = build_task(build_config(TrainConfig, ["rl.system_prompt=Think step by step."])).preset
    assert build_messages("1 + 1?", preset.system_prompt, preset.user_template)[0] == {
        "role": "system",
        "content": "Think step by step.",
    }
    assert build_task(build_config(TrainConfig, [])).preset.system_prompt != "Think step by step."


def test_convert_checkpoint_if_possible_converts_model_name_once(tmp_path, monkeypatch):
    """Without load_parameters_path the run reads base_output_directory/0/items, converted there first (once)."""
    from grpax.checkpoint import convert
    from grpax.rl.trainer import converted_base

    calls = []

    def to_native(**kwargs):
        calls.append(kwargs)
        (tmp_path / "0" / "items").mkdir(parents=True)

    monkeypatch.setattr(convert, "to_native", to_native)
    keys = [
        f"base_output_directory={tmp_path}",
        "convert_checkpoint_if_possible=true",
        "weight_dtype=bfloat16",
        "hf_access_token=hf_secret",
    ]
    cfg = build_config(TrainConfig, keys)
    for _ in range(2):
        assert converted_base(cfg).load_parameters_path == str(tmp_path / "0" / "items")
    assert [
        (c["model_name"], c["base_output_directory"], c["weight_dtype"], c["hf_access_token"]) for c in calls
    ] == [("smollm2-135m-Instruct", str(tmp_path), "bfloat16", "hf_secret")]
    given = build_config(TrainConfig, [*keys, "load_parameters_path=ckpt"])
    assert (
        converted_base(given) is given
        and converted_base(build_config(TrainConfig, [])).load_parameters_path == ""
    )
    with pytest.raises(
        ConfigError, match="^load_parameters_path is required: .*convert_checkpoint_if_possible=true"
    ):
        validate(build_config(TrainConfig, []))


def test_debug_logs_grpaxs_debug_messages(tmp_path):
    path = tmp_path / "completions.jsonl"
    path.write_text('{"question": "q", "answer": "#### 2", "completion": "<answer>2</answer>"}\n')
    grpax_log = logging.getLogger("grpax")
    try:
        assert main(["evaluate", f"completions_path={path}", "debug=true"]) == 0
        assert grpax_log.level == logging.DEBUG
    finally:
        grpax_log.setLevel(logging.NOTSET)


def test_learning_rate_schedule_steps_sets_the_schedules_length():
    """MaxText's learning_rate_schedule_steps: the cosine spans that many steps, not num_batches (a longer one
    ends the run before its decay does), and warmup_steps_fraction is a fraction of it."""
    from grpax.rl.optim import learning_rate_at, optimizer_from_config

    def rates(*keys):
        grpo = build_config(
            TrainConfig, ["num_batches=10", "learning_rate=1.0", "warmup_ratio=0", *keys]
        ).grpo()
        _, schedule = optimizer_from_config(grpo, grpo.schedule_steps(10))
        return [round(learning_rate_at(schedule, s), 6) for s in (0, 5, 10)]

    assert rates() == [1.0, 0.5, 0.0]  # the cosine over the run's 10 steps
    assert rates("learning_rate_schedule_steps=20") == [1.0, 0.853553, 0.5]
    assert rates("learning_rate_schedule_steps=20", "warmup_steps_fraction=0.5") == [0.090909, 0.545455, 1.0]
    with pytest.raises(ConfigError, match=r"^learning_rate_schedule_steps=0: expected >= 1 steps, or -1"):
        validate(build_config(TrainConfig, ["load_parameters_path=x", "learning_rate_schedule_steps=0"]))


def test_generation_configs_in_the_compact_flow_form_of_maxtexts_scripts():
    """MaxText's scripts write command-line mappings without spaces (``vllm_hf_overrides={architectures:[...]}``);
    YAML alone reads ``{mine:{eval_temperature:0.5}}`` as the key 'eval_temperature:0.5' with no value."""
    from grpax.eval.keys import eval_sampling

    keys = ["generation_configs={mine:{eval_temperature:0.5,eval_top_p:0.9}}", "eval_sampling_strategy=mine"]
    cfg = build_config(TrainConfig, keys)
    assert cfg.generation_configs == {"mine": {"eval_temperature": 0.5, "eval_top_p": 0.9}}
    assert eval_sampling(cfg) == dict(greedy=False, temperature=0.5, top_k=0, top_p=0.9)
    spaced = build_config(
        TrainConfig, ["generation_configs={mine: {eval_temperature: 0.5, eval_top_p: 0.9}}"]
    )
    assert spaced.generation_configs == cfg.generation_configs


def test_generation_configs_that_is_not_yaml_is_one_line(capsys):
    assert main(["train_rl", "load_parameters_path=x", "generation_configs={{standard"]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("grpax train_rl: error: generation_configs='{{standard' is not a YAML mapping (")
        and err.count("\n") == 1
    )


def test_a_config_with_generation_configs_stays_hashable_with_its_own_mapping():
    """A frozen config is hashable (a dict field is left out of the hash, still compared); each instance's default
    mapping is its own, so changing one cannot change another's."""
    keys = ["generation_configs={mine:{eval_temperature:0.5}}"]
    a, b = build_config(TrainConfig, keys), build_config(TrainConfig, keys)
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a != build_config(TrainConfig, ["generation_configs={mine:{eval_temperature:0.6}}"])
    first, second = TrainConfig(), TrainConfig()
    first.generation_configs["mine"] = {"eval_temperature": 0.5}
    assert second.generation_configs == {}
    assert json.loads(json.dumps(a.generation_configs)) == {"mine": {"eval_temperature": 0.5}}  # config.json


def test_eval_batch_size_minus_one_is_batch_size_as_in_maxtexts_rl_yml():
    """MaxText's newest rl.yml sets eval_batch_size: -1, "use batch_size"; grpax refused it before."""
    cfg = build_config(TrainConfig, ["load_parameters_path=x", "batch_size=3", "eval_batch_size=-1"])
    validate(cfg)
    assert cfg.eval_batch_size == 3
    with pytest.raises(ConfigError, match=r"^eval_batch_size=-2: expected >= 1"):
        validate(build_config(TrainConfig, ["load_parameters_path=x", "eval_batch_size=-2"]))


def test_convert_checkpoint_if_possible_checks_the_keys_first_and_says_what_failed(
    tmp_path, monkeypatch, capsys
):
    """A bad key stops the run before the conversion's download (it converted first, then refused batch_size=0);
    offline, the conversion's fix (hf_model_path=, gguf_path=: to_native's keys, unknown to train_rl) comes with
    the grpax to_native command that takes them."""
    from grpax.checkpoint import convert

    calls = []

    def offline(**kwargs):
        calls.append(kwargs)
        raise ConfigError(
            "cannot reach the Hugging Face Hub for HuggingFaceTB/SmolLM2-135M-Instruct (ConnectError); download "
            "it elsewhere and pass hf_model_path=<that folder>, or pass gguf_path=<file.gguf>"
        )

    monkeypatch.setattr(convert, "to_native", offline)
    keys = ["train_rl", f"base_output_directory={tmp_path}", "convert_checkpoint_if_possible=true"]
    assert main([*keys, "batch_size=0"]) == 2
    assert capsys.readouterr().err.startswith("grpax train_rl: error: batch_size=0") and calls == []
    assert main(keys) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"grpax train_rl: error: convert_checkpoint_if_possible=true: converting model_name=smollm2-135m-Instruct "
        f"into {tmp_path}/0/items failed: cannot reach the Hugging Face Hub for HuggingFaceTB/SmolLM2-135M-Instruct "
        "(ConnectError); download it elsewhere and pass hf_model_path=<that folder>, or pass gguf_path=<file.gguf> "
        "(the keys named are grpax to_native's: convert with grpax to_native model_name=smollm2-135m-Instruct "
        f"base_output_directory={tmp_path} and them, then pass load_parameters_path={tmp_path}/0/items)"
    )


def test_maxtexts_debug_rl_note_names_grpaxs_debug_key(caplog, tmp_path):
    """The note said "grpax logs at INFO", but grpax's debug=true (MaxText's newer key) logs DEBUG too."""
    (tmp_path / "debug.yml").write_text("debug:\n  rl: true\n")
    with caplog.at_level(logging.INFO, logger="grpax.config"):
        build_config(TrainConfig, ["debug.rl=true"])
        build_config(TrainConfig, [str(tmp_path / "debug.yml")])
    notes = [r.getMessage() for r in caplog.records if "RL debug logging" in r.getMessage()]
    assert len(notes) == 2 and all("grpax's is debug=true (its DEBUG messages" in n for n in notes), notes


def test_two_spellings_of_one_key_in_a_yaml_file_are_refused(tmp_path):
    """A YAML file giving one key twice is refused; two spellings of it (rl: {grpo_beta: ..} and beta:, or
    rl.off_policy_steps and max_staleness) ran with whichever came last, without a word. The same value twice is
    fine; on the command line the last spelling wins, as the last of a key given twice does."""
    path = tmp_path / "rl.yml"
    path.write_text("rl:\n  grpo_beta: 0.08\n  num_generations: 4\nbeta: 0.04\nnum_generations: 4\n")
    with pytest.raises(
        ConfigError, match=r"^grpo_beta=0.08 and beta=0.04 \(.*rl.yml\) both set beta: keep one$"
    ):
        build_config(TrainConfig, [str(path)])
    path.write_text("rl:\n  num_generations: 4\n  off_policy_steps: 1\nnum_generations: 2\n")
    with pytest.raises(ConfigError, match=r"^rl.num_generations=4 and num_generations=2 \(.*\) both set num"):
        build_config(TrainConfig, [str(path)])
    path.write_text("rl:\n  grpo_beta: 0.08\n  num_generations: 4\nnum_generations: 4\n")
    cfg = build_config(TrainConfig, [str(path), "beta=0.02", "rl.off_policy_steps=2", "max_staleness=1"])
    assert (cfg.beta, cfg.num_generations, cfg.max_staleness) == (0.02, 4, 1)


def test_a_yaml_files_refused_maxtext_key_is_overridden_on_the_command_line(tmp_path, caplog):
    """MaxText's rl.yml sets trainer_devices_fraction: 0.5; its refusal asked for rollout_devices=, which left the
    file's key refused still. The command line's value now wins over the file's (refused in turn if it is not what
    grpax does), and the file's refusal says so."""
    path = tmp_path / "rl.yml"
    rules = [["activation_batch", ["data", "fsdp", "fsdp_transpose", "expert"]]] * 20
    path.write_text(
        f"trainer_devices_fraction: 0.5\nsampler_devices_fraction: 0.5\nlogical_axis_rules: {rules}\n"
    )
    with pytest.raises(ConfigError) as err:
        build_config(TrainConfig, [str(path)])
    assert str(err.value).startswith(f"trainer_devices_fraction=0.5 ({path}): Pathways' placement") and str(
        err.value
    ).endswith(
        "pass rollout_devices=<devices for the sampler> instead (or give trainer_devices_fraction=1 on the "
        f"command line, which wins over {path})"
    )
    with caplog.at_level(logging.INFO, logger="grpax.config"):
        build_config(TrainConfig, [str(path), "trainer_devices_fraction=1", "sampler_devices_fraction=1.0"])
    with pytest.raises(ConfigError, match=r"^sampler_devices_fraction=0.25 \(the command line\): Pathways'"):
        build_config(TrainConfig, [str(path), "trainer_devices_fraction=1", "sampler_devices_fraction=0.25"])
    # a long value is cut in its note (MaxText's logical_axis_rules printed 3,000 characters)
    note = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("logical_axis_rules="))
    assert note.startswith(f"logical_axis_rules={str(rules)[:117]}... ({path}): MaxText's logical-to-mesh")


def test_a_bad_value_of_an_alias_names_the_key_as_given(tmp_path):
    """rl.off_policy_steps=abc was refused as "max_staleness='abc'": a key the user never wrote."""
    with pytest.raises(ConfigError, match=r"^rl.off_policy_steps='abc': expected an integer$"):
        build_config(TrainConfig, ["rl.off_policy_steps=abc"])
    (tmp_path / "rl.yml").write_text("rl:\n  grpo_beta: high\n")
    with pytest.raises(ConfigError, match=r"^grpo_beta='high': expected a number$"):
        build_config(TrainConfig, [str(tmp_path / "rl.yml")])
    with pytest.raises(ConfigError, match=r"^max_staleness='abc': expected an integer$"):
        build_config(TrainConfig, ["max_staleness=abc"])


def test_a_whole_number_eval_top_k_reaches_the_sampler_as_an_integer():
    """eval_top_k: 50.0 passed the check (a whole number) and then stopped the run at its first evaluation, after
    the model load: "top_k=50.0 must be an integer", naming no key."""
    import dataclasses

    from grpax.eval.keys import eval_sampling
    from grpax.sampler.keys import SamplerConfig

    keys = [
        "generation_configs={standard:{eval_top_k:50.0,eval_temperature:1}}",
        "eval_sampling_strategy=standard",
    ]
    fields = eval_sampling(build_config(TrainConfig, keys))
    assert (
        fields == dict(greedy=False, temperature=1.0, top_k=50, top_p=0.95) and type(fields["top_k"]) is int
    )
    assert dataclasses.replace(SamplerConfig(), **fields).top_k == 50


def test_hf_train_files_reads_a_json_file_holding_one_array(tmp_path):
    """The datasets library (MaxText's hf_train_files) reads a .json file holding a JSON array; grpax read it as
    one JSONL row, a list, and said the row had no columns ("its columns are []")."""
    import json

    from grpax.data.datasets import read_rows

    rows = [{"question": f"What is {i} + 1?", "answer": f"#### {i + 1}"} for i in range(3)]
    (tmp_path / "a.json").write_text(json.dumps(rows, indent=2))
    (tmp_path / "b.json").write_text("".join(json.dumps(r) + "\n" for r in rows[:2]))  # JSON Lines
    assert read_rows(str(tmp_path / "a.json"), "train")[0] == rows
    assert read_rows(str(tmp_path / "*.json"), "train") == (rows + rows[:2], str(tmp_path / "*.json"))
    cfg = build_config(TrainConfig, [f"hf_train_files={tmp_path / 'a.json'}"])
    assert [r["gold"] for r in build_task(cfg).load_rows(cfg.hf_train_files, "train")] == ["1", "2", "3"]


def test_generation_configs_reach_the_trainers_evaluation_sampler(monkeypatch):
    """train_rl's evaluation sampler takes the chosen strategy's generation_configs entry."""
    from grpax.models.registry import ModelConfig
    from grpax.rl import trainer

    monkeypatch.setattr(trainer, "stop_token_ids", lambda tokenizer, model_cfg: (1,))
    model_cfg = ModelConfig(
        vocab_size=64, hidden_dim=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=64
    )
    keys = [
        "generation_configs={standard:{eval_temperature:0.5,eval_top_k:20}}",
        "eval_sampling_strategy=standard",
    ]
    cfg = build_config(TrainConfig, keys)
    rollout, evaluation = trainer._sampler_configs(cfg, cfg.grpo(), None, model_cfg)
    assert (evaluation.greedy, evaluation.temperature, evaluation.top_k, evaluation.top_p) == (
        False,
        0.5,
        20,
        0.95,
    )
    assert (rollout.temperature, rollout.top_k) == (cfg.temperature, cfg.decode_sampling_top_k)
