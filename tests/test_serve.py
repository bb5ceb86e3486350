"""``groupwise serve``: the OpenAI client unchanged against our server, seeded determinism, served
log-probs equal to the model's own, versioned weight loading, pause/resume, 4xx for bad requests,
and a bounded load test (1,000 malformed requests + concurrent clients) after which it still serves."""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx2")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from groupwise.seeds import sample_seed  # noqa: E402
from groupwise.serve import Running, build_server  # noqa: E402


@pytest.fixture(scope="module")
def served():
    server = build_server("default", ["threads=1"])
    running = Running(server)
    yield running
    running.stop()


@pytest.fixture()
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)


def _model_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """[T] log π(token_t | prompt, tokens_<t) from one plain forward of the model (temperature 1)."""
    ids = torch.tensor([prompt + tokens])  # [1,L+T]
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()  # [T,V]
    return logits.log_softmax(-1).gather(1, torch.tensor(tokens)[:, None]).squeeze(1)  # [T]


def test_openai_client_completions_seeded_and_logprobs_are_the_models(served, client):
    kwargs = dict(model="default", prompt="What is 3+4?", n=4, max_tokens=6, logprobs=0)
    ids = {"return_token_ids": True}
    a = client.completions.create(seed=11, extra_body=ids, **kwargs)
    b = client.completions.create(seed=11, extra_body=ids, **kwargs)
    c = client.completions.create(seed=12, extra_body=ids, **kwargs)
    rows = lambda out: [ch.model_extra["token_ids"] for ch in out.choices]  # noqa: E731
    assert rows(a) == rows(b)  # same seed, same tokens
    assert rows(a) != rows(c)  # another seed draws other samples (4 rows of up to 6 tokens: a tie is ~impossible)
    assert a.model_extra["policy_version"] == 0
    model, prompt = served.server.policy.module, a.choices[0].model_extra["prompt_token_ids"]
    for choice in a.choices:
        tokens = choice.model_extra["token_ids"]
        assert len(choice.logprobs.token_logprobs) == len(tokens) >= 1
        expected = _model_logprobs(model, prompt, tokens)  # [T]
        torch.testing.assert_close(torch.tensor(choice.logprobs.token_logprobs), expected, atol=1e-4, rtol=0)
        eos = served.server.policy.eos
        assert (choice.finish_reason == "stop") == (tokens[-1] in eos)


def test_row_seeds_give_the_local_engines_tokens(served, client):
    """The trainer's per-row seeds: the served rows are the ones the local engine samples."""
    policy = served.server.policy
    prompts = [policy.encode("What is 1+2?"), policy.encode("What is 10+25?")]
    seeds = [sample_seed(0, 3, key, j) for key in (5, 9) for j in range(3)]  # [B*n] as LMPolicy.generate draws
    local = policy.engine.generate(prompts, 3, torch.tensor(seeds), 6)
    out = client.completions.create(
        model="default", prompt=prompts, n=3, max_tokens=6, logprobs=0, extra_body={"row_seeds": seeds}
    )
    assert [ch.index for ch in out.choices] == list(range(6))  # choice b*n + j is row j of prompt b
    for i, ch in enumerate(out.choices):
        b, j = divmod(i, 3)
        n = int(local.lengths[b, j])
        assert ch.logprobs.token_logprobs == local.logp[b, j, :n].tolist()
        assert policy.tokenizer.decode(local.tokens[b, j, :n].tolist(), skip_special_tokens=True) == ch.text


def test_openai_client_chat(client):
    kw = dict(model="default", messages=[{"role": "user", "content": "What is 2+2?"}], n=2, max_tokens=5)
    a = client.chat.completions.create(seed=5, logprobs=True, **kw)
    b = client.chat.completions.create(seed=5, logprobs=True, **kw)
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert all(c.message.role == "assistant" and len(c.logprobs.content) >= 1 for c in a.choices)
    with pytest.raises(openai.BadRequestError, match="stream"):
        client.chat.completions.create(stream=False, **{**kw, "n": 1}, extra_body={"stream": True})


def test_load_weights_versioned_and_refusals(served, tmp_path):
    from safetensors.torch import save_file

    url, server = served.url, served.server
    module = server.policy.module
    original = {k: v.clone() for k, v in module.state_dict().items()}
    prompt = {"prompt": "What is 3+4?", "n": 2, "max_tokens": 6, "seed": 1, "logprobs": 0}
    before = httpx.post(url + "/v1/completions", json=prompt).json()
    try:
        twin = copy.deepcopy(module)  # perturbed through its parameters: tied weights stay tied
        with torch.no_grad():
            for p in twin.parameters():
                p.add_(0.05 * torch.randn_like(p))
        changed = {k: v.clone() for k, v in twin.state_dict().items()}
        save_file(changed, str(tmp_path / "w.safetensors"))
        r = httpx.post(url + "/v1/load_weights", json={"path": str(tmp_path / "w.safetensors")})
        assert r.status_code == 200 and r.json() == {"version": 1}  # 0 + 1
        assert all(torch.equal(module.state_dict()[k], changed[k]) for k in changed)
        after = httpx.post(url + "/v1/completions", json=prompt).json()
        assert after["policy_version"] == 1
        assert [c["logprobs"]["token_logprobs"] for c in after["choices"]] != [
            c["logprobs"]["token_logprobs"] for c in before["choices"]
        ]
        torch.save(original, tmp_path / "w.pt")
        r = httpx.post(url + "/v1/load_weights", json={"path": str(tmp_path / "w.pt"), "version": 7})
        assert r.json() == {"version": 7}
        again = httpx.post(url + "/v1/completions", json=prompt).json()
        assert again["choices"] == before["choices"] and again["policy_version"] == 7  # the same weights, same rows
        # refusals: a 400 naming the problem; the weights and version stay
        save_file({"nope": torch.zeros(2)}, str(tmp_path / "bad.safetensors"))
        for body, words in [
            ({"path": str(tmp_path / "missing")}, "neither a model folder"),
            ({"path": str(tmp_path / "bad.safetensors")}, "missing"),
            ({"path": str(tmp_path / "w.pt"), "version": -1}, "version"),
            ({"file": "x"}, "path"),
        ]:
            r = httpx.post(url + "/v1/load_weights", json=body)
            assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
        assert httpx.get(url + "/health").json()["version"] == 7
    finally:
        module.load_state_dict(original)
        server.version = 0


def test_pause_holds_generation_until_resume(served):
    url = served.url
    assert httpx.post(url + "/pause").json()["paused"] is True
    done = []
    worker = threading.Thread(
        target=lambda: done.append(httpx.post(url + "/v1/completions", json={"prompt": "1+1", "max_tokens": 2}))
    )
    worker.start()
    time.sleep(0.5)
    assert not done and httpx.get(url + "/health").json()["paused"] is True
    httpx.post(url + "/resume")
    worker.join(timeout=30)
    assert done and done[0].status_code == 200


def test_exception_in_one_request_is_a_500_and_the_server_goes_on(served, monkeypatch):
    engine = served.server.policy.engine
    real = engine.generate

    def broken(*args, **kwargs):
        raise RuntimeError("engine fell over")

    monkeypatch.setattr(engine, "generate", broken)
    r = httpx.post(served.url + "/v1/completions", json={"prompt": "1+1", "max_tokens": 2})
    assert r.status_code == 500 and "engine fell over" in r.json()["error"]["message"]
    monkeypatch.setattr(engine, "generate", real)
    assert httpx.post(served.url + "/v1/completions", json={"prompt": "1+1", "max_tokens": 2}).status_code == 200


MALFORMED = [
    (b"{not json", "application/json"),
    (b"[]", "application/json"),
    (b'{"prompt": 5}', "application/json"),
    (b'{"prompt": "hi", "n": 0}', "application/json"),
    (b'{"prompt": "hi", "n": 100000}', "application/json"),
    (b'{"prompt": "hi", "max_tokens": -3}', "application/json"),
    (b'{"prompt": "hi", "max_tokens": 100000}', "application/json"),
    (b'{"prompt": [[99999999]]}', "application/json"),
    (b'{"prompt": [[]]}', "application/json"),
    (b'{"prompt": "hi", "temperature": -1}', "application/json"),
    (b'{"prompt": "hi", "top_p": 0}', "application/json"),
    (b'{"prompt": "hi", "stream": true}', "application/json"),
    (b'{"prompt": "hi", "stop": ["x"]}', "application/json"),
    (b'{"prompt": "hi", "logprobs": 5}', "application/json"),
    (b'{"prompt": "hi", "row_seeds": [1, 2]}', "application/json"),
    (b'{"prompt": "hi", "seed": "abc"}', "application/json"),
    (b"\xff\xfe\x00garbage", "text/plain"),
    (b'{"messages": []}', "application/json"),
]


def test_load_1000_malformed_requests_and_concurrent_clients_leave_it_serving(served):
    url, errors, ok = served.url, [], []

    def spam(worker: int) -> None:
        with httpx.Client(timeout=60) as http:
            for i in range(250):
                body, kind = MALFORMED[(worker * 250 + i) % len(MALFORMED)]
                path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
                r = http.post(url + path, content=body, headers={"content-type": kind})
                if not (400 <= r.status_code < 500 and "message" in r.json()["error"]):
                    errors.append((body, r.status_code, r.text))

    def good(worker: int) -> None:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        for i in range(3):
            out = client.completions.create(
                model="default", prompt="What is 3+4?", n=2, max_tokens=4, seed=worker * 10 + i
            )
            ok.append(len(out.choices))

    threads = [threading.Thread(target=spam, args=(w,)) for w in range(4)]  # 4 x 250 = 1,000 malformed
    threads += [threading.Thread(target=good, args=(w,)) for w in range(3)]  # 3 clients x 3 valid requests
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert errors == []
    assert ok == [2] * 9
    assert httpx.get(url + "/health").json()["status"] == "ok"
    out = httpx.post(url + "/v1/completions", json={"prompt": "What is 3+4?", "max_tokens": 4, "seed": 0}).json()
    assert len(out["choices"]) == 1
