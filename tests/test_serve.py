"""grpax serve over a real socket with the official ``openai`` client: the tokens, logprobs and versions it
returns are the rollout engine's, requests share the running batch, bad requests get one-line 4xx answers and the
server keeps serving, a client that goes away cancels its rows."""

import http.client
import json
import logging
import socket
import threading
import time

import jax
import numpy as np
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from conftest import tiny_smollm2_config  # noqa: E402

from grpax import serve  # noqa: E402
from grpax.checkpoint.gguf import read_gguf  # noqa: E402
from grpax.checkpoint.orbax import load_model, save_params  # noqa: E402
from grpax.cli.main import main  # noqa: E402
from grpax.compiles import CompileLog  # noqa: E402
from grpax.data.tokenizer import save_tokenizer, stop_token_ids  # noqa: E402
from grpax.models.params import init_params  # noqa: E402
from grpax.models.registry import to_hf_config  # noqa: E402
from grpax.sampler.engine import generate  # noqa: E402
from grpax.sampler.keys import sampler_config  # noqa: E402
from grpax.serve.app import Server  # noqa: E402
from grpax.serve.worker import EngineWorker  # noqa: E402

P, C, SLOTS = 224, 48, 8
MESSAGES = [{"role": "user", "content": "What is 12 * 7?"}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A 2-layer random model with SmolLM2's tokenizer whose weights are scaled so that its distributions are
    peaked (greedy choices without near-ties), saved as a converted checkpoint."""
    folder = tmp_path_factory.mktemp("serve")
    cfg = tiny_smollm2_config()  # conftest's tiny model, its weights scaled below
    params = jax.tree.map(lambda x: x * 8.0 if x.ndim >= 2 else x, init_params(cfg, jax.random.key(0)))
    save_params(params, folder / "0" / "items")
    (folder / "config.json").write_text(json.dumps(to_hf_config(cfg, "float32")))
    save_tokenizer(read_gguf().tokenizer(), folder)
    return folder / "0" / "items"


@pytest.fixture(scope="module")
def model(checkpoint):
    params, cfg, tokenizer = load_model(checkpoint)
    sc = sampler_config(
        P, C, stop_token_ids(tokenizer, cfg), cfg.pad_token_id, max_num_seqs=SLOTS, page_size=16
    )
    return params, cfg, tokenizer, sc


@pytest.fixture(scope="module")
def server(model):
    params, cfg, tokenizer, sc = model
    running = serve.start(Server(EngineWorker(params, cfg, sc), tokenizer, "tiny"))
    yield running
    running.stop()


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def _engine(model, prompt, key, n=1, **sampling):
    """The engine's rollout of ``prompt`` (what grpax generate samples)."""
    params, cfg, _, sc = model
    sc = sc.__class__(**{**sc.__dict__, **sampling})
    return generate(params, [prompt], cfg, sc, key, num_generations=n)


def _chat_prompt(tokenizer):
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def test_models_lists_the_served_model_with_its_length_and_version(client):
    (entry,) = client.models.list().data
    assert entry.id == "tiny"
    assert entry.max_model_len == P + C
    assert entry.policy_version == 0


def test_greedy_chat_returns_the_engines_tokens_logprobs_and_prompt_ids(client, model):
    tokenizer = model[2]
    r = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        temperature=0,
        max_tokens=20,
        logprobs=True,
        top_logprobs=3,
        extra_body={"return_token_ids": True},
    )
    prompt = _chat_prompt(tokenizer)
    assert r.prompt_token_ids == prompt
    out = _engine(model, prompt, jax.random.key(0), greedy=True, max_completion_length=20)
    n = int(out.lengths[0])
    (choice,) = r.choices
    assert choice.token_ids == out.completion_ids[0, :n].tolist()
    lps = [e.logprob for e in choice.logprobs.content]
    np.testing.assert_allclose(lps, out.logprobs[0, :n], rtol=0, atol=1e-5)
    assert choice.message.content == tokenizer.decode(choice.token_ids, skip_special_tokens=True)
    assert choice.finish_reason == out.finish_reason[0]
    assert choice.policy_versions == [0] * n and r.policy_version == 0
    # greedy: the chosen token is the most likely one, and top_logprobs (a scoring forward) says so
    for e in choice.logprobs.content:
        assert len(e.top_logprobs) == 3
        assert e.top_logprobs[0].token == e.token
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob, abs=1e-4)
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob >= e.top_logprobs[2].logprob
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == n


def test_greedy_chat_equals_grpax_generate(client, checkpoint, tmp_path):
    out_path = tmp_path / "gen.jsonl"
    args = [
        "generate",
        f"load_parameters_path={checkpoint}",
        f"prompt={MESSAGES[0]['content']}",
        "max_prefill_predict_length=96",
        "max_completion_length=24",
        f"output_path={out_path}",
    ]
    assert main(args) == 0
    (record,) = [json.loads(line) for line in out_path.read_text().splitlines()]
    r = client.chat.completions.create(
        model="tiny", messages=MESSAGES, temperature=0, max_tokens=24, extra_body={"return_token_ids": True}
    )
    assert r.choices[0].token_ids == record["completion_ids"]
    assert r.choices[0].message.content == record["completion"]


def test_sampled_completions_with_a_seed_are_the_engines_rows(client, model):
    prompt = [1, 17, 402, 9, 33, 5]
    r = client.completions.create(
        model="tiny",
        prompt=prompt,
        n=3,
        temperature=0.8,
        top_p=0.9,
        seed=5,
        max_tokens=16,
        logprobs=0,
        extra_body={"return_token_ids": True, "top_k": 40},
    )
    out = _engine(
        model, prompt, jax.random.key(5), n=3, temperature=0.8, top_p=0.9, top_k=40, max_completion_length=16
    )
    for i, choice in enumerate(r.choices):
        n = int(out.lengths[i])
        assert choice.index == i and choice.prompt_token_ids == prompt
        assert choice.token_ids == out.completion_ids[i, :n].tolist()
        np.testing.assert_allclose(choice.logprobs.token_logprobs, out.logprobs[i, :n], rtol=0, atol=1e-5)
    assert len({tuple(c.token_ids) for c in r.choices}) > 1  # three different samples


def test_streamed_chat_joins_to_the_non_streamed_answer(client):
    kwargs = dict(
        model="tiny", messages=MESSAGES, temperature=0, max_tokens=40, extra_body={"return_token_ids": True}
    )
    whole = client.chat.completions.create(**kwargs)
    text, ids, reasons, usage, prompt_ids = "", [], [], None, None
    for chunk in client.chat.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}
    ):
        if chunk.usage is not None:
            usage = chunk.usage
        if getattr(chunk, "prompt_token_ids", None) is not None:
            prompt_ids = chunk.prompt_token_ids
        for choice in chunk.choices:
            text += choice.delta.content or ""
            ids += getattr(choice, "token_ids", None) or []
            reasons.append(choice.finish_reason)
    assert text == whole.choices[0].message.content
    assert ids == whole.choices[0].token_ids
    assert prompt_ids == whole.prompt_token_ids
    assert reasons[-1] == whole.choices[0].finish_reason and all(r is None for r in reasons[:-1])
    assert usage.completion_tokens == len(ids)


def test_streamed_completion_with_logprobs(client):
    kwargs = dict(model="tiny", prompt="The answer is", temperature=0, max_tokens=30, logprobs=2)
    whole = client.completions.create(**kwargs)
    text, lps = "", []
    for chunk in client.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            text += choice.text
            if choice.logprobs is not None:
                lps += choice.logprobs.token_logprobs
                assert all(len(t) == 2 for t in choice.logprobs.top_logprobs)
    assert text == whole.choices[0].text
    np.testing.assert_allclose(lps, whole.choices[0].logprobs.token_logprobs, atol=1e-6)


def test_stop_strings_cut_the_text_and_keep_the_tokens_up_to_them(client, model):
    tokenizer = model[2]
    prompt = [1, 17, 402, 9, 33, 5]
    base = dict(
        model="tiny", prompt=prompt, temperature=0, max_tokens=40, extra_body={"return_token_ids": True}
    )
    full = client.completions.create(**base).choices[0]
    stop = full.text[12:15]
    assert len(stop) == 3 and full.text.find(stop) >= 3
    for stream in (False, True):
        if stream:
            text, ids, reason = "", [], None
            for chunk in client.completions.create(**base, stop=[stop], stream=True):
                for c in chunk.choices:
                    text += c.text
                    ids += c.token_ids
                    reason = c.finish_reason or reason
        else:
            cut = client.completions.create(**base, stop=[stop]).choices[0]
            text, ids, reason = cut.text, cut.token_ids, cut.finish_reason
        assert text == full.text[: full.text.find(stop)]
        assert reason == "stop"
        k = len(ids)
        assert ids == full.token_ids[:k]
        assert stop in tokenizer.decode(ids) and stop not in tokenizer.decode(ids[:-1])


def test_concurrent_requests_share_the_batch_and_each_gets_its_own_rollout(client, server, model):
    prompts = [[1, 5 + i, 300 + 7 * i, 12, 40 + i] for i in range(6)]
    results = [None] * len(prompts)
    before = server.worker.stats["peak_rows"]
    server.worker.stats["peak_rows"] = 0

    def ask(i):
        results[i] = client.completions.create(
            model="tiny",
            prompt=prompts[i],
            temperature=0,
            max_tokens=C,
            extra_body={"return_token_ids": True},
        )

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, prompt in enumerate(prompts):
        out = _engine(model, prompt, jax.random.key(0), greedy=True)
        assert results[i].choices[0].token_ids == out.completion_ids[0, : out.lengths[0]].tolist()
    assert server.worker.stats["peak_rows"] >= 2  # requests joined a running batch
    server.worker.stats["peak_rows"] = max(before, server.worker.stats["peak_rows"])


@pytest.mark.parametrize(
    ("kwargs", "status", "needle"),
    [
        (
            dict(prompt=list(range(1, P + 2))),
            400,
            f"prompt has {P + 1} tokens, over this server's max_prompt_length={P}",
        ),
        (dict(max_tokens=C + 1), 400, f"max_tokens={C + 1} is over this server's max_completion_length={C}"),
        (dict(model="gpt-4"), 404, "model='gpt-4' does not exist"),
        (dict(temperature=-0.5), 400, "temperature: Input should be greater than or equal to 0"),
        (dict(top_p=0), 400, "top_p: Input should be greater than 0"),
        (dict(n=0), 400, "n: Input should be greater than or equal to 1"),
        (dict(n=SLOTS + 1), 400, f"n={SLOTS + 1} is over this server's max_num_seqs={SLOTS}"),
        (dict(logprobs=21), 400, "logprobs: Input should be less than or equal to 20"),
        (dict(presence_penalty=0.5), 400, "presence_penalty=0.5: grpax serve samples without penalties"),
        (dict(prompt=[1, 10**6]), 400, "prompt token ids must be in 0..49151"),
        (dict(extra_body={"top_k": -3}), 400, "top_k: Input should be greater than or equal to -1"),
        (dict(extra_body={"stream": "maybe"}), 400, "stream: Input should be a valid boolean"),
        (dict(stop=["a", ""]), 400, "stop: Value error, stop strings must be non-empty"),
        (dict(prompt=[[1, 2], "x", 3]), 400, "prompt: Input should be a valid"),
    ],
)
def test_bad_requests_get_one_line_4xx_naming_the_field(client, kwargs, status, needle):
    body = dict(model="tiny", prompt="hi", max_tokens=4)
    body.update(kwargs)
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(**body)
    assert e.value.status_code == status
    message = e.value.body["message"]
    assert needle in message and "\n" not in message, message


def _post(server, path: str, body: bytes, headers=None) -> tuple[int, dict]:
    host, port = server.url.split("//")[1].split("/")[0].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request(
        "POST", f"/v1{path}", body=body, headers={"Content-Type": "application/json", **(headers or {})}
    )
    response = conn.getresponse()
    return response.status, json.loads(response.read())


def test_malformed_json_and_bad_chat_messages_are_400_and_the_server_lives_on(server, client):
    status, body = _post(server, "/chat/completions", b'{"model": "tiny", "messages": [')
    assert status == 400 and body["error"]["message"].startswith("malformed JSON body")
    status, body = _post(server, "/chat/completions", b'{"model": "tiny"}')
    assert status == 400 and body["error"]["message"].startswith("messages: Field required")
    assert body["error"]["param"] == "messages"
    status, body = _post(
        server,
        "/chat/completions",
        json.dumps({"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}).encode(),
    )
    assert status == 400 and "messages[0].role='robot' is not a chat role" in body["error"]["message"]
    status, body = _post(server, "/update_params", b'{"load_parameters_path": "x"}')
    assert status == 403 and "allow_update_params=true" in body["error"]["message"]
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3)
    assert r.choices[0].finish_reason in ("length", "stop")


def test_a_client_that_disconnects_cancels_its_rows(server):
    worker = server.worker
    pages_free = worker.engine.pool.num_free
    cancelled = worker.stats["cancelled"]
    host, port = server.url.split("//")[1].split("/")[0].split(":")
    body = json.dumps(
        {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": C, "n": 4, "temperature": 1.0, "stream": True}
    ).encode()
    sock = socket.create_connection((host, int(port)))
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    received = b""
    while b"data: " not in received:  # the stream started: the rows are in the batch
        received += sock.recv(4096)
    sock.close()
    deadline = time.monotonic() + 30
    while (worker.stats["cancelled"] == cancelled or worker.engine.busy) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert worker.stats["cancelled"] == cancelled + 1
    assert not worker.engine.busy and worker.engine.pool.num_free == pages_free


def test_update_params_swaps_the_policy_and_responses_say_which_version(client, server, model):
    params, cfg, tokenizer, sc = model
    prompt = [1, 17, 402, 9, 33, 5]
    base = dict(
        model="tiny", prompt=prompt, temperature=0, max_tokens=12, extra_body={"return_token_ids": True}
    )
    first = client.completions.create(**base)
    other = jax.tree.map(lambda x: x * 1.3 if x.ndim >= 2 else x, params)
    server.worker.update_params(other, 7)
    try:
        second = client.completions.create(**base)
        assert second.policy_version == 7 and second.choices[0].policy_versions == [7] * len(
            second.choices[0].token_ids
        )
        out = generate(
            other,
            [prompt],
            cfg,
            sc.__class__(**{**sc.__dict__, "greedy": True, "max_completion_length": 12}),
            jax.random.key(0),
        )
        assert second.choices[0].token_ids == out.completion_ids[0, : out.lengths[0]].tolist()
        assert second.choices[0].token_ids != first.choices[0].token_ids
        assert client.models.list().data[0].policy_version == 7
    finally:
        server.worker.update_params(params, 0)


def test_an_api_key_is_required_when_set(server, model):
    _, _, tokenizer, _ = model
    guarded = serve.start(Server(server.worker, tokenizer, "tiny", api_key="s3cret"))
    try:
        bad = openai.OpenAI(base_url=guarded.url, api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        good = openai.OpenAI(base_url=guarded.url, api_key="s3cret", max_retries=0)
        assert good.models.list().data[0].id == "tiny"
    finally:
        guarded.stop(stop_worker=False)


def test_serve_cli_refuses_a_public_host_without_api_key_and_names_the_extra(checkpoint, capsys, monkeypatch):
    load = f"load_parameters_path={checkpoint}"
    assert main(["serve", load, "host=0.0.0.0"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "host=0.0.0.0" in err and "api_key=" in err
    for arg, needle in [
        (
            "hbm_utilization_vllm=1.5",
            "hbm_utilization_vllm=1.5: expected a fraction in [0, 1] of each device's memory (0: off, num_pages",
        ),
        ("page_size=0", "page_size=0: expected >= 1 tokens per page of the KV cache (e.g. 32)"),
        (
            "num_pages=5",
            "num_pages=5: the KV pool holds no sequence of max_target_length = 1536 tokens in pages of "
            "page_size=32; pass num_pages >= 49",
        ),
        ("max_num_seqs=0", "max_num_seqs=0 must be >= 1"),
        ("sampler_programs=fixed", "sampler_programs=fixed: grpax serve runs its own bounded program set"),
        (
            "tool_call_parser=mistral",
            "tool_call_parser='mistral': expected one of hermes, llama3_json, or '' (off)",
        ),
        (
            "hbm_utilization_vllm=0.5",
            "hbm_utilization_vllm=0.5: the cpu devices report no memory size; size the KV",
        ),
        ("max_prefill_prompts=0", "max_prefill_prompts=0 must be >= 1 (1: one prefill program per bucket)"),
        (  # the keys that set the length, as generate names them
            "max_completion_length=100000",
            "max_prefill_predict_length + max_completion_length = 100512 exceeds the model's max_position_embeddings",
        ),
    ]:
        assert main(["serve", load, arg, "warmup=false", "port=0"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and needle in err, err
    monkeypatch.setitem(__import__("sys").modules, "uvicorn", None)
    assert main(["serve", load]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "pip install 'grpax[serve]'" in err


def test_the_serve_keys_set_the_program_set_and_when_it_compiles(checkpoint, monkeypatch):
    """max_prefill_prompts=4 adds the prefills of 2 and 4 prompts per bucket; slot_count_step=1 decodes on every
    count; warmup_in_background=false compiles every program before the port opens, true only the first
    request's (the rest once the engine loop runs); warmup=false none."""
    import uvicorn

    from grpax.serve import worker as worker_module

    runs = []
    warmup = worker_module.EngineWorker.warmup

    def spy(self, background=False):
        runs.append(
            (background, warmup(self, background), len(self._warm), self.engine.sc.max_prefill_prompts)
        )
        return runs[-1][1]

    monkeypatch.setattr(worker_module.EngineWorker, "warmup", spy)
    monkeypatch.setattr(uvicorn, "run", lambda *args, **kwargs: None)
    base = [f"load_parameters_path={checkpoint}", "max_num_seqs=4", "max_prefill_predict_length=64"]
    base += ["max_target_length=72", "port=0"]
    assert main(["serve", *base, "warmup_in_background=false"]) == 0
    assert main(["serve", *base]) == 0
    assert main(["serve", *base, "warmup=false"]) == 0
    # prefill 1 x 64; decodes on 1, 2 and 4 slots (the halvings of 4); top_logprobs' scoring of 64 and 128 tokens
    assert runs == [(False, 6, 0, 1), (True, 2, 4, 1)]
    wider = ["max_prefill_prompts=4", "slot_count_step=1", "warmup_in_background=false"]
    assert main(["serve", *base, *wider]) == 0
    assert runs[-1] == (
        False,
        3 + 4 + 2,
        0,
        4,
    )  # prefills of 1, 2 and 4 prompts; decodes on 1-4 slots; scoring


def test_serve_takes_the_engine_keys_of_the_one_declaration_with_its_own_default_slots(
    checkpoint, monkeypatch, capsys
):
    """ServeConfig's engine keys are EngineKeys' fields (their help, their place in --help); its one default of
    its own, max_num_seqs=32, is the engine's slots, decoded on the halvings (slot_count_step 0), one prompt a
    prefill (max_prefill_prompts 1), on the adaptive program set whatever sampler_programs' auto picks."""
    import dataclasses

    import uvicorn

    from grpax.cli.serve import ServeConfig
    from grpax.config import EngineKeys
    from grpax.serve import worker as worker_module

    served = {f.name: f for f in dataclasses.fields(ServeConfig)}
    for f in dataclasses.fields(EngineKeys):
        assert served[f.name].metadata == f.metadata
        assert served[f.name].default == (32 if f.name == "max_num_seqs" else f.default)
    assert main(["serve", "--help"]) == 0
    listed = capsys.readouterr().out
    for f in dataclasses.fields(EngineKeys):
        assert f"{f.name}={served[f.name].default}" in listed and f.metadata["help"] in listed
    assert listed.index("page_size=") < listed.index("max_num_seqs=32") < listed.index("slot_count_step=")

    engines = []
    monkeypatch.setattr(worker_module.EngineWorker, "start", lambda self: engines.append(self.engine))
    monkeypatch.setattr(uvicorn, "run", lambda *args, **kwargs: None)
    args = [f"load_parameters_path={checkpoint}", "max_prefill_predict_length=64", "max_target_length=72"]
    assert main(["serve", *args, "warmup=false", "port=0"]) == 0
    (engine,) = engines
    assert engine.num_slots == 32 and engine.sc.max_prefill_prompts == 1 and engine.sc.programs == "adaptive"
    decodes = [item.slots for item in worker_module.warmup_plan(engine.sc, engine.num_slots) if item.slots]
    assert decodes == [1, 2, 4, 8, 16, 32]


def test_a_harness_on_the_server_writes_completions_that_grpax_evaluate_scores(
    server, model, tmp_path, capsys
):
    """scripts/serve_complete.py asks GSM8K questions as train_rl renders them (the preset's prefix continued),
    and ``grpax evaluate completions_path=`` scores its file."""
    import subprocess
    import sys
    from pathlib import Path

    from conftest import gsm8k_dir

    from grpax.data.prompts import render_prompt
    from grpax.tasks.prompts import get_prompt_preset

    tokenizer = model[2]
    out = tmp_path / "completions.jsonl"
    repo = Path(__file__).resolve().parents[1]
    script = repo / "scripts" / "serve_complete.py"
    args = ["--base_url", server.url, "--model", "tiny", "--questions", str(gsm8k_dir() / "test.jsonl")]
    args += [
        "--num_questions",
        "3",
        "--n",
        "2",
        "--temperature",
        "0.7",
        "--max_tokens",
        "16",
        "--out",
        str(out),
    ]
    subprocess.run(
        [sys.executable, str(script), *args],
        check=True,
        cwd=repo,
        env={**__import__("os").environ, "PYTHONPATH": str(repo)},
    )
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == 6 and lines[0]["question"] == lines[1]["question"] != lines[2]["question"]
    preset = get_prompt_preset("smollm2_demo")
    rendered = render_prompt(tokenizer, lines[0]["question"], preset)
    assert lines[0]["prompt_token_ids"] == tokenizer.encode(rendered, add_special_tokens=False)
    assert lines[0]["response_prefix"] == preset.response_prefix
    assert len(lines[0]["logprobs"]) == len(lines[0]["token_ids"])
    capsys.readouterr()
    assert main(["evaluate", f"completions_path={out}", "num_eval_passes=2"]) == 0
    printed = capsys.readouterr().out
    assert "num_questions        3" in printed, printed


def test_requests_with_different_sampling_rules_each_get_their_own_rule(client, model):
    """Concurrent requests of three rules: each runs under its own (its rows equal the engine's under that
    rule)."""
    prompt = [1, 17, 402, 9, 33, 5]
    rules = [dict(temperature=0), dict(temperature=0.7, seed=3), dict(temperature=1.0, top_p=0.8, seed=4)]
    results = [None] * len(rules)

    def ask(i):
        results[i] = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=24, extra_body={"return_token_ids": True}, **rules[i]
        )

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(rules))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    engine_rules = [
        (jax.random.key(0), dict(greedy=True)),
        (jax.random.key(3), dict(temperature=0.7)),
        (jax.random.key(4), dict(temperature=1.0, top_p=0.8)),
    ]
    for r, (key, rule) in zip(results, engine_rules, strict=True):
        out = _engine(model, prompt, key, max_completion_length=24, **rule)
        assert r.choices[0].token_ids == out.completion_ids[0, : out.lengths[0]].tolist()
    assert len({tuple(r.choices[0].token_ids) for r in results}) == 3


def test_requests_of_different_temperatures_share_one_batch_and_each_gets_its_solo_rows(
    client, server, model, monkeypatch
):
    """Three requests (temperatures 0.6 and 1.4, and greedy) held until all three are queued, then admitted
    together: in one engine step (three one-prompt prefills, ``max_prefill_prompts`` 1), the same decode calls,
    and each gets exactly the tokens it gets
    alone (its rows sampled by its own rule inside the shared batch; the logprobs to float32 rounding), which
    are the engine's under that rule."""
    worker = server.worker
    prompt = [1, 17, 402, 9, 33, 5]
    rules = [dict(temperature=0.6), dict(temperature=1.4), dict(temperature=0)]

    def ask(i):
        return client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=24,
            seed=21,
            logprobs=0,
            extra_body={"return_token_ids": True},
            **rules[i],
        ).choices[0]

    solo = [ask(i) for i in range(len(rules))]
    held, release = threading.Event(), threading.Event()
    handle = worker._handle

    def hold_then_handle(command):  # the loop takes no submission until the three are queued
        if command[0] == "hold":
            held.set()
            release.wait(60)
        else:
            handle(command)

    monkeypatch.setattr(worker, "_handle", hold_then_handle)
    prefills, peak = worker.engine.stats["prefills"], worker.stats["peak_rows"]
    worker.stats["peak_rows"] = 0
    worker.commands.put(("hold",))
    assert held.wait(60)
    together = [None] * len(rules)

    def ask_into(i):
        together[i] = ask(i)

    threads = [threading.Thread(target=ask_into, args=(i,)) for i in range(len(rules))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while worker.commands.qsize() < len(rules) and time.monotonic() < deadline:
        time.sleep(0.01)
    release.set()
    for t in threads:
        t.join()
    assert worker.engine.stats["prefills"] == prefills + 3  # a prefill each, in one step: one batch
    assert worker.stats["peak_rows"] == len(rules)
    worker.stats["peak_rows"] = max(peak, len(rules))
    engine_rules = [dict(temperature=0.6), dict(temperature=1.4), dict(greedy=True)]
    for alone, shared, rule in zip(solo, together, engine_rules, strict=True):
        assert shared.token_ids == alone.token_ids
        # the first token's logprob comes from a prefill of 1 prompt alone, of 3 together: float32 rounding apart
        np.testing.assert_allclose(
            shared.logprobs.token_logprobs, alone.logprobs.token_logprobs, rtol=0, atol=2e-6
        )
        out = _engine(model, prompt, jax.random.key(21), max_completion_length=24, **rule)
        assert shared.token_ids == out.completion_ids[0, : out.lengths[0]].tolist()
    assert len({tuple(c.token_ids) for c in together}) == 3


def test_grpax_serve_command_serves_until_interrupted(checkpoint, tmp_path):
    """``grpax serve`` in its own process: the model answers /v1/models; SIGINT shuts it down cleanly."""
    import os
    import signal
    import subprocess
    import sys
    import urllib.request
    from pathlib import Path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    repo = Path(__file__).resolve().parents[1]
    args = [f"load_parameters_path={checkpoint}", f"port={port}", "served_model_name=tiny", "max_num_seqs=4"]
    args += ["max_prefill_predict_length=64", "max_target_length=96", "hardware=cpu", "jax_cache_dir="]
    proc = subprocess.Popen(
        [sys.executable, "-m", "grpax", "serve", *args],
        env={**os.environ, "PYTHONPATH": str(repo)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline, models = time.monotonic() + 120, None
        while models is None and time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as r:
                    models = json.loads(r.read())
            except OSError:
                time.sleep(0.5)
        assert models is not None, proc.stderr.read() if proc.poll() is not None else "no answer"
        assert models["data"][0]["id"] == "tiny" and models["data"][0]["max_model_len"] == 96
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err  # uvicorn's graceful shutdown, then the engine loop's
    assert "Finished server process" in err and "Traceback" not in err
    # warmup=true by default: the first request's programs before the port opens, the rest in the background:
    # prefill of 1 prompt x bucket 64, decodes on the halvings of 4 slots (1, 2, 4)
    assert (
        "warm-up: 6 programs (prefill of 1 prompt x 64 tokens; decode on 1 slot; decode on 2 slots; " in err
    )
    assert "2 before the port opens, the rest while the engine has no request" in err


def test_the_update_params_endpoint_loads_a_checkpoint_when_allowed(server, model, checkpoint, tmp_path):
    """allow_update_params: POST /v1/update_params loads a checkpoint of the same model and swaps it in; a bad path
    is a 400 naming the key; the API key guards it."""
    params, cfg, tokenizer, sc = model
    other = jax.tree.map(lambda x: x * 1.3 if x.ndim >= 2 else x, params)
    save_params(other, tmp_path / "other" / "0" / "items")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "other" / name).write_bytes((checkpoint.parents[1] / name).read_bytes())
    guarded = serve.start(
        Server(server.worker, tokenizer, "tiny", api_key="k", load_params=lambda p: load_model(p, cfg)[0])
    )
    try:
        path = str(tmp_path / "other" / "0" / "items")
        auth = {"Authorization": "Bearer k"}
        status, _ = _post(guarded, "/update_params", json.dumps({"load_parameters_path": path}).encode())
        assert status == 401
        status, body = _post(guarded, "/update_params", b'{"load_parameters_path": "/nope"}', auth)
        assert status == 400 and body["error"]["param"] == "load_parameters_path"
        status, body = _post(
            guarded, "/update_params", json.dumps({"load_parameters_path": path, "version": 3}).encode(), auth
        )
        assert status == 200 and body == {"policy_version": 3}
        client = openai.OpenAI(base_url=guarded.url, api_key="k", max_retries=0)
        prompt = [1, 17, 402, 9, 33, 5]
        r = client.completions.create(
            model="tiny", prompt=prompt, temperature=0, max_tokens=12, extra_body={"return_token_ids": True}
        )
        rule = sc.__class__(**{**sc.__dict__, "greedy": True, "max_completion_length": 12})
        out = generate(other, [prompt], cfg, rule, jax.random.key(0))
        assert r.policy_version == 3
        assert r.choices[0].token_ids == out.completion_ids[0, : out.lengths[0]].tolist()
    finally:
        server.worker.update_params(params, 0)
        guarded.stop(stop_worker=False)


def test_after_warmup_requests_of_any_n_length_and_rule_compile_nothing(model, caplog):
    """The warm-up runs the server's whole program set (a prefill per prompt bucket, a decode per slot count,
    every rule as data), logged a line per program, so that requests arriving at different times with prompts of
    3..120 tokens, n of 1..8, different max_tokens and any sampling rule (greedy, temperatures, top-p, top-k)
    trigger no JAX compile: ``n`` is no shape."""
    from grpax.sampler.keys import bucket_lengths, prefill_counts, scoring_lengths

    assert bucket_lengths(512) == (64, 128, 256, 512) and bucket_lengths(100) == (64, 100)
    assert scoring_lengths(128, 12) == (64, 128, 192) and scoring_lengths(50, 14) == (64,)
    assert (
        prefill_counts(1, 32) == [1]
        and prefill_counts(3, 32) == [1, 2, 4]
        and prefill_counts(0, 8) == [1, 2, 4, 8]
    )
    params, cfg, tokenizer, _ = model
    sc = sampler_config(
        128, 12, stop_token_ids(tokenizer, cfg), cfg.pad_token_id, max_num_seqs=8, page_size=16
    )
    worker = EngineWorker(params, cfg, sc)
    with caplog.at_level(logging.INFO, logger="grpax.serve.worker"):
        # prefills of 1 prompt x buckets 64, 128; decodes on the halvings of 8 slots: 1, 2, 4, 8; top_logprobs'
        # scoring of 64, 128 and 192 tokens (the longest sequence, 140, rounded up to 64)
        assert worker.warmup() == 2 + 4 + 3
    lines = [r.getMessage() for r in caplog.records if r.name == "grpax.serve.worker"]
    assert lines[0] == (
        "warm-up: 9 programs (prefill of 1 prompt x 64 tokens; decode on 1 slot; prefill of 1 prompt x 128 tokens; "
        "decode on 2 slots; decode on 4 slots; decode on 8 slots; top_logprobs scoring of 64 tokens; "
        "top_logprobs scoring of 128 tokens; top_logprobs scoring of 192 tokens), 9 before the port opens"
    )
    assert len(lines) == 1 + 9 + 1 and lines[-1].startswith("warm-up: done, 9 programs in ")
    assert lines[1].startswith("warm-up 1/9 (prefill of 1 prompt x 64 tokens): ")
    assert all("memory mappings held" in line for line in lines[1:-1])
    compiles = []

    def count(event, duration, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(duration)

    jax.monitoring.register_event_duration_secs_listener(count)
    running = serve.start(Server(worker, tokenizer, "tiny"))
    try:
        client = openai.OpenAI(base_url=running.url, api_key="unused", max_retries=0, timeout=120)
        rng = np.random.default_rng(0)
        lengths = [3, 120, 17, 64, 65, 9, 100, 40, 33, 128, 5, 77]
        prompts = [rng.integers(1, 1000, n).tolist() for n in lengths]
        results = [None] * len(lengths)

        def ask(i):
            time.sleep(0.05 * (i % 4))  # arrivals spread over the running batch's steps
            results[i] = client.completions.create(
                model="tiny",
                prompt=prompts[i],
                n=1 + i % 8,
                temperature=[0, 1, 0.7][i % 3],
                top_p=[1.0, 0.9][i % 2],
                seed=i,
                extra_body={"return_token_ids": True, "top_k": [0, 0, 0, 40][i % 4]},
                max_tokens=2 + i % 11,
                logprobs=[None, 2][i % 2],  # top_logprobs: a scoring forward of the prompt and completion
            )

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(lengths))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        running.stop()
        jax.monitoring.unregister_event_duration_listener(count)
    assert [len(r.choices) for r in results] == [1 + i % 8 for i in range(len(lengths))]
    assert all(c.token_ids for r in results for c in r.choices)
    assert all(len(t) == 2 for r in results[1::2] for c in r.choices for t in c.logprobs.top_logprobs)
    # Whether these requests overlapped depends on the machine's speed (a quiet one finishes each before the next
    # arrives); sharing the batch is test_concurrent_requests_share_the_batch_...'s claim, this test's is that nothing compiles.
    assert compiles == []


def test_a_background_warmup_runs_the_first_requests_programs_first_and_the_rest_between_requests(
    model, caplog
):
    """warmup(background=True): the one-prompt prefill of the smallest bucket and the decode on one slot before
    it returns; the engine thread runs the others while no request is in flight, then compiles nothing more."""
    params, cfg, tokenizer, _ = model
    sc = sampler_config(
        128, 6, stop_token_ids(tokenizer, cfg), cfg.pad_token_id, max_num_seqs=4, page_size=16
    )
    worker = EngineWorker(params, cfg, sc)
    with caplog.at_level(logging.INFO, logger="grpax.serve.worker"):
        assert worker.warmup(background=True) == 2
        assert [item.describe() for _, item in worker._warm] == [
            "prefill of 1 prompt x 128 tokens",
            "decode on 2 slots",
            "decode on 4 slots",
            "top_logprobs scoring of 64 tokens",
            "top_logprobs scoring of 128 tokens",
            "top_logprobs scoring of 192 tokens",
        ]
        running = serve.start(Server(worker, tokenizer, "tiny"))
        try:
            client = openai.OpenAI(base_url=running.url, api_key="unused", max_retries=0, timeout=120)
            first = client.completions.create(model="tiny", prompt=[5, 6, 7], temperature=0, max_tokens=4)
            deadline = time.monotonic() + 120
            while worker._warm or not any("warm-up: done" in r.getMessage() for r in caplog.records):
                assert time.monotonic() < deadline, "the background warm-up did not end"
                time.sleep(0.1)
            with CompileLog() as compiles:  # the engine thread's compiles too (JAX's listeners are global)
                later = client.completions.create(
                    model="tiny", prompt=list(range(5, 105)), n=3, temperature=0.8, seed=1, max_tokens=6
                )
        finally:
            running.stop()
    assert first.choices[0].text is not None and len(later.choices) == 3 and compiles.programs == []
    lines = [r.getMessage() for r in caplog.records if r.name == "grpax.serve.worker"]
    assert lines[0].endswith("2 before the port opens, the rest while the engine has no request")
    assert [line.split(" (")[0] for line in lines[1:9]] == [f"warm-up {i}/8" for i in range(1, 9)]
    assert len(lines) == 10 and lines[9].startswith("warm-up: done, 8 programs in ")


def test_warmup_runs_the_decode_on_every_slot_count_and_each_bucket_with_one_program_per_shape(
    model, monkeypatch
):
    """With 12 slots the server decodes on the halvings 12, 6, 3 (``slot_count_step`` 0): the warm-up runs the
    decode on each and a one-prompt prefill per bucket, every row's rule as data (no static program); with
    slot_count_step=4 it decodes on 12, 8, 4, 2, 1 instead."""
    import grpax.sampler.engine as engine_module

    params, cfg, tokenizer, _ = model
    seen = {"decode": [], "admit": []}

    def spy(kind, compiled):
        def wrap(backend):
            fn = compiled(backend)

            def call(*args, **kwargs):
                rows = args[2]["token"] if kind == "decode" else args[2]  # slots' tokens [S], prompts [N, P]
                rule = args[3] if kind == "decode" else args[7]
                seen[kind].append((rows.shape[0], rows.shape[-1] if kind == "admit" else 0, rule is None))
                return fn(*args, **kwargs)

            return call

        return wrap

    monkeypatch.setattr(engine_module, "compiled_decode", spy("decode", engine_module.compiled_decode))
    monkeypatch.setattr(engine_module, "compiled_admit", spy("admit", engine_module.compiled_admit))
    for step, slots in ((0, {12, 6, 3}), (4, {12, 8, 4, 2, 1})):
        seen["decode"].clear(), seen["admit"].clear()
        sc = sampler_config(
            100, 4, stop_token_ids(tokenizer, cfg), cfg.pad_token_id, max_num_seqs=12, page_size=16,
            slot_count_step=step,
        )  # fmt: skip
        # buckets 64, 100; the slot counts; top_logprobs' scoring of 64 and 128 tokens
        assert EngineWorker(params, cfg, sc).warmup() == 2 + len(slots) + 2
        assert {S for S, _, _ in seen["decode"]} == slots
        assert {(N, P) for N, P, _ in seen["admit"]} == {(1, 64), (1, 100)}
        assert not any(static for *_, static in seen["decode"] + seen["admit"])


def test_warmup_of_a_one_token_budget_runs(model):
    """max_completion_length=1 (the prefill's token only): the warm-up runs no decode."""
    params, cfg, tokenizer, _ = model
    sc = sampler_config(64, 1, stop_token_ids(tokenizer, cfg), cfg.pad_token_id, max_num_seqs=2, page_size=16)
    assert EngineWorker(params, cfg, sc).warmup() == 1 + 2  # the prefill of 1 prompt x 64 tokens; 2 scorings
    assert EngineWorker(params, cfg, sc).warmup(background=True) == 1


def _serve_one(params, cfg, tokenizer, sc, prompt):
    """The greedy completion token ids of ``prompt`` from a server on these params."""
    running = serve.start(Server(EngineWorker(jax.device_put(params), cfg, sc), tokenizer, "m"))
    try:
        client = openai.OpenAI(base_url=running.url, api_key="unused", max_retries=0, timeout=120)
        r = client.completions.create(
            model="m", prompt=prompt, temperature=0, max_tokens=12, extra_body={"return_token_ids": True}
        )
        return r.choices[0].token_ids
    finally:
        running.stop()


def test_a_hugging_face_folder_is_served_as_its_converted_checkpoint(checkpoint, model, tmp_path):
    """hf_model_path=<a to_huggingface export of the checkpoint>: the same weights (bit for bit), tokenizer and
    greedy answers as the native checkpoint; a folder without config.json is named."""
    from grpax.cli.serve import ServeConfig, load_checkpoint
    from grpax.config import ConfigError, read_model_config

    hf = tmp_path / "hf"
    argv = ["to_huggingface", f"load_parameters_path={checkpoint}", f"base_output_directory={hf}"]
    assert main([*argv, "weight_dtype=float32"]) == 0
    params, cfg, tokenizer, sc = model
    hf_cfg, _ = read_model_config(str(hf), ServeConfig(hf_model_path=str(hf)), P + C, "")
    hf_params, hf_cfg, hf_tokenizer = load_checkpoint(str(hf), hf_cfg, hf=True)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(hf_params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    prompt = _chat_prompt(tokenizer)
    assert hf_tokenizer.encode("What is 12 * 7?") == tokenizer.encode("What is 12 * 7?")
    out = _engine(model, prompt, jax.random.key(0), greedy=True, max_completion_length=12)
    want = out.completion_ids[0, : out.lengths[0]].tolist()
    assert _serve_one(hf_params, hf_cfg, hf_tokenizer, sc, prompt) == want
    from grpax.cli.serve import run

    with pytest.raises(ConfigError, match="hf_model_path=.* holds no config.json"):
        run(ServeConfig(hf_model_path=str(tmp_path)))
    with pytest.raises(ConfigError, match="pass one of load_parameters_path"):
        run(ServeConfig(hf_model_path=str(hf), load_parameters_path=str(checkpoint)))


def test_a_lora_runs_step_is_served_as_its_base_merged_with_the_adapters(checkpoint, model, tmp_path):
    """load_parameters_path=<run>/checkpoints/actor/<step>/model_params of a LoRA run (adapters and the base's
    record, as the trainer writes them): served as base + scale * A @ B, whose greedy answers are the merged
    model's and not the base's; a changed base is refused in one line."""
    import shutil

    from grpax.checkpoint.digests import fingerprint
    from grpax.checkpoint.orbax import restore_params
    from grpax.cli.serve import load_checkpoint
    from grpax.config import ConfigError
    from grpax.models import lora as lora_lib

    params, cfg, tokenizer, sc = model
    lora = lora_lib.LoraConfig(4, 8.0)
    adapters = lora_lib.init_adapters(cfg, lora, jax.random.key(1))
    adapters = jax.tree.map(lambda x: jax.random.normal(jax.random.key(2), x.shape, x.dtype) * 0.5, adapters)
    run_dir = tmp_path / "run" / "checkpoints"
    step = run_dir / "actor" / "3"
    save_params(adapters, step / "model_params")
    base_path = tmp_path / "base" / "0" / "items"
    shutil.copytree(checkpoint.parents[1], tmp_path / "base")
    base = restore_params(base_path)
    meta = dict(rank=4, alpha=8.0, target_modules=list(lora.target_modules), use_rslora=False)
    meta.update(base_path=str(base_path), base_dtype="float32", base_quantization="")
    meta["base_fingerprint"] = fingerprint(base)
    (step / "train_meta").mkdir()
    (step / "train_meta" / "metadata").write_text(json.dumps({"lora": meta}))
    for f in (checkpoint.parents[1]).iterdir():
        if f.is_file():
            shutil.copy(f, run_dir / f.name)

    served, served_cfg, served_tokenizer = load_checkpoint(str(step / "model_params"), cfg)
    merged = lora_lib.merge(params, adapters, lora)
    for a, b in zip(jax.tree.leaves(merged), jax.tree.leaves(served), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6, atol=1e-6)
    prompt = _chat_prompt(tokenizer)
    got = _serve_one(served, served_cfg, served_tokenizer, sc, prompt)
    out = generate(
        merged,
        [prompt],
        cfg,
        sc.__class__(**{**sc.__dict__, "greedy": True, "max_completion_length": 12}),
        jax.random.key(0),
    )
    assert got == out.completion_ids[0, : out.lengths[0]].tolist()
    base_out = _engine(model, prompt, jax.random.key(0), greedy=True, max_completion_length=12)
    assert got != base_out.completion_ids[0, : base_out.lengths[0]].tolist()  # the adapters changed it

    shutil.rmtree(base_path)
    save_params(jax.tree.map(lambda x: x * 1.01, base), base_path)
    with pytest.raises(ConfigError, match="trained on other weights"):
        load_checkpoint(str(step / "model_params"), cfg)


TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def test_tool_call_parsers_read_the_model_formats():
    from grpax.serve.tools import arguments_as_objects, parse_tool_calls, streamable

    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    text += '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    content, calls = parse_tool_calls("hermes", text)
    assert content == "Let me check.\n"
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("function", "get_weather", {"city": "Paris"}),
        ("function", "get_time", {}),
    ]
    assert len({c["id"] for c in calls}) == 2 and all(c["id"].startswith("call_") for c in calls)
    assert parse_tool_calls("hermes", "<tool_call>{not json}</tool_call>") == (
        "<tool_call>{not json}</tool_call>",
        [],
    )
    assert parse_tool_calls("hermes", "no call here") == ("no call here", [])
    content, calls = parse_tool_calls("hermes", '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>')
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"x": 1}
    content, calls = parse_tool_calls(
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "g", "parameters": {}}',
    )
    assert content is None and [c["function"]["name"] for c in calls] == ["get_weather", "g"]
    content, calls = parse_tool_calls("llama3_json", '{"name": "sh", "parameters": {"cmd": "cd /tmp; ls"}};')
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"cmd": "cd /tmp; ls"}
    assert parse_tool_calls("llama3_json", "The answer is {1}.") == ("The answer is {1}.", [])
    assert parse_tool_calls("llama3_json", '{"city": "Oslo"}') == ('{"city": "Oslo"}', [])  # no name: content
    # streaming: a call's start (or what may begin one) is held back
    assert streamable("hermes", "Let me check.<tool") == len("Let me check.")
    assert streamable("hermes", "Let me check.<tool_call>{") == len("Let me check.")
    assert streamable("hermes", "a < b") == len("a < b")
    assert streamable("llama3_json", ' {"name"') == 0 and streamable("llama3_json", "<|pyth") == 0
    assert streamable("llama3_json", "Sunny.") == len("Sunny.")
    # a request's malformed tool_calls reach the template unchanged (it refuses them: a 400), never a crash
    for calls in (["x"], "ab", [{"function": "x"}]):
        assert arguments_as_objects({"role": "assistant", "tool_calls": calls})["tool_calls"] == calls
    message = {
        "role": "assistant",
        "tool_calls": [{"id": "1", "function": {"name": "f", "arguments": '{"a": 1}'}}],
    }
    assert arguments_as_objects(message)["tool_calls"][0]["function"]["arguments"] == {"a": 1}


def _scripted(worker, tokenizer, text, monkeypatch):
    """``worker`` answering every job's rows with ``text`` (two engine steps), without the model."""
    from grpax.serve.worker import Progress, RowUpdate

    ids = tokenizer.encode(text, add_special_tokens=False)
    half = len(ids) // 2

    def submit(job):
        for part, done in ((ids[:half], False), (ids[half:], True)):
            rows = [RowUpdate(r, part, [-0.5] * len(part), [0] * len(part), "stop" if done else None)
                    for r in range(job.num_rows)]  # fmt: skip
            job.loop.call_soon_threadsafe(job.updates.put_nowait, Progress(rows, done=done))

    monkeypatch.setattr(worker, "submit", submit)


def test_tool_calls_come_back_as_openai_tool_calls(model, monkeypatch):
    """tool_call_parser=hermes: a chat request with tools gets the model's calls as tool_calls (finish_reason
    tool_calls), streamed or not; the next turn (the assistant's calls, arguments as text, and the tool's answer)
    renders; without tools, or with tool_choice=none, the text is the content; tool_choice=required is a 400."""
    params, cfg, tokenizer, sc = model
    worker = EngineWorker(params, cfg, sc)
    said = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    _scripted(worker, tokenizer, said, monkeypatch)
    running = serve.start(Server(worker, tokenizer, "tiny", tool_call_parser="hermes"))
    try:
        client = openai.OpenAI(base_url=running.url, api_key="unused", max_retries=0, timeout=120)
        messages = [{"role": "user", "content": "Weather in Paris?"}]
        r = client.chat.completions.create(model="tiny", messages=messages, tools=[TOOL])
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check.\n"
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {
            "city": "Paris"
        }
        content, calls = "", {}
        for chunk in client.chat.completions.create(
            model="tiny", messages=messages, tools=[TOOL], stream=True
        ):
            for c in chunk.choices:
                content += c.delta.content or ""
                for t in c.delta.tool_calls or []:
                    calls[t.index] = (t.function.name, t.function.arguments)
                if c.finish_reason:
                    assert c.finish_reason == "tool_calls"
        assert content == "Let me check.\n" and calls == {0: ("get_weather", '{"city": "Paris"}')}
        follow = [*messages, choice.message.model_dump(exclude_none=True),
                  {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]  # fmt: skip
        again = client.chat.completions.create(model="tiny", messages=follow, tools=[TOOL])
        assert again.choices[0].message.tool_calls[0].function.name == "get_weather"
        for kwargs in ({}, {"tools": [TOOL], "tool_choice": "none"}):
            plain = client.chat.completions.create(model="tiny", messages=messages, **kwargs)
            assert plain.choices[0].message.content == said and not plain.choices[0].message.tool_calls
            assert plain.choices[0].finish_reason == "stop"
        with pytest.raises(openai.BadRequestError, match="tool_choice='required'"):
            client.chat.completions.create(
                model="tiny", messages=messages, tools=[TOOL], tool_choice="required"
            )
    finally:
        running.stop()


def test_the_server_keeps_its_bounded_shapes_where_sampler_programs_would_be_fixed(
    model, monkeypatch, prefill_counts
):
    """On an accelerator the engine's default (``SamplerConfig.programs`` auto) is the fixed program set: every
    prefill of max_num_seqs prompts and one decode slot count. The server has no such key and its own bounded
    shapes (``bounded``, compiled by ``warmup``): a one-prompt request prefills one prompt row, not twelve."""
    import grpax.sampler.engine as engine_module

    params, cfg, tokenizer, _ = model
    sc = sampler_config(
        64, 4, stop_token_ids(tokenizer, cfg), cfg.pad_token_id, max_num_seqs=12, page_size=16
    )
    auto_is_fixed = lambda sampler_cfg, params: sampler_cfg.programs != "adaptive"  # noqa: E731 - as on a TPU
    monkeypatch.setattr(engine_module, "fixed_programs", auto_is_fixed)
    e = EngineWorker(params, cfg, sc).engine
    e.run(e.submit([[5, 6, 7]], jax.random.key(0)))
    assert prefill_counts == [1] and not e.fixed
