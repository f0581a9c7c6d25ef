"""Tokenizers of checkpoint folders: load, save, chat template and the ids that end a turn.

Thin wrappers over transformers' fast (Rust ``tokenizers``) tokenizers, which need no torch. A GGUF file's
tokenizer comes from ``grpax.checkpoint.gguf.GGUFModel.tokenizer`` and is saved here like any other.
Generation stops at any of ``stop_token_ids``: chat models end a turn with a token (``<|im_end|>`` for
SmolLM2, ``<|eot_id|>`` for Llama 3) that is not always the config's ``eos_token_id``.
"""

from __future__ import annotations

import json
import os
from typing import Any, NamedTuple

# End-of-turn tokens of the supported chat templates (ChatML, Llama 3 turn end and tool-call end).
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>")


def load_tokenizer(folder: str | os.PathLike):
    """Loads the fast tokenizer saved in a checkpoint folder (``tokenizer.json`` + ``tokenizer_config.json``).

    Args:
      folder: a local folder (Hugging Face layout).

    Returns:
      A ``transformers.PreTrainedTokenizerFast`` (with its chat template when the folder has one).

    Raises:
      FileNotFoundError: if the folder or its ``tokenizer.json`` is missing.
    """
    # Not AutoTokenizer: it imports transformers' config machinery, which imports torch. The generic class reads
    # the whole pipeline from tokenizer.json and the special tokens and template from tokenizer_config.json.
    from transformers import PreTrainedTokenizerFast

    folder = os.fspath(folder)
    if not os.path.isfile(os.path.join(folder, "tokenizer.json")):
        raise FileNotFoundError(
            f"{folder} has no tokenizer.json: pass a Hugging Face checkpoint folder, or a "
            ".gguf file whose tokenizer grpax builds (grpax.checkpoint.gguf)"
        )
    try:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(folder, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception on a damaged file
        reason = " ".join(str(e).split())[:160] or type(e).__name__
        raise ValueError(
            f"{os.path.join(folder, 'tokenizer.json')} (or tokenizer_config.json beside it) cannot be read "
            f"({reason}): copy the model's tokenizer files there again"
        ) from None
    check_chat_template(tokenizer, folder)
    return tokenizer


class SpecialTokens(NamedTuple):
    """The ids a folder's tokenizer names, read with ``tokenizers`` alone (no transformers import): what
    ``stop_token_ids`` and an export's generation_config.json need of a tokenizer."""

    vocab: dict[str, int]  # token -> id, added tokens included
    eos_token_id: int | None
    pad_token_id: int | None

    def get_vocab(self) -> dict[str, int]:
        return self.vocab


def special_tokens(folder: str | os.PathLike) -> SpecialTokens:
    """The eos and pad ids and the vocabulary of a folder's ``tokenizer.json``, the tokens named as transformers
    names them: ``tokenizer_config.json``'s ``eos_token`` / ``pad_token`` (a string or an AddedToken dict),
    ``special_tokens_map.json``'s where it has them (it wins, as in transformers' ``from_pretrained``).

    Raises:
      FileNotFoundError: if the folder has no ``tokenizer.json``.
    """
    from tokenizers import Tokenizer

    folder = os.fspath(folder)
    path = os.path.join(folder, "tokenizer.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{folder} has no tokenizer.json: pass a Hugging Face checkpoint folder")
    tokenizer = Tokenizer.from_file(path)
    named: dict[str, Any] = {}
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if os.path.isfile(os.path.join(folder, name)):
            with open(os.path.join(folder, name)) as f:
                named.update({k: v for k, v in json.load(f).items() if k in ("eos_token", "pad_token") and v})

    def token_id(key: str) -> int | None:
        token = named.get(key)
        token = token.get("content") if isinstance(token, dict) else token
        return None if token is None else tokenizer.token_to_id(token)

    return SpecialTokens(tokenizer.get_vocab(with_added_tokens=True), token_id("eos_token"), token_id("pad_token"))


def check_chat_template(tokenizer: Any, folder: str) -> None:
    """Raises ValueError naming the file and line when the folder's chat template is not valid Jinja.

    Checked at load, before any model: rendering a broken template raised jinja2's TemplateSyntaxError (a
    traceback) at the first prompt.
    """
    import jinja2
    import jinja2.ext
    import jinja2.sandbox

    templates = tokenizer.chat_template
    if not templates:
        return
    named = templates.items() if isinstance(templates, dict) else [("", templates)]
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(extensions=[jinja2.ext.loopcontrols])
    jinja_file = os.path.join(folder, "chat_template.jinja")
    where = jinja_file if os.path.isfile(jinja_file) else os.path.join(folder, "tokenizer_config.json")
    for name, text in named:
        try:
            env.parse(text)
        except jinja2.TemplateSyntaxError as e:
            what = f"chat template {name!r}" if name else "chat template"
            raise ValueError(
                f"{where}: the {what} is not valid Jinja at its line {e.lineno} ({e.message}): copy the model's "
                "tokenizer files there again"
            ) from None


def save_tokenizer(tokenizer: Any, folder: str | os.PathLike) -> None:
    """Writes ``tokenizer.json``, ``tokenizer_config.json`` and the chat template into ``folder`` (created).

    transformers 5 records ``tokenizer_class: TokenizersBackend``, a class transformers 4 (and vLLM builds
    pinned to it) cannot import; the file is rewritten to ``PreTrainedTokenizerFast``, which both load.
    """
    os.makedirs(folder, exist_ok=True)
    tokenizer.save_pretrained(os.fspath(folder))
    config_path = os.path.join(os.fspath(folder), "tokenizer_config.json")
    if os.path.exists(config_path):
        with open(config_path) as f:
            config = json.load(f)
        if config.get("tokenizer_class") in (None, "TokenizersBackend"):
            config["tokenizer_class"] = "PreTrainedTokenizerFast"
            with open(config_path, "w") as f:
                json.dump(config, f, indent=2, ensure_ascii=False)


def _config_eos_ids(config: Any) -> tuple[int, ...]:
    if config is None:
        return ()
    if isinstance(config, dict):
        eos = config.get("eos_token_id")
    else:  # grpax ModelConfig
        eos = getattr(config, "eos_token_ids", None)
    if eos is None:
        return ()
    return tuple(int(i) for i in eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def stop_token_ids(tokenizer: Any, config: Any = None) -> tuple[int, ...]:
    """Every id that ends an answer: the config's eos ids, the tokenizer's eos, and chat end-of-turn tokens.

    Args:
      tokenizer: a transformers tokenizer, or ``special_tokens``' record.
      config: a Hugging Face config.json dict (``eos_token_id`` int or list), a grpax ``ModelConfig``
        (``eos_token_ids``), or None.

    Returns:
      The distinct ids, config ids first, then the tokenizer's eos, then those of ``END_OF_TURN_TOKENS``
      that are in the vocabulary.
    """
    ids = list(_config_eos_ids(config))
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    vocab = tokenizer.get_vocab()
    ids += [int(vocab[token]) for token in END_OF_TURN_TOKENS if token in vocab]
    return tuple(dict.fromkeys(ids))
