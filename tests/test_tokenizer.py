"""Tokenizer folders: save/load round trip of SmolLM2's, stop ids, chat template; all without torch."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import gsm8k_dir
from tokenizers import Tokenizer, models, pre_tokenizers

from grpax.checkpoint import gguf as gg
from grpax.data.tokenizer import load_tokenizer, save_tokenizer, special_tokens, stop_token_ids
from grpax.models.registry import get_model_config


@pytest.fixture(scope="module")
def smollm2():
    try:
        model = gg.read_gguf(gg.default_gguf_path())
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return model.tokenizer(), model.hf_config


def _question() -> str:
    with open(gsm8k_dir() / "test.jsonl") as f:
        return json.loads(f.readline())["question"]


def test_save_load_round_trip(smollm2, tmp_path):
    tok, _ = smollm2
    save_tokenizer(tok, tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "tokenizer.json").is_file()
    assert (tmp_path / "ckpt" / "tokenizer_config.json").is_file()
    loaded = load_tokenizer(tmp_path / "ckpt")
    messages = [{"role": "user", "content": _question()}]
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert loaded.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == prompt
    assert prompt.endswith("<|im_start|>assistant\n")
    assert loaded(prompt)["input_ids"] == tok(prompt)["input_ids"]
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(tmp_path / "ckpt")(prompt)["input_ids"] == tok(prompt)["input_ids"]
    assert len(loaded) == len(tok) == 49152
    special = (loaded.bos_token_id, loaded.eos_token_id, loaded.pad_token_id, loaded.unk_token_id)
    assert special == (1, 2, 2, 0)
    assert loaded.decode(loaded("Janet’s ducks lay 16 eggs")["input_ids"]) == "Janet’s ducks lay 16 eggs"

    code = (
        "import sys\nfrom grpax.data.tokenizer import load_tokenizer\n"
        f"tok = load_tokenizer({str(tmp_path / 'ckpt')!r})\n"
        "print(tok('<|im_start|>user')['input_ids'], 'torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == "False" and out.stdout.startswith("[1, 4093]"), out.stdout


def test_smollm2_stop_ids(smollm2):
    tok, hf = smollm2
    assert tok.convert_tokens_to_ids("<|im_end|>") == 2
    assert stop_token_ids(tok, hf) == (2,)
    assert stop_token_ids(tok) == (2,)
    assert stop_token_ids(tok, get_model_config("smollm2-135m-Instruct")) == (2,)
    assert stop_token_ids(tok, get_model_config("smollm2-135m")) == (0, 2)  # base model's <|endoftext|> first


def test_llama3_style_stop_ids():
    from transformers import PreTrainedTokenizerFast

    vocab = {"a": 0, "b": 1, "<|begin_of_text|>": 2, "<|end_of_text|>": 3, "<|eom_id|>": 4, "<|eot_id|>": 5}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>"
    )
    assert stop_token_ids(tok, {"eos_token_id": [3, 4, 5]}) == (3, 4, 5)
    assert stop_token_ids(tok, {"eos_token_id": 3}) == (3, 5, 4)
    assert stop_token_ids(tok, get_model_config("llama3.1-8b-Instruct")) == (128001, 128008, 128009, 3, 5, 4)


def _ids(tok) -> tuple:
    return tok.eos_token_id, tok.pad_token_id, tok.get_vocab()


def test_special_tokens_read_without_transformers_name_transformers_ids(smollm2, tmp_path):
    """``special_tokens`` (an export's generation_config.json, no transformers import) gives the ids and vocabulary
    transformers' tokenizer gives: SmolLM2's GGUF tokenizer, an AddedToken-dict eos and pad, a special_tokens_map
    that renames them (it wins), and a folder that names neither."""
    from transformers import PreTrainedTokenizerFast

    tok, _ = smollm2
    save_tokenizer(tok, tmp_path / "smollm2")
    assert _ids(special_tokens(tmp_path / "smollm2")) == _ids(load_tokenizer(tmp_path / "smollm2"))
    assert special_tokens(tmp_path / "smollm2")[1:] == (2, 2)

    vocab = {"a": 0, "b": 1, "<s>": 2, "</s>": 3, "<pad>": 4, "<|im_end|>": 5}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    PreTrainedTokenizerFast(tokenizer_object=backend).save_pretrained(str(tmp_path / "plain"))
    (tmp_path / "plain" / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": {"content": "</s>", "special": True, "__type": "AddedToken"},
        "pad_token": "<pad>",
    }))  # fmt: skip
    found = special_tokens(tmp_path / "plain")
    assert found[1:] == (3, 4) and _ids(found) == _ids(PreTrainedTokenizerFast.from_pretrained(tmp_path / "plain"))
    (tmp_path / "plain" / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    found = special_tokens(tmp_path / "plain")
    assert found[1:] == (5, 4) and _ids(found) == _ids(PreTrainedTokenizerFast.from_pretrained(tmp_path / "plain"))
    (tmp_path / "plain" / "tokenizer_config.json").write_text("{}")
    (tmp_path / "plain" / "special_tokens_map.json").unlink()
    assert special_tokens(tmp_path / "plain")[1:] == (None, None)
    assert stop_token_ids(special_tokens(tmp_path / "plain"), {"eos_token_id": 3}) == (3, 5)
    with pytest.raises(FileNotFoundError, match="has no tokenizer.json"):
        special_tokens(tmp_path)


def test_load_tokenizer_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="has no tokenizer.json"):
        load_tokenizer(tmp_path)


def test_no_torch_banner_is_dropped_and_other_warnings_kept(tmp_path):
    """Without torch, ``import transformers`` logs "PyTorch was not found..."; grpax drops that one message."""
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(vocab={"a": 0, "<eos>": 1}, merges=[]))
    save_tokenizer(PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>"), tmp_path)
    hide_torch = "import sys; sys.modules['torch'] = None; import logging; "

    def stderr(code: str) -> str:
        out = subprocess.run(
            [sys.executable, "-c", hide_torch + code], capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, out.stderr
        return out.stderr

    banner = "PyTorch was not found"
    assert banner in stderr("import transformers")  # the control: torch is hidden from transformers
    err = stderr(
        f"from grpax.data.tokenizer import load_tokenizer; load_tokenizer({str(tmp_path)!r}); "
        "logging.getLogger('transformers').warning('another warning')"
    )
    assert banner not in err and "another warning" in err, err
