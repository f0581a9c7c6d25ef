"""Prompts of any task: chat messages, rendering with the chat template, tokenizing, the length filter.

A ``PromptPreset`` fixes three strings: the system prompt, the user-turn template (with a ``{question}`` slot) and
an optional ``response_prefix`` that is pre-filled after the chat template's generation prompt, so the model
starts its reply inside the block the task's rewards check (the named presets are the tasks':
``grpax.tasks.prompts``). Prompts are rendered with the tokenizer's own chat template
(``add_generation_prompt=True``) plus the ``response_prefix``, then tokenized with ``add_special_tokens=False``
because the template already writes BOS where the model has one. ``prepare_rows`` does all of it for a split:
the task's rows, rendered, tokenized, and those longer than ``max_prefill_predict_length`` dropped (counted).

Example:
    >>> PromptPreset(system_prompt="Be brief.", response_prefix="<reasoning>\\n").user_template
    '{question}'
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from grpax.data.datasets import too_few_rows
from grpax.data.token_cache import cached_token_ids

logger = logging.getLogger(__name__)
_train_log = logging.getLogger("grpax.train")  # the name prepare_rows has always logged under


@dataclass(frozen=True)
class PromptPreset:
    """How one question becomes a chat prompt.

    Attributes:
        system_prompt: text of the system turn; empty string for no system turn.
        user_template: user-turn text with a literal ``{question}`` slot (filled by plain replacement, so
            braces elsewhere in the template or in the question are kept as they are).
        response_prefix: text appended after the generation prompt; the model continues from it, and the
            reward functions prepend it to the completion before checking the format.
    """

    system_prompt: str
    user_template: str = "{question}"
    response_prefix: str = ""


def build_messages(
    question: str, system_prompt: str, template: str = "{question}", system_role: bool = True
) -> list[dict[str, str]]:
    """Builds the chat messages for one question.

    Args:
        question: the problem text.
        system_prompt: system text; empty for none.
        template: user-turn text with a ``{question}`` slot (plain replacement; other braces are kept).
        system_role: if False (for chat templates without a system role), the system text is put at the top
            of the user turn instead.

    Returns:
        ``[{"role": "system", "content": ...}, {"role": "user", "content": ...}]`` (no system message if
        ``system_prompt`` is empty or ``system_role`` is False).

    Example:
        >>> build_messages("1+1?", "Be brief.", "Q: {question}")
        [{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': 'Q: 1+1?'}]
    """
    user = template.replace("{question}", question)
    if system_prompt and not system_role:
        return [{"role": "user", "content": f"{system_prompt}\n\n{user}"}]
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return [*messages, {"role": "user", "content": user}]


def render_prompt(tokenizer: Any, question: str, preset: PromptPreset, system_role: bool = True) -> str:
    """Renders one question as prompt text with the tokenizer's chat template.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template.
        question: the problem text.
        preset: the system prompt, user template and response prefix (a named one:
            ``grpax.tasks.prompts.get_prompt_preset``).
        system_role: see ``build_messages``.

    Returns:
        ``apply_chat_template(messages, tokenize=False, add_generation_prompt=True)`` followed by the
        preset's ``response_prefix``.

    Example:
        >>> render_prompt(tok, "1+1?", PromptPreset("", response_prefix="<reasoning>\\n")).endswith("<reasoning>\\n")  # doctest: +SKIP
        True
    """
    messages = build_messages(question, preset.system_prompt, preset.user_template, system_role)
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return text + preset.response_prefix


def tokenize_prompts(tokenizer: Any, texts: Sequence[str]) -> list[list[int]]:
    """Tokenizes rendered prompts without adding special tokens (the chat template wrote them).

    Args:
        tokenizer: a Hugging Face tokenizer.
        texts: rendered prompt strings.

    Returns:
        Token ids per prompt (lengths vary; no padding).

    Example:
        >>> tokenize_prompts(tok, ["<s>user: hi"])  # doctest: +SKIP
        [[1, 5, 6]]
    """
    if not texts:
        return []
    return [list(ids) for ids in tokenizer(list(texts), add_special_tokens=False)["input_ids"]]


def filter_by_length(
    rows: Sequence[dict], token_ids: Sequence[Sequence[int]], max_prompt_length: int
) -> tuple[list[dict], list[list[int]], int]:
    """Drops prompts longer than ``max_prompt_length`` tokens and logs how many.

    Args:
        rows: dataset rows.
        token_ids: prompt token ids, aligned with rows.
        max_prompt_length: the longest prompt kept, in tokens.

    Returns:
        ``(kept_rows, kept_ids, num_dropped)``.

    Raises:
        ValueError: if rows and token_ids differ in length.

    Example:
        >>> filter_by_length([{"q": 1}, {"q": 2}], [[1, 2, 3], [1]], max_prompt_length=2)
        ([{'q': 2}], [[1]], 1)
    """
    if len(rows) != len(token_ids):
        raise ValueError(f"rows ({len(rows)}) and token_ids ({len(token_ids)}) must have the same length")
    kept = [(r, list(ids)) for r, ids in zip(rows, token_ids, strict=True) if len(ids) <= max_prompt_length]
    num_dropped = len(rows) - len(kept)
    if num_dropped:
        logger.info(
            "dropped %d of %d prompts longer than %d tokens", num_dropped, len(rows), max_prompt_length
        )
    return [r for r, _ in kept], [ids for _, ids in kept], num_dropped


def prepare_rows(
    tokenizer: Any,
    dataset: str,
    split: str,
    preset: PromptPreset,
    max_prompt_length: int,
    limit: int = -1,
    *,
    load: Callable[[str, str], list[dict]],
    need: tuple[str, str, int] = ("dataset_name", "split", 0),
    render: Callable[[dict], str] | None = None,
    cache_dir: str | None = None,
) -> list[dict]:
    """Loads a split, renders and tokenizes its prompts (``row["prompt_ids"]``), drops over-long ones.

    Args:
      limit: keep the first ``limit`` rows after filtering (-1: all).
      load: ``(dataset, split) -> rows`` with a ``question`` each (the task's ``load_rows``).
      need: ``(dataset key, split key, rows)``: refuse fewer rows than that after the length filter.
      render: a row's prompt text as it is sampled, when it is not ``render_prompt`` of its question with
        ``preset`` (an environment adds its instructions: ``grpax.sampler.multi_turn.prompt_renderer``), so that
        the length filter measures the prompt the sampler gets; None: ``render_prompt``.
      cache_dir: the token cache (``grpax.data.token_cache``): the ids of these texts with this tokenizer are
        read from there when an earlier run stored them; None: tokenize.

    Raises:
      ConfigError: fewer rows than ``need`` fit max_prefill_predict_length (the keys, counts and fix named).
    """
    rows = load(dataset, split)
    if render is None:
        texts = [render_prompt(tokenizer, row["question"], preset) for row in rows]
    else:
        texts = [render(row) for row in rows]
    ids = cached_token_ids(tokenizer, texts, lambda t: tokenize_prompts(tokenizer, t), cache_dir)
    rows, ids, dropped = filter_by_length(rows, ids, max_prompt_length)
    _train_log.info(
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
        raise too_few_rows(key, dataset, split_key, split, got, f"the {count} needed", fix)
    for row, row_ids in zip(rows, ids, strict=True):
        row["prompt_ids"] = row_ids
    return rows if limit < 0 else rows[:limit]
