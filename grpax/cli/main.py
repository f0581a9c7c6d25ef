"""The ``grpax`` console command: ``grpax <command> key=value ...`` (MaxText-style keys).

Each command lives in ``grpax/cli/<command>.py`` and exposes ``CONFIG`` (its frozen dataclass of keys),
``DESCRIPTION`` (one paragraph) and ``run(config) -> int`` (and may set ``INTERRUPT_HINT``, said after an
interruption). This module only dispatches, prints ``--help``, turns expected errors into one-line messages with
a non-zero exit, and ends an interrupted command (SIGINT, SIGTERM) with one line and exit 130 / 143.
"""

from __future__ import annotations

import importlib
import logging
import os
import signal
import sys
from typing import NoReturn

from grpax import interrupts
from grpax.config import ConfigError, build_config, describe, suggest
from grpax.host_memory import limit_heap_blocks, watch_memory_mappings

COMMANDS = {
    "to_native": "convert a Hugging Face checkpoint (folder, Hub or GGUF) to a grpax Orbax checkpoint",
    "to_huggingface": "export a grpax checkpoint to Hugging Face format (config, tokenizer, safetensors)",
    "generate": "sample completions from a checkpoint with the KV-cache sampler",
    "evaluate": "score a checkpoint (or a completions file) on a task's test split (GSM8K by default)",
    "train_rl": "GRPO training on GSM8K (the main job) or your own task",
    "serve": "an OpenAI-compatible server (token ids, logprobs, policy version) on the rollout engine",
}

# Errors a user can fix; anything else is a bug and keeps its traceback.
USER_ERRORS: tuple[type[BaseException], ...] = (
    ConfigError,
    FileNotFoundError,
    FileExistsError,
    NotADirectoryError,
    IsADirectoryError,
    KeyError,
    ValueError,
    OSError,  # a read-only or full disk, a missing or unreadable file: the message names the file
)


def select_platform(hardware: str) -> str:
    """Points JAX at ``hardware`` (``grpax.cli.common.select_hardware``; a JAX_PLATFORMS set wins) and checks
    that the platform exists: the one place a command's ``hardware`` key is acted on (before the command runs,
    before JAX starts a backend).

    Returns:
      ``describe_devices()``: the platform, device kind and count the command runs on.

    Raises:
      ConfigError: an unknown value, or no such device (one line instead of JAX's traceback).
    """
    import os

    import jax

    from grpax.cli.common import attached_accelerators, describe_devices, select_hardware

    select_hardware(hardware)
    if os.environ.get("JAX_PLATFORMS"):
        jax.config.update("jax_platforms", os.environ["JAX_PLATFORMS"])
    try:
        jax.devices()
    except Exception as e:  # noqa: BLE001 - JAX raises RuntimeError or AssertionError here
        extra = {"gpu": "cuda", "gpu_multiprocess": "cuda", "tpu": "tpu"}.get(hardware)
        hint = f'install the accelerator build (pip install -e ".[{extra}]") or ' if extra else ""
        raise ConfigError(
            f"hardware={hardware}: JAX finds no such device ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:120] if str(e) else 'backend failed to start'}); "
            f"{hint}pass hardware=cpu"
        ) from None
    if hardware == "auto" and jax.default_backend() == "cpu" and os.environ.get("JAX_PLATFORMS") != "cpu":
        logging.getLogger("grpax").warning(
            "hardware=auto: an accelerator is attached (%s) but JAX found none and runs on the CPU: another "
            'process may hold it, or its JAX build is missing (pip install -e ".[tpu]" or ".[cuda]"); '
            "hardware=cpu says the CPU is meant",
            ", ".join(attached_accelerators()[:2]),
        )
    return describe_devices()


class _FirstLine(logging.Filter):
    """Logs ``line`` just before the first record a handler emits (then passes every record)."""

    def __init__(self, line: str):
        super().__init__()
        self.line: str | None = line

    def filter(self, record: logging.LogRecord) -> bool:
        if self.line is not None:
            line, self.line = self.line, None
            logging.getLogger("grpax").info("%s", line)
        return True


def announce(line: str) -> None:
    """Makes ``line`` (the platform, device kind and count a command runs on) the first line the command logs:
    a command that stops at a bad key before logging anything prints its one-line error alone."""
    for handler in logging.getLogger().handlers:
        handler.addFilter(_FirstLine(line))
        break


def usage() -> str:
    lines = ["usage: grpax <command> [config.yml] key=value ...", "", "commands:"]
    lines += [f"  {name:<15} {text}" for name, text in COMMANDS.items()]
    lines += ["", "grpax <command> --help lists the keys of a command."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    # MaxText spells commands as modules (python -m maxtext...train_rl); accept "train_rl" or "rl.train_rl".
    name = argv[0].rsplit(".", 1)[-1].replace("-", "_")
    if name not in COMMANDS:
        print(f"grpax: unknown command {argv[0]!r}.{suggest(name, COMMANDS)}\n\n{usage()}", file=sys.stderr)
        return 2
    limit_heap_blocks()  # before the command imports JAX and XLA starts its threads
    module = importlib.import_module(f"grpax.cli.{name}")
    rest = argv[1:]
    if any(a in ("-h", "--help") for a in rest):
        try:  # show the values a run would use: defaults with the model's preset (and any given keys) applied
            shown = build_config(module.CONFIG, [a for a in rest if a not in ("-h", "--help")])
            note = "keys (values with the preset of model_name applied, from grpax/configs/<preset>.yml):"
        except ConfigError:
            shown, note = None, "keys:"
        print(
            f"usage: grpax {name} [config.yml] key=value ...\n\n{module.DESCRIPTION}\n\n{note}\n"
            f"{describe(module.CONFIG, shown)}"
        )
        return 0
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S", force=True
    )
    # Orbax logs every file it writes, and its probes, at INFO / WARNING.
    logging.getLogger("absl").setLevel(logging.ERROR)
    try:
        with interrupts.handled():
            config = build_config(module.CONFIG, rest)
            if getattr(config, "debug", False):  # MaxText's key
                logging.getLogger("grpax").setLevel(logging.DEBUG)
            hardware = getattr(config, "hardware", None)
            topology = getattr(config, "compile_topology", "")
            if topology:
                # Compile-only (MaxText's train_compile): the slice's devices come from libtpu, so the host
                # needs no accelerator, whatever `hardware` the run's own command names.
                hardware = "cpu"
            if hasattr(config, "xla_optimization_level"):
                from grpax.cli.common import set_optimization_level

                set_optimization_level(config.xla_optimization_level)
            if hardware:
                where = select_platform(hardware)
                if topology:
                    where = f"{topology}'s compiler (compile only; this host: {where})"
                elif hardware == "auto":
                    where += " (hardware=auto)"
                announce(f"grpax {name} on {where}")
                if not getattr(config, "compile_topology", ""):  # a slice's programs never run here
                    from grpax.cli.common import enable_compilation_cache

                    enable_compilation_cache(getattr(config, "jax_cache_dir", "auto"))
            watch_memory_mappings()  # a warning before XLA's JIT runs out of them
            return int(module.run(config) or 0)
    except USER_ERRORS as e:
        if os.environ.get("GRPAX_DEBUG", "") not in ("", "0"):
            raise
        # ConfigError is always the user's to fix; the others may come from a bug, so say how to see where.
        hint = "" if isinstance(e, ConfigError) else " (GRPAX_DEBUG=1 shows the traceback)"
        print(f"grpax {name}: error: {e}{hint}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        hint = getattr(e, "hint", getattr(module, "INTERRUPT_HINT", ""))  # a command's own, if it set one
        exit_interrupted(name, getattr(e, "signum", signal.SIGINT), hint)


def exit_interrupted(name: str, signum: int, hint: str) -> NoReturn:
    """Prints one line and ends the process with 128 + ``signum`` (130 for SIGINT, 143 for SIGTERM).

    ``os._exit`` skips the interpreter's teardown, which races native threads still running (an XLA compilation,
    Orbax's writers) into a segmentation fault or thread tracebacks (``grpax.interrupts``); everything the
    command had to finish (a checkpoint save) is finished or abandoned by now.
    """
    sys.stdout.flush()
    # A new line first: a progress bar may hold the current one.
    print(f"\ngrpax {name}: interrupted ({signal.Signals(signum).name}){hint}", file=sys.stderr, flush=True)
    os._exit(128 + signum)


if __name__ == "__main__":
    sys.exit(main())
