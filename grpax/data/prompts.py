"""How one question becomes a chat prompt: ``PromptPreset`` (the named presets are the tasks': ``grpax.tasks.prompts``).

A preset fixes three strings: the system prompt, the user-turn template (with a ``{question}`` slot) and an
optional ``response_prefix`` that is pre-filled after the chat template's generation prompt, so the model
starts its reply inside the block the task's rewards check.

Example:
    >>> PromptPreset(system_prompt="Be brief.", response_prefix="<reasoning>\\n").user_template
    '{question}'
"""

from __future__ import annotations

from dataclasses import dataclass


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
