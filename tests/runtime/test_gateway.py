"""OpenAI-compatible gateway over real HTTP: uvicorn on 127.0.0.1, a real `Coordinator` over a tiny
random-weight chat model with a real byte-level tokenizer (conftest), the official `openai` client
for the happy paths and raw `httpx` for framing and errors.

Expected texts come from `speculative_decoding.generate` on a separate runner with the same weights
(greedy decoding is lossless, so the gateway's speculative output must equal it).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
import uvicorn

from cosine.runtime.coordinator import Coordinator
from cosine.runtime.drafter import Draft, ModelDrafter
from cosine.runtime.gateway import IncrementalDetokenizer, _Generation, create_app
from cosine.runtime.metrics import ServingMetrics
from cosine.runtime.models import ModelRunner
from cosine.runtime.speculation_control import SpeculationSettings
from cosine.runtime.speculative_decoding import StepOutput, generate

pytestmark = pytest.mark.timeout(60)

MODEL = "tiny"
API_KEY = "sekrit"
USAGE = {"include_usage": True}


@dataclass
class Served:
    url: str
    app: Any
    coordinator: Coordinator
    reference: ModelRunner  # same weights as the served model, for expected outputs

    def client(self, api_key: str = "unused") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=30)

    def post(self, path: str, body: Any = None, **kw: Any) -> httpx.Response:
        return httpx.post(f"{self.url}{path}", json=body, **{"timeout": 30, **kw})


@pytest.fixture(scope="module")
def served(make_chat_runner) -> Iterator[Served]:
    """A speculative server: the drafter has the target's weights, so greedy drafts are all accepted
    and steps emit several tokens (a stop sequence can land inside one)."""
    coordinator = Coordinator(
        make_chat_runner(), [ModelDrafter(make_chat_runner(name="draft"))],
        SpeculationSettings(adaptive=False, max_draft_tokens=3), metrics=ServingMetrics(MODEL),
    )
    yield from _serve(coordinator, make_chat_runner())


@pytest.fixture(scope="module")
def keyed(make_chat_runner) -> Iterator[Served]:
    yield from _serve(Coordinator(make_chat_runner()), make_chat_runner(), api_key=API_KEY)


class _ControlledDrafter:
    """Drafts nothing, but the engine thread waits in it: on `gate` (closed = the engine is stuck)
    and for `delay_s` per step (a slow request)."""

    name = "controlled"

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.delay_s = 0.0
        self.calls = 0

    def propose(self, request_id, context_ids, max_tokens, params, **kw) -> Draft:
        self.calls += 1
        self.entered.set()
        self.gate.wait(30)
        time.sleep(self.delay_s)
        return Draft((), None, (), self.name, 0.0)

    def release(self, request_id: str) -> None:
        pass


@pytest.fixture(scope="module")
def slow(make_chat_runner) -> Iterator[tuple[Served, _ControlledDrafter]]:
    """One running slot, one waiting slot, and a drafter that can hold the engine."""
    drafter = _ControlledDrafter()
    coordinator = Coordinator(
        make_chat_runner(), [drafter], SpeculationSettings(adaptive=False, max_draft_tokens=1),
        max_running=1, max_waiting=1,
    )
    for server in _serve(coordinator, make_chat_runner()):
        yield server, drafter


def _serve(coordinator: Coordinator, reference: ModelRunner, api_key: str | None = None) -> Iterator[Served]:
    app = create_app(coordinator, coordinator.target, model_name=MODEL, api_key=api_key,
                     metrics=coordinator.metrics)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    thread.start()
    _wait_until(lambda: server.started, "server start")
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield Served(f"http://127.0.0.1:{port}", app, coordinator, reference)
    finally:
        server.should_exit = True
        thread.join(15)


def _wait_until(condition, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def _greedy_text(runner: ModelRunner, prompt_ids: list[int], max_tokens: int) -> tuple[str, list[int]]:
    result = generate(runner, prompt_ids, max_tokens)
    return runner.decode(result.token_ids), list(result.token_ids)


def _sse_data(response: httpx.Response) -> list[str]:
    """The `data:` payloads of an SSE body, checking the framing (only data lines, ping comments
    and blank separators)."""
    payloads = []
    for line in response.text.split("\n"):
        if line.startswith("data: "):
            payloads.append(line[len("data: "):])
        else:
            assert line == "" or line.startswith(":"), f"unexpected SSE line {line!r}"
    return payloads


# ------------------------------------------------------------------------- happy paths (openai)


def test_models_health_metrics(served):
    assert [m.id for m in served.client().models.list().data] == [MODEL]
    assert served.client().models.retrieve(MODEL).id == MODEL
    health = httpx.get(f"{served.url}/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    metrics = httpx.get(f"{served.url}/metrics")
    assert metrics.status_code == 200 and "cosine:num_requests_running" in metrics.text


def test_completion_equals_greedy_reference(served):
    prompt = "The quick brown fox"
    prompt_ids = served.reference.tokenizer(prompt)["input_ids"]
    want, _ = _greedy_text(served.reference, prompt_ids, 20)
    out = served.client().completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0)
    assert out.id.startswith("cmpl-") and out.object == "text_completion" and out.model == MODEL
    assert out.choices[0].text == want
    assert out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (
        len(prompt_ids), 20, len(prompt_ids) + 20)
    # the same prompt as token ids, and as a batch of one
    by_ids = served.client().completions.create(model=MODEL, prompt=prompt_ids, max_tokens=20, temperature=0)
    assert by_ids.choices[0].text == want
    by_list = served.client().completions.create(model=MODEL, prompt=[prompt], max_tokens=20, temperature=0)
    assert by_list.choices[0].text == want


def test_completion_stream_equals_non_stream(served):
    args = dict(model=MODEL, prompt="Hello, how are", max_tokens=30, temperature=0)
    whole = served.client().completions.create(**args)
    chunks = list(served.client().completions.create(**args, stream=True, stream_options=USAGE))
    text_chunks, usage_chunk = chunks[:-1], chunks[-1]
    assert len(text_chunks) > 2
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 30
    assert usage_chunk.usage.prompt_tokens == whole.usage.prompt_tokens
    accepted = served.coordinator.metrics.registry.get_sample_value(
        "cosine:spec_decode_num_accepted_tokens_total", {"model_name": MODEL, "pool": "draft"})
    assert accepted and accepted > 30  # steps carried several tokens each


def test_chat_equals_greedy_reference(served):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Caf\u00e9 au lait?"}]
    prompt_ids = served.reference.encode_prompt(messages)
    want, _ = _greedy_text(served.reference, prompt_ids, 24)
    out = served.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=24,
                                                  temperature=0)
    assert out.id.startswith("chatcmpl-") and out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == want
    assert out.usage.prompt_tokens == len(prompt_ids) and out.usage.completion_tokens == 24
    # content as text parts; max_completion_tokens wins over max_tokens
    parts = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
             {"role": "user", "content": [{"type": "text", "text": "Caf\u00e9 au lait?"}]}]
    out2 = served.client().chat.completions.create(
        model=MODEL, messages=parts, max_tokens=3, max_completion_tokens=24, temperature=0)
    assert out2.choices[0].message.content == want


def test_chat_stream_equals_non_stream(served):
    messages = [{"role": "user", "content": "Tell me a story"}]
    args = dict(model=MODEL, messages=messages, max_tokens=40, temperature=0)
    whole = served.client().chat.completions.create(**args)
    chunks = list(served.client().chat.completions.create(**args, stream=True, stream_options=USAGE))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.id == chunks[0].id and c.object == "chat.completion.chunk" for c in chunks)
    content = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert len([c for c in content if c]) > 2
    assert "".join(content) == whole.choices[0].message.content
    assert chunks[-2].choices[0].finish_reason == "length" and chunks[-2].choices[0].delta.content is None
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()


def test_sampling_with_seed_is_reproducible(served):
    args = dict(model=MODEL, prompt="Speculative", max_tokens=16, temperature=0.9, top_p=0.95, seed=7,
                extra_body={"top_k": 50})
    a = served.client().completions.create(**args).choices[0].text
    b = served.client().completions.create(**args).choices[0].text
    assert a == b


def test_raw_sse_framing(served):
    body = {**CHAT, "max_tokens": 5, "temperature": 0, "stream": True}
    r = served.post("/v1/chat/completions", body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    data = _sse_data(r)
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
    assert all("usage" not in c or c["usage"] is None for c in chunks)  # no include_usage: no usage chunk


# ---------------------------------------------------------------------------------- stop strings


def _stop_spanning_tokens(runner: ModelRunner, token_ids: list[int], text: str) -> tuple[str, int]:
    """A 3-character stop sequence whose first occurrence in `text` straddles a token boundary
    past the first few tokens, and its position."""
    for i in range(4, len(token_ids) - 2):
        boundary = len(runner.decode(token_ids[:i]))
        if not text.startswith(runner.decode(token_ids[:i])):
            continue  # ends inside a UTF-8 character
        stop = text[boundary - 1 : boundary + 2]
        if len(stop) == 3 and "\ufffd" not in stop and text.find(stop) == boundary - 1:
            return stop, boundary - 1
    raise AssertionError("no usable stop sequence in the reference output")


def test_stop_sequence_cuts_output_streamed_and_not(served):
    prompt = "Once upon a time"
    full, token_ids = _greedy_text(served.reference, served.reference.tokenizer(prompt)["input_ids"], 60)
    stop, at = _stop_spanning_tokens(served.reference, token_ids, full)
    args = dict(model=MODEL, prompt=prompt, max_tokens=60, temperature=0, stop=[stop, "never-occurs"])
    out = served.client().completions.create(**args)
    assert out.choices[0].text == full[:at]
    assert out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens < 60  # generation ended early
    chunks = list(served.client().completions.create(**args, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == full[:at]
    assert chunks[-1].choices[0].finish_reason == "stop"
    # a stop string that never occurs changes nothing
    out = served.client().completions.create(**{**args, "stop": "never-occurs"})
    assert (out.choices[0].text, out.choices[0].finish_reason) == (full, "length")
    _wait_until(lambda: served.coordinator.num_running == 0, "stopped request freed")


def test_detokenizer_holds_back_split_utf8(chat_tokenizer):
    text = "Caf\u00e9 5 \u20ac \u65e5\u672c\u8a9e \U0001f680 na\u00efve"
    ids = chat_tokenizer(text)["input_ids"]
    decode = lambda t: chat_tokenizer.decode(t, skip_special_tokens=True)  # noqa: E731
    assert any(decode(ids[:i]).endswith("\ufffd") for i in range(1, len(ids))), "no token splits a character"
    detok = IncrementalDetokenizer(decode)
    pieces = [detok.feed([t]) for t in ids] + [detok.flush()]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


def test_detokenizer_stop_across_steps():
    decode = lambda ids: "".join(map(chr, ids))  # noqa: E731 - one character per token
    detok = IncrementalDetokenizer(decode, stop=["o w", "xyz"])
    feed = lambda s: detok.feed([ord(c) for c in s])  # noqa: E731
    assert feed("hel") == "hel"
    assert feed("lo") == "l"  # "o" may begin "o w"
    assert feed(" ") == ""  # "o " too
    assert feed("x") == "o "  # "o w" is no longer possible; "x" may begin "xyz"
    assert feed("y!") == "xy!"  # "xyz" did not complete: released
    assert feed("ho w") == "h"  # the stop is found; nothing past it is released
    assert detok.stopped and detok.text == "hello xy!h"
    assert feed("more") == "" and detok.flush() == ""


class _FakeSteps:
    """A coordinator stream of chosen steps that records whether it was closed."""

    def __init__(self, steps: list[StepOutput]) -> None:
        self.steps, self.closed = iter(steps), False

    def __aiter__(self):
        return self

    async def __anext__(self) -> StepOutput:
        try:
            return next(self.steps)
        except StopIteration:
            raise StopAsyncIteration from None

    async def aclose(self) -> None:
        self.closed = True


@pytest.mark.parametrize(
    ("tokens", "stop", "want_text", "want_reason", "want_tokens"),
    [
        ([(104, 105), (33, 2)], [], "hi!", "stop", 4),  # ends in EOS (2 decodes to "")
        ([(104, 105), (33, 33)], [], "hi!!", "length", 4),
        ([(104, 105), (33, 33), (63,)], ["i!"], "h", "stop", 4),  # stop: the third step is never read
    ],
)
def test_finish_reason(tokens, stop, want_text, want_reason, want_tokens):
    decode = lambda ids: "".join(chr(i) for i in ids if i != 2)  # noqa: E731
    steps = [StepOutput(tuple(t), 0, 0, i == len(tokens) - 1) for i, t in enumerate(tokens)]
    fake = _FakeSteps(steps[1:])
    gen = _Generation(fake, steps[0], 3, IncrementalDetokenizer(decode, stop), frozenset({2}))
    assert asyncio.run(gen.text()) == want_text
    assert (gen.finish_reason, gen.completion_tokens) == (want_reason, want_tokens)
    assert gen.usage.total_tokens == 3 + want_tokens
    assert fake.closed


# --------------------------------------------------------------------------------------- errors


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 2}


@pytest.mark.parametrize(
    ("path", "body", "status", "code", "param"),
    [
        ("/v1/chat/completions", {k: v for k, v in CHAT.items() if k != "messages"}, 400,
         "missing_required_parameter", "messages"),
        ("/v1/chat/completions", {**CHAT, "messages": []}, 400, "invalid_value", "messages"),
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "robot", "content": "x"}]}, 400,
         "invalid_value", "messages[0].role"),
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
         400, "invalid_value", "messages[0].content"),
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "  "}]}, 400,
         "invalid_value", "messages"),
        ("/v1/chat/completions", {**CHAT, "temperature": 5}, 400, "invalid_value", "temperature"),
        ("/v1/chat/completions", {**CHAT, "temperature": "hot"}, 400, "invalid_value", "temperature"),
        ("/v1/chat/completions", {**CHAT, "top_p": 0}, 400, "invalid_value", "top_p"),
        ("/v1/chat/completions", {**CHAT, "max_tokens": 0}, 400, "invalid_value", "max_tokens"),
        ("/v1/chat/completions", {**CHAT, "n": 2}, 400, "unsupported_parameter", "n"),
        ("/v1/chat/completions", {**CHAT, "logprobs": True}, 400, "unsupported_parameter", "logprobs"),
        ("/v1/chat/completions", {**CHAT, "stop": ""}, 400, "invalid_value", "stop"),
        ("/v1/chat/completions", {**CHAT, "model": "gpt-4"}, 404, "model_not_found", "model"),
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "word " * 300}]}, 400,
         "context_length_exceeded", "messages"),
        ("/v1/completions", {**COMPLETION, "prompt": "word " * 300}, 400, "context_length_exceeded",
         "prompt"),
        ("/v1/completions", {**COMPLETION, "prompt": ["a", "b"]}, 400, "unsupported_parameter", "prompt"),
        ("/v1/completions", {**COMPLETION, "prompt": [1, 99999]}, 400, "invalid_value", "prompt"),
        ("/v1/completions", {**COMPLETION, "prompt": 42}, 400, "invalid_value", "prompt"),
        ("/v1/completions", {**COMPLETION, "logprobs": 1}, 400, "unsupported_parameter", "logprobs"),
        ("/v1/completions", {**COMPLETION, "model": "nope", "stream": True}, 404, "model_not_found", "model"),
        ("/v1/completions", [COMPLETION], 400, "invalid_request", None),
    ],
)
def test_errors_have_openai_shape(served, path, body, status, code, param):
    r = served.post(path, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert (error["code"], error["param"]) == (code, param)
    assert error["type"] == "invalid_request_error" and error["message"]
    if param:
        assert param.split("[")[0] in error["message"]


def test_malformed_json_unknown_route_and_recovery(served):
    r = httpx.post(f"{served.url}/v1/completions", content=b'{"model": "tiny", "prompt": ',
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx.get(f"{served.url}/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError) as e:
        served.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], n=3)
    assert e.value.status_code == 400 and e.value.body["param"] == "n"
    with pytest.raises(openai.NotFoundError):
        served.client().completions.create(model="missing", prompt="x", max_tokens=1)
    # still serving; a prompt near the context gets its max_tokens clamped rather than refused
    prompt_ids = served.reference.tokenizer("word " * 100)["input_ids"][:200]
    room = served.coordinator.max_context_tokens - len(prompt_ids)
    assert 0 < room < 256
    out = served.client().completions.create(model=MODEL, prompt=prompt_ids, temperature=0)
    assert out.usage.completion_tokens == room and out.choices[0].finish_reason == "length"


def test_not_ready_is_503(served):
    served.app.state.ready = False
    try:
        assert httpx.get(f"{served.url}/health").status_code == 503
        r = served.post("/v1/completions", COMPLETION)
        assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"
        assert httpx.get(f"{served.url}/v1/models").status_code == 503
    finally:
        served.app.state.ready = True
    assert httpx.get(f"{served.url}/health").status_code == 200


def test_api_key(keyed):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = keyed.post("/v1/chat/completions", CHAT, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(f"{keyed.url}/v1/completions", content=b"{not json")  # auth comes before the body
    assert r.status_code == 401
    with pytest.raises(openai.AuthenticationError):
        keyed.client("wrong").models.list()
    out = keyed.client(API_KEY).chat.completions.create(model=MODEL, messages=CHAT["messages"], max_tokens=3)
    assert out.usage.completion_tokens <= 3
    assert httpx.get(f"{keyed.url}/health").status_code == 200
    assert httpx.get(f"{keyed.url}/metrics").status_code == 200


# --------------------------------------------------------------------- admission and disconnects


def test_overload_is_429_with_retry_after(slow):
    served, drafter = slow
    drafter.gate.clear()
    drafter.entered.clear()
    results: dict[str, httpx.Response] = {}

    def request(name: str) -> None:
        results[name] = served.post("/v1/completions", {**COMPLETION, "max_tokens": 4})

    threads = [threading.Thread(target=request, args=(name,)) for name in ("running", "waiting")]
    try:
        threads[0].start()
        _wait_until(drafter.entered.is_set, "engine held by the first request")
        threads[1].start()
        _wait_until(lambda: served.coordinator.num_waiting == 1, "second request queued")
        r = served.post("/v1/completions", COMPLETION)
        assert r.status_code == 429, r.text
        assert r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "overloaded"
        with pytest.raises(openai.RateLimitError):
            served.client().completions.create(model=MODEL, prompt="x", max_tokens=1)
    finally:
        drafter.gate.set()
        for t in threads:
            t.join(30)
    assert [results[n].status_code for n in ("running", "waiting")] == [200, 200]
    assert served.post("/v1/completions", COMPLETION).status_code == 200  # serving again


def test_disconnect_frees_the_slot(slow):
    served, drafter = slow
    drafter.delay_s = 0.02  # 200 tokens would take 4 s
    try:
        body = {**COMPLETION, "max_tokens": 200, "temperature": 0}
        url = f"{served.url}/v1/completions"
        with httpx.stream("POST", url, json={**body, "stream": True}, timeout=30) as r:
            assert r.status_code == 200
            next(r.iter_lines())  # the stream is running
            calls_at_close = drafter.calls
        _wait_until(lambda: served.coordinator.num_running == 0, "slot freed after stream disconnect", 2.0)
        assert drafter.calls < calls_at_close + 20

        calls_before = drafter.calls
        with pytest.raises(httpx.ReadTimeout):  # non-streamed: the client gives up waiting
            served.post("/v1/completions", body, timeout=0.3)
        _wait_until(lambda: served.coordinator.num_running == 0, "slot freed after non-stream disconnect", 2)
        assert drafter.calls - calls_before < 60
    finally:
        drafter.delay_s = 0.0
    assert served.post("/v1/completions", COMPLETION).status_code == 200
