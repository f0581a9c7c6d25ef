"""Before/after table of an evaluation with tools: accuracy and tool use, with intervals and paired tests.

Reads two ``grpax evaluate`` (or ``train_rl`` ``eval/<tag>``) folders of the same questions: their
``summary.json`` (accuracy, format accuracy, mean reward and their 95% intervals, as ``grpax evaluate`` prints
them) and ``results.jsonl`` (one record per completion, with ``tool_calls``). Tool use per question: the share
of questions with a call (Wilson interval, ``grpax.eval.metrics.proportion``) and calls per question (mean +-
1.96 standard errors, clipped: ``grpax.eval.metrics.mean_reward`` on the counts). Paired: the exact sign test
of ``grpax.eval.compare`` on the same questions (``compare`` for the task's metrics; ``sign_test_p_value``
on each question's calls and on whether it made one).

Usage: python benchmarks/tool_use_compare.py BEFORE_DIR AFTER_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from grpax.eval.compare import compare, sign_test_p_value
from grpax.eval.metrics import mean_reward, proportion
from grpax.tasks.gsm8k import GSM8KTask
from grpax.tasks.gsm8k_rewards import get_reward_config
from grpax.tasks.prompts import get_prompt_preset


def _load(folder: Path) -> tuple[dict, list[dict]]:
    summary = json.loads((folder / "summary.json").read_text())
    records = [json.loads(x) for x in (folder / "results.jsonl").read_text().splitlines() if x]
    return summary, records


def _calls(records: list[dict]) -> dict[str, list[int]]:
    by_question: dict[str, list[int]] = {}
    for r in records:
        by_question.setdefault(r["question"], []).append(int(r.get("tool_calls", 0)))
    return by_question


def _ci(lo: float, hi: float) -> str:
    return f"{lo:.3f} .. {hi:.3f}"


def main(before_dir: str, after_dir: str) -> None:
    (sb, rb), (sa, ra) = _load(Path(before_dir)), _load(Path(after_dir))
    task = GSM8KTask(
        get_prompt_preset("smollm2_demo"), get_reward_config("smollm2_demo"), None, "question", "answer"
    )
    paired = compare(rb, ra, task.is_correct)
    n = paired["num_questions"]
    print(f"{n} paired questions; before {sb['num_questions']}, after {sa['num_questions']}")
    print("| metric | before | after | change | paired p (up / down) |")
    print("|---|---|---|---|---|")
    for name in ("accuracy", "format_accuracy", "mean_reward"):
        m = paired["metrics"][name]
        print(
            f"| {name} | {sb[name]:.3f} ({_ci(*sb[name + '_ci95'])}) | {sa[name]:.3f} ({_ci(*sa[name + '_ci95'])}) "
            f"| {m['change']:+.3f} | {m['p_value']:.3g} ({m['up']} / {m['down']}) |"
        )
    cb, ca = _calls(rb), _calls(ra)
    shared = [q for q in cb if q in ca]
    used = {
        tag: proportion([[c > 0 for c in calls[q]] for q in shared]) for tag, calls in (("b", cb), ("a", ca))
    }
    per_q = {
        tag: mean_reward([[float(c) for c in calls[q]] for q in shared])
        for tag, calls in (("b", cb), ("a", ca))
    }
    mean = {tag: {q: sum(calls[q]) / len(calls[q]) for q in shared} for tag, calls in (("b", cb), ("a", ca))}
    up = sum(mean["a"][q] > mean["b"][q] for q in shared)
    down = sum(mean["a"][q] < mean["b"][q] for q in shared)
    any_b = {q: any(c > 0 for c in cb[q]) for q in shared}
    any_a = {q: any(c > 0 for c in ca[q]) for q in shared}
    any_up = sum(any_a[q] and not any_b[q] for q in shared)
    any_down = sum(any_b[q] and not any_a[q] for q in shared)
    print(
        f"| completions with a tool call | {used['b'].value:.3f} ({_ci(*used['b'].ci95)}) | {used['a'].value:.3f} "
        f"({_ci(*used['a'].ci95)}) | {used['a'].value - used['b'].value:+.3f} | "
        f"{sign_test_p_value(any_up, any_down):.3g} ({any_up} / {any_down}) |"
    )
    print(
        f"| tool calls per completion | {per_q['b'].value:.3f} ({_ci(*per_q['b'].ci95)}) | {per_q['a'].value:.3f} "
        f"({_ci(*per_q['a'].ci95)}) | {per_q['a'].value - per_q['b'].value:+.3f} | "
        f"{sign_test_p_value(up, down):.3g} ({up} / {down}) |"
    )
    for key in ("tool_errors", "turns"):
        print(f"| {key} per completion (mean) | {sb.get(key, 0):.3f} | {sa.get(key, 0):.3f} | | |")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
