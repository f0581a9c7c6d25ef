"""Named prompt presets (the ``prompt_preset`` key): each task's own, gathered in one table.

GSM8K brings ``maxtext``, ``smollm2_demo`` and ``smollm2_calculator`` (the last with the calculator environment:
``grpax.tasks.gsm8k``), math brings ``math`` (``grpax.tasks.math``), and ``plain`` is the prompt column alone as
the user turn (``task=custom``). A preset (``grpax.data.prompts.PromptPreset``) fixes the system prompt, the
user-turn template (with a ``{question}`` slot) and an optional ``response_prefix`` pre-filled after the chat
template's generation prompt, so the model starts its reply inside the reasoning block.

Example:
    >>> PROMPT_PRESETS["smollm2_demo"].response_prefix
    '<reasoning>\\n'
"""

from __future__ import annotations

from grpax.data.prompts import PromptPreset
from grpax.tasks.gsm8k import PROMPTS as GSM8K_PROMPTS
from grpax.tasks.math import PROMPTS as MATH_PROMPTS

PROMPT_PRESETS: dict[str, PromptPreset] = {
    **GSM8K_PROMPTS,
    **MATH_PROMPTS,
    "plain": PromptPreset(system_prompt=""),  # the prompt column alone as the user turn
}
GSM8K_PRESETS = tuple(GSM8K_PROMPTS)  # they ask for a number between <answer> tags


def get_prompt_preset(name: str) -> PromptPreset:
    """Looks up a prompt preset by name.

    Args:
        name: a key of ``PROMPT_PRESETS`` (``"maxtext"``, ``"smollm2_demo"``, ``"smollm2_calculator"``, ``"math"``,
            ``"plain"``).

    Returns:
        The preset.

    Raises:
        ValueError: if the name is unknown; the message lists the known names.

    Example:
        >>> get_prompt_preset("maxtext").response_prefix
        ''
    """
    if name not in PROMPT_PRESETS:
        raise ValueError(f"unknown prompt preset {name!r}; known presets: {sorted(PROMPT_PRESETS)}")
    return PROMPT_PRESETS[name]
