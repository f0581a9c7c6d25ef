"""What a finished ``grpax train_rl`` run leaves: ``results.json``, the before/after table, the optional export.

``results.json`` is written before the Hugging Face export, so that a failed export loses nothing; the
before/after table (``format_before_after``) is what ``grpax train_rl`` prints at the end.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from grpax.checkpoint.convert import to_huggingface
from grpax.eval.compare import compare_eval_folders
from grpax.eval.metrics import EVAL_MODES
from grpax.rl.metrics_writer import MetricsWriter

log = logging.getLogger("grpax.train")


def reward_history(writer: MetricsWriter, final_step: int, this_run: list[float]) -> list[float]:
    """``rewards/total/mean`` of each logged step of the whole run (``this_run``'s steps without metrics files)."""
    if not writer.enabled:
        return this_run
    return [
        r["rewards/total/mean"]
        for r in writer.records()
        if "rewards/total/mean" in r and r["step"] <= final_step
    ]


def write_results(run_dir: Path, results: dict[str, Any]) -> None:
    (run_dir / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n")


def publish(
    results: dict[str, Any],
    run_dir: Path,
    eval_dir: Path,
    export_hf: str,
    final_step: int,
    check: Callable[[str | None, str], bool],
) -> None:
    """Adds the paired before/after test to ``results``, writes ``results.json`` and exports with ``export_hf``.

    ``check`` is the task's answer check (``Task.is_correct``) that judges the paired test's maj@k.

    Runs on the main process only. With ``export_hf``, ``results["hf_path"]`` is the exported folder and
    ``results.json`` is written again.
    """
    both = results["before"] and results["after"]
    results["paired"] = compare_eval_folders(eval_dir / "before", eval_dir / "after", check) if both else None
    write_results(run_dir, results)  # before the export, so that a failed export loses nothing
    if export_hf:
        summary = to_huggingface(results["actor_path"], export_hf)  # bfloat16, as grpax to_huggingface
        results["hf_path"] = summary["output_dir"]
        log.info("exported the step-%d actor to %s (Hugging Face format)", final_step, results["hf_path"])
        report = summary["rounding"]
        if report is not None:
            results["hf_rounding"] = report.as_dict()
            if report.lost:
                fix = (
                    f"export the step again with grpax to_huggingface load_parameters_path={results['actor_path']} "
                    "base_output_directory=<new folder> weight_dtype=float32"
                )
                log.warning("export_hf: %s", report.warning(fix))
            else:
                log.info("export_hf: %s", report.line())
        elif summary["rounding_note"]:
            log.info("export_hf: %s", summary["rounding_note"])
        write_results(run_dir, results)


def format_before_after(before: dict | None, after: dict | None, paired: dict | None = None) -> str:
    """The evaluation metrics before and after training, each with its 95% interval, and the paired test.

    Args:
      before, after: ``summarize`` dicts (None: that evaluation did not run); the first row is their ``score``,
        named by the metric their ``eval_mode`` made it, with that metric's paired p-value.
      paired: ``grpax.eval.compare.compare`` of the two evaluations' records (None: no paired test). Its
        sign-test p-values fill the last column, and a final line names the proportions whose change
        (after - before) is larger than the noise (p < its alpha) and those within it.

    Returns:
      The table as text; one line when neither evaluation ran (num_test_batches=0).
    """
    if before is None and after is None:
        return "evaluation skipped (num_test_batches=0): no before/after metrics"
    keys = ["accuracy", "partial_accuracy", "format_accuracy", "mean_reward"]
    keys += [k for k in (after or before) if k.startswith(("pass@", "maj@")) and not k.endswith("ci95")]
    keys = ["score", *keys] if all("score" in s for s in (before, after) if s) else keys
    tests = dict((paired or {}).get("metrics", {}))
    scored = EVAL_MODES.get((after or before).get("eval_mode", ""))
    if scored in tests:
        tests["score"] = tests[scored]

    def cell(summary: dict | None, key: str) -> str:
        value, ci = (summary or {}).get(key), (summary or {}).get(f"{key}_ci95")
        if value is None:
            return f"{'-':>22}"
        return f"{value:.3f} [{ci[0]:.2f}, {ci[1]:.2f}]".rjust(22) if ci else f"{value:>22.3f}"

    lines = [f"{'metric':<18}{'before':>22}{'after':>24}{'change':>10}{'paired p':>10}"]
    for k in keys:
        change = f"{after[k] - before[k]:>+10.3f}" if before and after else f"{'-':>10}"
        p = f"{tests[k]['p_value']:>10.3g}" if k in tests else f"{'-':>10}"
        name = f"score ({scored})" if k == "score" else k
        lines.append(f"{name:<18}{cell(before, k)}  {cell(after, k)}{change}{p}")
    count = lambda s: (s or {}).get("num_questions", "-")  # noqa: E731
    lines.append(f"{'questions':<18}{count(before):>22}  {count(after):>22}")
    if paired and tests:
        alpha = paired["alpha"]
        larger = [k for k, t in tests.items() if k != "score" and t["p_value"] < alpha]
        within = [k for k, t in tests.items() if k != "score" and t["p_value"] >= alpha]
        lines.append(
            f"change larger than the noise (exact sign test on the {paired['num_questions']} paired questions, "
            f"p < {alpha}): {', '.join(larger) or 'none'}; within the noise: {', '.join(within) or 'none'}"
        )
    elif after is None:
        lines.append("evaluation after training skipped (num_test_batches=0)")
    return "\n".join(lines)
