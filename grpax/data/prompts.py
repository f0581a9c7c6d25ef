"""Named prompt presets: GSM8K-style reasoning with tagged output (maxtext, smollm2_demo; smollm2_calculator with the
calculator environment) and math (boxed).

A preset fixes three strings: the system prompt, the user-turn template (with a ``{question}`` slot) and an
optional ``response_prefix`` that is pre-filled after the chat template's generation prompt, so the model
starts its reply inside the reasoning block. The tag names match the ones the reward functions in
``grpax.tasks.gsm8k_rewards`` check, following the MaxText / Tunix GRPO GSM8K recipe (reasoning between
``<reasoning>`` tags, the final answer between ``<answer>`` tags).

Example:
    >>> preset = PROMPT_PRESETS["smollm2_demo"]
    >>> preset.response_prefix
    '<reasoning>\\n'
"""

from __future__ import annotations

from dataclasses import dataclass

REASONING_START = "<reasoning>"
REASONING_END = "</reasoning>"
ANSWER_START = "<answer>"
ANSWER_END = "</answer>"
TAGS = (REASONING_START, REASONING_END, ANSWER_START, ANSWER_END)


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


_MAXTEXT_SYSTEM = (
    "You will be given a math word problem. Work it out step by step and write all of your working "
    f"between {REASONING_START} and {REASONING_END}. After that, give only the final number between "
    f"{ANSWER_START} and {ANSWER_END}."
)

# A 135M model rarely invents the tag layout from an instruction alone; one short worked example in the
# user turn plus a pre-filled opening tag gives it a pattern to copy.
_SMOLLM2_SYSTEM = "You are a careful assistant who solves grade-school math problems."
_SMOLLM2_TEMPLATE = (
    f"Solve the problem. Write your steps inside {REASONING_START} {REASONING_END} and the final number "
    f"inside {ANSWER_START} {ANSWER_END}.\n\n"
    "Example problem: A shop sells pens at $2 each. Sam buys 4 pens. How much does he pay?\n"
    f"{REASONING_START}\n4 pens cost 4 * 2 = 8 dollars.\n{REASONING_END}\n"
    f"{ANSWER_START}\n8\n{ANSWER_END}\n\n"
    "Problem: {question}"
)

# environment=calculator for a small model: it copies the worked example and overlooks a system prompt's tool
# instructions, so here the example itself calls the calculator, with the environment's exact answers.
_SMOLLM2_CALCULATOR_TEMPLATE = (
    f"Solve the problem. Write your steps inside {REASONING_START} {REASONING_END} and the final number "
    f"inside {ANSWER_START} {ANSWER_END}. Do each calculation with the calculator: write it between "
    "<calculator> and </calculator>, and its result follows between <result> and </result>.\n\n"
    "Example problem: A shop sells pens at $2 each. Sam buys 4 pens and pays with a $10 bill. How much change "
    "does he get?\n"
    f"{REASONING_START}\n4 pens cost <calculator>4 * 2</calculator><result>8</result>\n8 dollars. His change is "
    f"<calculator>10 - 8</calculator><result>2</result>\n2 dollars.\n{REASONING_END}\n"
    f"{ANSWER_START}\n2\n{ANSWER_END}\n\n"
    "Problem: {question}"
)

# task=math: competition problems whose answers are expressions, judged by math-verify on the last \boxed{}.
_MATH_SYSTEM = (
    "You will be given a math problem. Reason step by step, then write the final answer in LaTeX inside "
    "\\boxed{}, e.g. \\boxed{\\frac{1}{2}}."
)

PROMPT_PRESETS: dict[str, PromptPreset] = {
    "maxtext": PromptPreset(system_prompt=_MAXTEXT_SYSTEM, user_template="{question}", response_prefix=""),
    "smollm2_demo": PromptPreset(
        system_prompt=_SMOLLM2_SYSTEM, user_template=_SMOLLM2_TEMPLATE, response_prefix=f"{REASONING_START}\n"
    ),
    "smollm2_calculator": PromptPreset(
        system_prompt=_SMOLLM2_SYSTEM,
        user_template=_SMOLLM2_CALCULATOR_TEMPLATE,
        response_prefix=f"{REASONING_START}\n",
    ),
    "math": PromptPreset(system_prompt=_MATH_SYSTEM),
    "plain": PromptPreset(system_prompt=""),  # the prompt column alone as the user turn
}
GSM8K_PRESETS = (
    "maxtext",
    "smollm2_demo",
    "smollm2_calculator",
)  # they ask for a number between <answer> tags


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
