"""Reading datasets (GSM8K's rows: tasks/gsm8k.py), the resumable prompt iterator, and chat-template prompt
rendering (no downloads)."""

import json
import sys
import time

import pytest
from conftest import gsm8k_dir

from grpax.data import datasets as D
from grpax.data.datasets import DatasetUnavailableError
from grpax.data.iterator import PromptIterator
from grpax.data.prompts import PromptPreset, build_messages, filter_by_length, render_prompt, tokenize_prompts
from grpax.tasks.answers import ANSWER_END, ANSWER_START
from grpax.tasks.gsm8k import extract_gold, load_dataset_rows
from grpax.tasks.gsm8k_rewards import REASONING_END, REASONING_START
from grpax.tasks.prompts import PROMPT_PRESETS, get_prompt_preset


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ---------------------------------------------------------------------------------------------------- loading


def test_all_real_rows_parse():
    train = load_dataset_rows(str(gsm8k_dir()), "train")
    test = load_dataset_rows(str(gsm8k_dir() / "test.jsonl"), "ignored-for-files")
    assert (len(train), len(test)) == (7473, 1319)
    for row in train + test:
        float(row["gold"])  # every gold is a plain number
        assert "," not in row["gold"]
    assert train[0]["gold"] == "72" and train[0]["question"].startswith("Natalia sold clips")
    assert train[1]["gold"] == "10"
    assert test[0]["gold"] == "18"


def test_missing_gsm8k_fails_the_test_naming_where_and_how(tmp_path, monkeypatch):
    monkeypatch.setenv("GRPAX_GSM8K_DIR", str(tmp_path))
    with pytest.raises(
        pytest.fail.Exception, match=rf"no train.jsonl and test.jsonl in GRPAX_GSM8K_DIR={tmp_path};"
    ):
        gsm8k_dir()
    write_jsonl(tmp_path / "train.jsonl", [])
    write_jsonl(tmp_path / "test.jsonl", [])
    assert gsm8k_dir() == tmp_path


@pytest.mark.parametrize(
    "text, expected",
    [
        ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72", "72"),
        ("...\n#### 1,000", "1000"),
        ("...\n#### -5", "-5"),
        ("####  3.5 ", "3.5"),
        ("42", "42"),
        ("2,125", "2125"),
        ("no final line", None),
    ],
)
def test_extract_gold(text, expected):
    assert extract_gold(text) == expected


def test_jsonl_custom_fields_and_folder(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", [{"problem": "1+1?", "solution": "1+1=2\n#### 2"}])
    rows = load_dataset_rows(str(tmp_path), "train", question_field="problem", answer_field="solution")
    assert rows == [{"question": "1+1?", "answer": "1+1=2\n#### 2", "gold": "2"}]


def test_missing_field_names_file_field_and_fix(tmp_path):
    path = write_jsonl(tmp_path / "x.jsonl", [{"question": "q", "answer": "#### 1"}, {"question": "q"}])
    # Rows are counted from 1, as the file's lines: the second line is row 2.
    with pytest.raises(
        ValueError, match=r"x\.jsonl: row 2 has no column 'answer' \(answer_field='answer'\); its columns are"
    ):
        load_dataset_rows(str(path), "train")
    bad = write_jsonl(tmp_path / "y.jsonl", [{"question": "q", "answer": "no marker"}])
    with pytest.raises(ValueError, match=r"y\.jsonl: row 1 .*####"):
        load_dataset_rows(str(bad), "train")


def test_missing_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_dataset_rows(str(tmp_path / "nope.jsonl"), "train")
    with pytest.raises(FileNotFoundError, match=r"main/test-\*\.parquet"):
        load_dataset_rows(str(tmp_path), "test")


def test_parquet_without_pyarrow_says_pip_install(tmp_path, monkeypatch):
    path = tmp_path / "train.parquet"
    path.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ValueError, match="pip install pyarrow"):
        load_dataset_rows(str(path), "train")


def test_parquet_hub_layout(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    (tmp_path / "main").mkdir()
    for i in range(2):
        table = pa.table({"question": [f"q{i}"], "answer": [f"x\n#### {i},000"]})
        pq.write_table(table, tmp_path / "main" / f"train-0000{i}-of-00002.parquet")
    rows = load_dataset_rows(str(tmp_path), "train")
    assert [r["gold"] for r in rows] == ["0000", "1000"]


@pytest.mark.parametrize("var, value", [("HF_DATASETS_OFFLINE", "1"), ("HF_HUB_OFFLINE", "true")])
def test_hub_name_offline_fails_fast(monkeypatch, var, value):
    monkeypatch.setenv(var, value)
    start = time.perf_counter()
    with pytest.raises(DatasetUnavailableError, match=r"openai/gsm8k.*dataset_name=\.\./shared/data/gsm8k"):
        load_dataset_rows("openai/gsm8k", "train")
    assert time.perf_counter() - start < 1.0
    assert issubclass(DatasetUnavailableError, ValueError)


def test_hub_name_unreachable_fails_fast(monkeypatch):
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setitem(sys.modules, "datasets", type(sys)("datasets"))  # a stand-in, never called
    monkeypatch.setattr(D, "_hub_reachable", lambda timeout_s=2.0: False)
    with pytest.raises(DatasetUnavailableError, match="unreachable.*local path"):
        load_dataset_rows("openai/gsm8k", "train")


# --------------------------------------------------------------------------------------------------- iterator


def test_iterator_batches_epochs_and_determinism():
    rows = [{"i": i} for i in range(10)]
    it = PromptIterator(rows, batch_size=3, seed=7)
    assert it.num_batches_per_epoch == 3
    first_epoch = [next(it) for _ in range(3)]
    seen = [r["i"] for b in first_epoch for r in b]
    assert len(set(seen)) == 9  # one row left over, skipped this epoch
    assert it.state_dict() == {"epoch": 0, "index": 9, "seed": 7}
    next(it)
    assert it.state_dict() == {"epoch": 1, "index": 3, "seed": 7}

    again = PromptIterator(rows, batch_size=3, seed=7)
    assert [next(again) for _ in range(3)] == first_epoch
    other = PromptIterator(rows, batch_size=3, seed=8)
    assert [next(other) for _ in range(3)] != first_epoch


def test_iterator_resume_matches_uninterrupted():
    rows = [{"i": i} for i in range(11)]
    full = PromptIterator(rows, batch_size=4, seed=3)
    expected = [[r["i"] for r in next(full)] for _ in range(10)]  # crosses several epochs

    run = PromptIterator(rows, batch_size=4, seed=3)
    got = [[r["i"] for r in next(run)] for _ in range(4)]
    state = json.loads(json.dumps(run.state_dict()))  # as saved in a checkpoint
    resumed = PromptIterator(rows, batch_size=4, seed=0)
    resumed.load_state_dict(state)
    got += [[r["i"] for r in next(resumed)] for _ in range(6)]
    assert got == expected


def test_iterator_rejects_bad_sizes():
    with pytest.raises(ValueError, match="at least batch_size"):
        PromptIterator([{}], batch_size=2)
    with pytest.raises(ValueError, match="batch_size must be"):
        PromptIterator([{}], batch_size=0)


# -------------------------------------------------------------------------------------------------- rendering

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<s>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "hi", "<reasoning>"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", unk_token="<unk>", chat_template=CHAT_TEMPLATE
    )


def test_build_messages():
    assert build_messages("2+2?", "sys", "Q: {question} {not a slot}") == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "Q: 2+2? {not a slot}"},
    ]
    assert build_messages("2+2?", "", "{question}") == [{"role": "user", "content": "2+2?"}]
    assert build_messages("2+2?", "sys", "{question}", system_role=False) == [
        {"role": "user", "content": "sys\n\n2+2?"}
    ]


def test_render_and_tokenize(tokenizer):
    preset = PromptPreset(system_prompt="", user_template="{question}", response_prefix="<reasoning>\n")
    text = render_prompt(tokenizer, "hi", preset)
    assert text == "<s><|user|> hi <|end|> <|assistant|> <reasoning>\n"
    ids = tokenize_prompts(tokenizer, [text, "<s><|user|> hi"])
    assert ids == [[0, 3, 6, 5, 4, 7], [0, 3, 6]]  # one BOS, from the template only
    assert tokenize_prompts(tokenizer, []) == []


def test_render_presets(tokenizer):
    demo = render_prompt(tokenizer, "How many?", get_prompt_preset("smollm2_demo"))
    assert demo.startswith("<s><|system|> ")
    assert "Problem: How many? <|end|> <|assistant|> <reasoning>\n" in demo
    maxtext = render_prompt(tokenizer, "How many?", get_prompt_preset("maxtext"))
    assert maxtext.endswith("<|user|> How many? <|end|> <|assistant|> ")
    for preset in (PROMPT_PRESETS["maxtext"], PROMPT_PRESETS["smollm2_demo"]):  # the GSM8K presets
        for tag in (REASONING_START, REASONING_END, ANSWER_START, ANSWER_END):
            assert tag in preset.system_prompt + preset.user_template
    with pytest.raises(ValueError, match="unknown prompt preset"):
        get_prompt_preset("nope")


def test_filter_by_length(caplog):
    rows = [{"q": 0}, {"q": 1}, {"q": 2}]
    with caplog.at_level("INFO"):
        kept, ids, dropped = filter_by_length(rows, [[1] * 5, [1] * 6, [1] * 4], max_prompt_length=5)
    assert (kept, ids, dropped) == ([{"q": 0}, {"q": 2}], [[1] * 5, [1] * 4], 1)
    assert "dropped 1 of 3" in caplog.text
    with pytest.raises(ValueError, match="same length"):
        filter_by_length(rows, [[1]], 5)


@pytest.mark.parametrize("name", ["data/gsm8kk", "shared/data/gsm8k", "data/gsm8k/train.jsonl"])
def test_mistyped_local_path_is_not_taken_for_a_hub_name(tmp_path, monkeypatch, name):
    """A missing path used to be looked up on the Hub and reported as a missing ``datasets`` library."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    with pytest.raises(FileNotFoundError) as err:
        load_dataset_rows(name, "train")
    assert str(err.value) == (
        f"dataset path {name!r} does not exist (relative to {tmp_path}); pass a .jsonl/.parquet file, a folder "
        "with train.jsonl or train.parquet, or a Hub name owner/name such as openai/gsm8k"
    )


# ----------------------------------------------------------------------------------------------- token cache


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from grpax.checkpoint.gguf import default_gguf_path, read_gguf

    try:
        return read_gguf(default_gguf_path()).tokenizer()
    except FileNotFoundError as e:
        pytest.skip(str(e))


def _gsm8k_slice(split: str, count: int) -> list[dict]:
    return load_dataset_rows(str(gsm8k_dir()), split)[:count]


def test_a_second_run_reads_the_same_prompts_ids_and_drops_from_the_token_cache(
    smollm2_tokenizer, tmp_path, caplog, monkeypatch
):
    """prepare_rows with a cache: the first run stores the ids, the second reads them without tokenizing; both
    give the rows, ids and dropped counts (in the log line) of a run without the cache, and the cached ids are
    SmolLM2's tokenizer's own."""
    import grpax.data.prompts as prompts
    from grpax.data.prompts import prepare_rows

    rows = _gsm8k_slice("test", 300)
    preset = get_prompt_preset("smollm2_demo")

    def run(cache_dir):
        caplog.clear()
        with caplog.at_level("INFO", logger="grpax.train"):
            out = prepare_rows(
                smollm2_tokenizer, "gsm8k", "test", preset, 180, load=lambda d, s: [dict(r) for r in rows],
                cache_dir=cache_dir,
            )  # fmt: skip
        line = [r.getMessage() for r in caplog.records if r.name == "grpax.train"]
        return [(r["question"], r["prompt_ids"]) for r in out], line

    plain = run(None)
    assert "gsm8k/test: " in plain[1][0] and "0 longer" not in plain[1][0]  # some prompts are dropped at 180
    texts = [render_prompt(smollm2_tokenizer, r["question"], preset) for r in rows]
    by_text = dict(zip(texts, smollm2_tokenizer(texts, add_special_tokens=False)["input_ids"], strict=True))
    assert all(ids == by_text[render_prompt(smollm2_tokenizer, q, preset)] for q, ids in plain[0])
    assert run(tmp_path) == plain
    assert len(list(tmp_path.glob("*.npz"))) == 1
    monkeypatch.setattr(prompts, "tokenize_prompts", lambda *a: pytest.fail("tokenized again"))
    assert run(tmp_path) == plain


def test_the_token_cache_keys_on_tokenizer_and_texts_and_survives_a_bad_file(
    smollm2_tokenizer, tokenizer, tmp_path
):
    from grpax.data.token_cache import cache_folder, cache_key, cached_token_ids

    texts = [r["question"] for r in _gsm8k_slice("train", 20)]
    key = cache_key(smollm2_tokenizer, texts)
    assert key != cache_key(tokenizer, texts)  # another tokenizer
    assert (
        key != cache_key(smollm2_tokenizer, texts[:-1]) != cache_key(smollm2_tokenizer, ["".join(texts[:2])])
    )
    calls = []

    def tokenize(t):
        calls.append(len(t))
        return tokenize_prompts(smollm2_tokenizer, t)

    expected = tokenize_prompts(smollm2_tokenizer, texts)
    assert cached_token_ids(smollm2_tokenizer, texts, tokenize, str(tmp_path)) == expected
    (tmp_path / f"{key}.npz").write_bytes(b"cut short")  # a damaged file: tokenized and stored again
    assert cached_token_ids(smollm2_tokenizer, texts, tokenize, str(tmp_path)) == expected
    assert cached_token_ids(smollm2_tokenizer, texts, tokenize, str(tmp_path)) == expected
    assert calls == [20, 20]
    (tmp_path / "file").write_text("")  # an unwritable folder: tokenized, never an error
    assert cached_token_ids(smollm2_tokenizer, texts, tokenize, str(tmp_path / "file")) == expected
    assert cache_folder("") is None and cache_folder("/x/jax") == "/x/jax/tokens"
