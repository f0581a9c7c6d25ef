"""The environment seam: the calculator environment's turns, tools that raise or hang, user environment files."""

import time

import pytest

from grpax.errors import ConfigError
from grpax.tasks.environment import (
    CALCULATOR_TAG_INSTRUCTIONS,
    Environment,
    ToolEnvironment,
    calculator_environment,
    chat_observation,
    load_environment,
    parse_chat_tool_call,
    run_tool,
)
from grpax.tasks.prompts import PROMPT_PRESETS


def test_calculator_environment_tag_turns():
    env = calculator_environment("tags")
    assert env.stop_strings == ("</calculator>",)
    messages = env.reset({"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]})
    assert messages[0]["content"].startswith("S\n\nYou have a calculator") and messages[1]["content"] == "Q"
    assert env.step("6 boxes of 8: <calculator>6 * 8</calculator>") == ("<result>48</result>\n", 0.0, False)
    assert env.step("<calculator>2 ** 1000</calculator>") == (
        "<result>error: exponent 1000 is larger than 64</result>\n",
        0.0,
        False,
    )
    assert env.step("So <answer>48</answer>") == (None, 0.0, True)  # no call: the final answer
    assert (env.calls, env.errors) == (2, 1)


def test_tool_call_reward_is_paid_once_per_trajectory_for_a_call_that_works():
    # tool_call_reward=0.5: the first call that returns a value earns 0.5; an error, a later call and the
    # final answer earn nothing; a fresh trajectory (a new environment) earns it again.
    env = calculator_environment("tags", call_reward=0.5)
    assert env.step("<calculator>2 ** 1000</calculator>") == (
        "<result>error: exponent 1000 is larger than 64</result>\n",
        0.0,
        False,
    )
    assert env.step("<calculator>6 * 8</calculator>") == ("<result>48</result>\n", 0.5, False)
    assert env.step("<calculator>48 + 2</calculator>") == ("<result>50</result>\n", 0.0, False)
    assert env.step("So <answer>50</answer>") == (None, 0.0, True)
    assert (env.calls, env.errors, env.successes) == (3, 1, 2)
    chat = load_environment("calculator", "", "chat", 1.0, 0.25)()
    assert chat.step('{"name": "search", "arguments": {}}')[1] == 0.0  # an unknown tool is an error
    assert chat.step('{"name": "calculator", "arguments": {"expression": "7/2"}}') == ("3.5", 0.25, False)


@pytest.mark.parametrize(
    "keys, message",
    [
        ({"tool_call_reward": 0.5}, "tool_call_reward=0.5 applies to the built-in tool environments"),
        (
            {"tool_call_reward": 0.5, "environment": "Guess", "environment_path": "env.py"},
            "tool_call_reward=0.5 applies to the built-in tool environments",
        ),
        (
            {"tool_call_reward": float("nan"), "environment": "calculator"},
            "tool_call_reward=nan: expected a finite",
        ),
    ],
)
def test_tool_call_reward_keys(keys, message):
    from grpax.tasks import TaskConfig, validate_environment_keys

    with pytest.raises(ConfigError, match=message):
        validate_environment_keys(TaskConfig(**keys))
    validate_environment_keys(TaskConfig(environment="calculator", tool_call_reward=0.5))


def _observations_shown(example: str) -> tuple[list[str], str]:
    """Each calculator call of ``example`` through the environment, checking that the text after the call is
    the environment's observation; returns the observations and the text after the last."""
    env, shown = calculator_environment("tags"), []
    while "</calculator>" in example:
        turn, example = example.split("</calculator>", 1)
        observation, _, done = env.step(turn + "</calculator>")
        assert not done and example.startswith(observation)
        shown.append(observation)
        example = example[len(observation) :]
    return shown, example


@pytest.mark.parametrize(
    "example, observations, rest",
    [
        (
            CALCULATOR_TAG_INSTRUCTIONS.split("Answer: ", 1)[1],
            ["<result>144</result>\n", "<result>72</result>\n"],
            "72 eggs.",
        ),
        (
            PROMPT_PRESETS["smollm2_calculator"].user_template.split("<reasoning>\n", 1)[1],
            ["<result>8</result>\n", "<result>2</result>\n"],
            "2 dollars.\n</reasoning>\n<answer>\n2\n</answer>\n\nProblem: {question}",
        ),
    ],
)
def test_worked_examples_show_what_the_calculator_answers(example, observations, rest):
    # The worked example a model imitates shows each call followed by the exact observation it would get.
    assert _observations_shown(example) == (observations, rest)


def test_calculator_environment_chat_turns():
    env = calculator_environment("chat")
    assert env.stop_strings == () and env.tools[0]["function"]["name"] == "calculator"
    text = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "3*4"}}\n</tool_call>'
    assert env.step(text) == ("12", 0.0, False)
    llama = '{"name": "calculator", "parameters": {"expression": "7/2"}}'
    assert env.step(llama) == ("3.5", 0.0, False)
    assert env.step('{"name": "search", "arguments": {}}')[0] == "error: no tool 'search'; tools: calculator"


def test_parse_chat_tool_call_string_arguments():
    assert parse_chat_tool_call('{"name": "f", "arguments": "{\\"x\\": 1}"}') == ("f", {"x": 1})
    assert parse_chat_tool_call("no call here {not json}") is None


def test_tool_that_raises_or_hangs_gives_an_error_observation():
    def broken(arg):
        raise ValueError("missing\nkey")

    def hangs(arg):
        time.sleep(5)

    assert run_tool(broken, "x", 0.0, "broken") == "error: broken raised ValueError: missing key"
    t0 = time.perf_counter()
    assert run_tool(hangs, "x", 0.1, "hangs") == "error: hangs did not return within 0.1 s"
    assert time.perf_counter() - t0 < 1.0
    env = ToolEnvironment({"hangs": hangs, "broken": broken}, timeout_s=0.1)
    assert env.step("<hangs>1</hangs>")[0] == "<result>error: hangs did not return within 0.1 s</result>\n"
    assert env.step("<broken>1</broken>")[0].startswith("<result>error: broken raised ValueError")
    assert (env.calls, env.errors) == (2, 2)


USER_ENV = """
class Guess:
    stop_strings = ("</guess>",)

    def reset(self, row):
        self.target = row["columns"]["target"]
        return None

    def step(self, text):
        guess = text.rsplit("<guess>", 1)[-1].split("</guess>")[0].strip()
        if guess == self.target:
            return None, 1.0, True
        return "higher\\n" if guess < self.target else "lower\\n", 0.0, False

class NoStep:
    def reset(self, row):
        return None

class BadStep:
    def reset(self, row):
        return None

    def step(self, text):
        return "obs"

class Raises:
    def reset(self, row):
        return None

    def step(self, text):
        raise RuntimeError("boom\\nline two")

value = 3
"""


def test_user_environment_file(tmp_path):
    path = tmp_path / "envs.py"
    path.write_text(USER_ENV)
    env = load_environment("Guess", str(path))()
    assert env.stop_strings == ("</guess>",)
    assert env.reset({"columns": {"target": "5"}}) is None
    assert env.step("<guess>3</guess>") == ("higher\n", 0.0, False)
    assert env.step("<guess>5</guess>") == (None, 1.0, True)


@pytest.mark.parametrize(
    "name, path, call, message",
    [
        ("Guess", "missing.py", None, "environment_path='missing.py' does not exist"),
        (
            "Gues",
            "FILE",
            None,
            "has no class or function 'Gues'; it defines ['Guess', 'NoStep', 'BadStep', "
            "'Raises']. Did you mean 'Guess'?",
        ),
        ("value", "FILE", None, "holds a int as class or function 'value'"),
        ("NoStep", "FILE", None, "environment='NoStep' in FILE has no method step"),
        (
            "BadStep",
            "FILE",
            "step",
            "environment='BadStep' (FILE) step(text) returned 'obs': expected (observation",
        ),
        (
            "Raises",
            "FILE",
            "step",
            "environment='Raises' (FILE) raised RuntimeError in step(text): boom line two",
        ),
        ("", "FILE", None, "environment_path='FILE' needs environment=NAME"),
        ("nope", "", None, "environment='nope': expected one of ['calculator']"),
    ],
)
def test_user_environment_mistakes_are_one_line(tmp_path, name, path, call, message):
    file = tmp_path / "envs.py"
    file.write_text(USER_ENV)
    path = str(file) if path == "FILE" else path
    message = message.replace("FILE", str(file))
    with pytest.raises(ConfigError) as e:
        env = load_environment(name, path)()
        env.reset({})
        getattr(env, call)("text")
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_user_environment_file_that_fails_to_import(tmp_path):
    path = tmp_path / "broken_env.py"
    path.write_text("raise ImportError('no module named foo')\n")
    with pytest.raises(
        ConfigError, match=r"^environment_path='.*broken_env.py': importing it raised ImportError"
    ):
        load_environment("X", str(path))


def test_environment_base_defaults():
    env = Environment()
    assert env.reset({}) is None and env.step("x") == (None, 0.0, True)


CHATML_TOOLS = (
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% elif m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n"
    "{% for c in m.tool_calls %}<tool_call>\n{{ c.function | tojson }}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# Llama 3.1's layout: tools declared in the system turn, a call as the assistant's whole turn
# ({"name": ..., "parameters": ...}), the result in an "ipython" turn, every turn closed by <|eot_id|>.
LLAMA31_TOOLS = (
    "<|begin_of_text|>{% if tools %}<|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n"
    "You have access to the following functions:\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "<|eot_id|>{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'tool' or m.role == 'ipython' %}"
    "<|start_header_id|>ipython<|end_header_id|>\n\n{{ m.content }}<|eot_id|>"
    "{% elif m.role == 'assistant' and m.tool_calls %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{% for c in m.tool_calls %}"
    '{"name": "{{ c.function.name }}", "parameters": {{ c.function.arguments | tojson }}}'
    "{% endfor %}<|eot_id|>"
    "{% else %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content }}<|eot_id|>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


class _Tok:
    """A tokenizer stand-in with a tool template (Qwen-like by default), rendered by jinja as transformers does."""

    def __init__(self, template: str = CHATML_TOOLS):
        self.template = template

    def apply_chat_template(self, messages, tools=None, add_generation_prompt=False, tokenize=False):
        import jinja2

        env = jinja2.Environment()
        env.filters["tojson"] = lambda x: __import__("json").dumps(x)
        return env.from_string(self.template).render(
            messages=messages, tools=tools, add_generation_prompt=add_generation_prompt
        )


def test_chat_observation_is_the_templates_tool_turn():
    text = chat_observation(_Tok(), "12", "<|im_end|>", ())
    assert (
        text == "\n<|im_start|>user\n<tool_response>\n12\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


def test_llama31_tool_format_round_trip():
    # A Llama-3.1-shaped template: the call the template writes is the call parse_chat_tool_call reads, the
    # calculator answers it, and the observation is the template's ipython turn, up to the next assistant turn.
    tok, env = _Tok(LLAMA31_TOOLS), calculator_environment("chat")
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "48 / 2 * 3"}}}
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    rendered = tok.apply_chat_template(messages, tools=list(env.tools))
    assert '"name": "calculator", "description": "Evaluates' in rendered  # the tools are declared
    turn = rendered.split("<|start_header_id|>assistant<|end_header_id|>\n\n")[1]
    assert turn == '{"name": "calculator", "parameters": {"expression": "48 / 2 * 3"}}<|eot_id|>'
    assert parse_chat_tool_call(turn) == ("calculator", {"expression": "48 / 2 * 3"})
    assert env.step(turn) == ("72", 0.0, False)
    assert chat_observation(tok, "72", "<|eot_id|>", env.tools) == (
        "<|start_header_id|>ipython<|end_header_id|>\n\n72<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert env.step("The answer is 72.<|eot_id|>") == (None, 0.0, True)  # no call: the final answer


HANGS = """
import time

class Hangs:
    def __init__(self, where=("step",)):
        self.where = where
        if "init" in self.where:
            time.sleep(30)

    def reset(self, row):
        if "reset" in self.where:
            time.sleep(30)
        return None

    def step(self, text):
        time.sleep(30)
        return None, 0.0, True

def HangsInReset():
    return Hangs(("reset",))

def HangsWhenMade():
    return Hangs(("init",))
"""


@pytest.mark.parametrize(
    "name, call",
    [
        ("Hangs", "step(text)"),
        ("HangsInReset", "reset(row)"),
        ("HangsWhenMade", "HangsWhenMade() (making one"),
    ],
)
def test_a_user_environment_that_never_returns_stops_the_run_in_one_line(tmp_path, name, call):
    """Issue 45: a step that never returned hung the run forever (tool_timeout_seconds covers the built-in
    tools only)."""
    file = tmp_path / "hang_env.py"
    file.write_text(HANGS)
    t0 = time.perf_counter()
    with pytest.raises(ConfigError) as e:
        env = load_environment(name, str(file), environment_timeout_s=0.2)()
        env.reset({})
        env.step("text")
    assert time.perf_counter() - t0 < 2.0
    message = str(e.value)
    assert "\n" not in message and message.startswith(
        f"environment={name!r} ({file}) did not return from {call}"
    )
    assert "environment_timeout_seconds=0.2 (a hang?)" in message, message


def test_environment_timeout_seconds_is_checked_where_it_enters():
    from grpax.tasks import TaskConfig, validate_task_keys

    assert TaskConfig().environment_timeout_seconds == 60.0
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ConfigError, match=r"environment_timeout_seconds=.*: expected a finite number"):
            validate_task_keys(TaskConfig(environment_timeout_seconds=bad))


def test_tool_format_chat_is_refused_when_the_chat_template_ignores_the_tools(tmp_path):
    """Issue 45: SmolLM2's template never reads ``tools``: tool_format=chat trained with no tool in the prompt
    (0 calls, exit 0). A template that declares them (Llama 3.1's) is accepted, and checked once."""
    from grpax.checkpoint.gguf import read_gguf
    from grpax.sampler.multi_turn import render_prompt
    from grpax.tasks import environment
    from grpax.tasks.prompts import get_prompt_preset

    row = {"question": "What is 2 + 3?", "columns": {}}
    preset = get_prompt_preset("plain")
    smollm2 = read_gguf().tokenizer()
    with pytest.raises(ConfigError) as e:
        render_prompt(smollm2, calculator_environment("chat"), row, preset)
    message = str(e.value)
    assert "\n" not in message and message.startswith("tool_format=chat: the chat template")
    assert "['calculator']" in message and message.endswith(
        "use tool_format=tags (the tool's instructions and a worked call go into the system prompt)"
    )
    assert "<calculator>" in render_prompt(smollm2, calculator_environment("tags"), row, preset)

    file = tmp_path / "tool_env.py"
    file.write_text(
        "class WithTools:\n    tools = ({'type': 'function', 'function': {'name': 'lookup'}},)\n"
        "    def reset(self, row):\n        return None\n    def step(self, text):\n        return None, 0.0, True\n"
    )
    with pytest.raises(
        ConfigError, match=r"\['lookup'\].*describe them in the messages your environment's reset"
    ):
        render_prompt(smollm2, load_environment("WithTools", str(file))(), row, preset)

    llama = _Tok(LLAMA31_TOOLS)
    text = render_prompt(llama, calculator_environment("chat"), row, preset)
    assert '"name": "calculator"' in text
    assert len(environment._TOOLS_CHECKED[llama]) == 1
