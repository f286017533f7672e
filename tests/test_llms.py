"""LLM backends against a real loopback HTTP server, the response cache, and the local model."""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import PRIORS, without
from openai_server import FakeOpenAI, Reply

import brag
from brag import BRAG, Completion, Corpus
from bragkit import llms
from bragkit.llms import (
    CachedLLM,
    CacheMiss,
    EndpointUnreachable,
    HFInference,
    LLMTimeout,
    MalformedResponse,
    ModelNotFound,
    OpenAICompatible,
    RateLimited,
    RetryPolicy,
    TokenRejected,
    make_llm,
)

MESSAGES = [{"role": "user", "content": "Question: What is the capital of France?\nAnswer:"}]


class RecordingSleep:
    def __init__(self) -> None:
        self.delays: list[float] = []

    def __call__(self, seconds: float) -> None:
        self.delays.append(seconds)


def openai_backend(url: str, **kwargs) -> OpenAICompatible:
    return OpenAICompatible(name=url, base_url=url, **kwargs)


def hf_backend(url: str, **kwargs) -> HFInference:
    return HFInference(name="hf-test", base_url=url, token="hf_test", **kwargs)


BACKENDS = pytest.mark.parametrize("factory", [openai_backend, hf_backend], ids=["openai", "huggingface"])


@BACKENDS
def test_completion_and_usage_equal_what_the_server_sent(factory):
    with FakeOpenAI(prompt_tokens=77, completion_tokens=4) as server:
        result = factory(server.url).complete(MESSAGES, max_tokens=20, stop=["\n\n"], seed=3)
        request = server.chat_requests[0]
    assert result.texts == ["Answer: Paris\nFollow-up query: Paris France"]
    assert (result.prompt_tokens, result.completion_tokens) == (77, 4)
    assert result.estimated is False
    assert request["messages"] == MESSAGES
    assert request["max_tokens"] == 20 and request["stop"] == ["\n\n"] and request["seed"] == 3


def test_served_model_name_comes_from_models_or_the_url():
    with FakeOpenAI(model="served-7b") as server:
        backend = make_llm(server.url)
        backend.complete(MESSAGES)
        assert server.chat_requests[-1]["model"] == "served-7b"
        assert any(r["path"].endswith("/models") for r in server.requests)
        explicit = make_llm(server.url + "#my-model")
        before = len(server.requests)
        explicit.complete(MESSAGES)
        assert server.chat_requests[-1]["model"] == "my-model"
        assert len(server.requests) == before + 1  # no /models lookup


@BACKENDS
def test_n_samples_in_one_request_when_supported(factory):
    with FakeOpenAI(handler=lambda r: Reply(texts=[f"s{i}" for i in range(r.get("n", 1))])) as server:
        result = factory(server.url).complete(MESSAGES, n=5, temperature=0.7)
        assert len(server.chat_requests) == 1 and server.chat_requests[0]["n"] == 5
    assert result.texts == ["s0", "s1", "s2", "s3", "s4"]
    assert result.requests == 1
    assert result.prompt_tokens == 50 and result.completion_tokens == 25


@BACKENDS
def test_n_samples_fall_back_to_parallel_requests(factory):
    with FakeOpenAI(supports_n=False, prompt_tokens=10, completion_tokens=2) as server:
        backend = factory(server.url)
        result = backend.complete(MESSAGES, n=4, temperature=0.7, seed=100)
        seeds = sorted(r.get("seed") for r in server.chat_requests)
        assert len(server.chat_requests) == 4
        assert backend.native_n is False
        again = backend.complete(MESSAGES, n=3, temperature=0.7)
        assert all("n" not in r for r in server.chat_requests[4:]) and len(server.chat_requests) == 7
    assert len(result.texts) == 4 and result.requests == 4
    assert result.prompt_tokens == 40 and result.completion_tokens == 8  # summed per request
    assert seeds == [100, 101, 102, 103]  # distinct seeds, so samples can differ
    assert len(again.texts) == 3


@BACKENDS
def test_401_is_token_rejected_without_retry(factory):
    sleep = RecordingSleep()
    with FakeOpenAI(handler=lambda r: Reply(status=401)) as server:
        with pytest.raises(TokenRejected, match="token rejected"):
            factory(server.url, retry=RetryPolicy(sleep=sleep)).complete(MESSAGES)
        assert len(server.chat_requests) == 1
    assert sleep.delays == []


@BACKENDS
def test_404_is_model_not_found_without_retry(factory):
    with FakeOpenAI(handler=lambda r: Reply(status=404)) as server:
        with pytest.raises(ModelNotFound, match="not found"):
            factory(server.url, retry=RetryPolicy(sleep=RecordingSleep())).complete(MESSAGES)
        assert len(server.chat_requests) == 1


@BACKENDS
def test_429_then_success_retries_once_honouring_retry_after(factory):
    replies = iter([Reply(status=429, headers={"Retry-After": "7"}), Reply()])
    sleep = RecordingSleep()
    with FakeOpenAI(handler=lambda r: next(replies)) as server:
        result = factory(server.url, retry=RetryPolicy(sleep=sleep)).complete(MESSAGES)
        assert len(server.chat_requests) == 2
    (delay,) = sleep.delays
    assert 7.0 <= delay <= 7.0 * 1.25  # Retry-After, plus jitter so waiting callers spread out
    assert result.texts[0].startswith("Answer: Paris")


def test_concurrent_callers_all_honour_retry_after_and_come_back_spread_out():
    """Sixteen callers share one backend. The first eight requests get 429 with Retry-After: 1;
    eight more callers start once the pause is in force. On a clock that stands still, every
    one of them must wait the pause out before its next request, each for its own time."""
    statuses: list[int] = []
    lock = threading.Lock()

    def handler(request):
        with lock:
            statuses.append(429 if len(statuses) < 8 else 200)
            status = statuses[-1]
        return Reply(status=status, headers={"Retry-After": "1"} if status == 429 else {})

    waits: list[float] = []

    def sleep(seconds: float) -> None:
        with lock:
            waits.append(seconds)

    # The pause never ends by itself. With no real waiting, a quick retry can take one of the
    # eight refusals before another first request arrives, so a caller may be refused more than
    # once: the retry bound, tested elsewhere, is set out of the way.
    policy = RetryPolicy(max_retries=16, sleep=sleep, clock=lambda: 1000.0)
    with FakeOpenAI(handler=handler) as server:
        backend = openai_backend(server.url, model="m", retry=policy)
        with ThreadPoolExecutor(16) as pool:
            first = [pool.submit(backend.complete, MESSAGES) for _ in range(8)]
            while backend.retry.paused_for() == 0:  # until a 429 is back and the pause in force
                threading.Event().wait(0.01)
            second = [pool.submit(backend.complete, MESSAGES) for _ in range(8)]
            results = [f.result() for f in first + second]
    assert len(results) == 16 and statuses.count(200) == 16  # eight refusals, then all answered
    # Eight refused callers waited before their retry, and eight newcomers before their first
    # request; none for less than the Retry-After, and not all for the same time.
    assert len(waits) >= 16 and all(1.0 <= w <= 1.25 for w in waits)
    assert len(set(waits)) > 1


@BACKENDS
def test_persistent_429_is_rate_limited_after_bounded_retries(factory):
    sleep = RecordingSleep()
    with FakeOpenAI(handler=lambda r: Reply(status=429)) as server:
        with pytest.raises(RateLimited, match="rate limited"):
            factory(server.url, retry=RetryPolicy(max_retries=2, sleep=sleep)).complete(MESSAGES)
        assert len(server.chat_requests) == 3
    assert len(sleep.delays) == 2


@BACKENDS
def test_500_repeated_fails_after_bounded_retries_with_backoff(factory):
    sleep = RecordingSleep()
    policy = RetryPolicy(max_retries=3, base_delay=0.5, jitter=0.25, sleep=sleep)
    with FakeOpenAI(handler=lambda r: Reply(status=503)) as server:
        with pytest.raises(EndpointUnreachable, match="HTTP 503"):
            factory(server.url, retry=policy).complete(MESSAGES)
        assert len(server.chat_requests) == 4
    assert len(sleep.delays) == 3
    for attempt, delay in enumerate(sleep.delays):
        assert 0.5 * 2**attempt <= delay <= 0.5 * 2**attempt * 1.25


@BACKENDS
def test_hanging_server_times_out_within_the_configured_time(factory):
    # The answer comes after 3 s: a call that waited for it (a timeout of 3 s or more, or none)
    # would return it instead of failing.
    with FakeOpenAI(handler=lambda r: Reply(delay=3.0)) as server:
        with pytest.raises(LLMTimeout, match=r"did not answer in time \(at most 1 s per call\)"):
            factory(server.url, timeout=1.0).complete(MESSAGES)
        assert len(server.chat_requests) == 1  # a timeout is not retried


@pytest.fixture(scope="module", autouse=True)
def hub_calls_are_bounded():
    llms.bound_hub_calls()  # what the app does at start-up, so deadlines hold for HFInference


TRICKLE = 0.01  # seconds per byte: the whole reply takes about 3 s, each byte far less than 1 s


@BACKENDS
def test_a_trickling_endpoint_cannot_stretch_a_call_past_its_timeout(factory):
    # Each byte arrives well within the timeout; only a bound on the whole call stops it before
    # the reply is complete (a call bounded per read would return the answer).
    with FakeOpenAI(handler=lambda r: Reply(trickle=TRICKLE)) as server:
        with pytest.raises(LLMTimeout):
            factory(server.url, timeout=1.0).complete(MESSAGES)
        assert server.abandoned.wait(30)  # the client hung up; it did not read on


@BACKENDS
def test_a_request_deadline_bounds_every_call_and_the_retries(factory):
    with FakeOpenAI(handler=lambda r: Reply(trickle=TRICKLE)) as server:
        backend = factory(server.url, timeout=60.0)
        with llms.deadline(1.0), pytest.raises(LLMTimeout):
            backend.complete(MESSAGES)  # the reply would be complete in 3 s: the deadline ends it first
        assert server.abandoned.wait(30)
        with llms.deadline(0.0), pytest.raises(LLMTimeout, match="time limit"):
            backend.complete(MESSAGES)  # past the deadline: fails before sending
        assert len(server.chat_requests) == 1
    sleep = RecordingSleep()
    with FakeOpenAI(handler=lambda r: Reply(status=503, headers={"Retry-After": "30"})) as busy:
        with llms.deadline(2.0), pytest.raises(EndpointUnreachable):
            # A 30 s Retry-After cannot end in time: the call fails at once, without waiting.
            factory(busy.url, retry=RetryPolicy(sleep=sleep)).complete(MESSAGES)
        assert len(busy.chat_requests) == 1 and sleep.delays == []


def test_public_only_refuses_private_addresses_at_connection_time():
    with FakeOpenAI() as server:
        port = server.url.rsplit(":", 1)[1]
        for host in ("127.0.0.1", "localhost", "2130706433", "0x7f.1"):
            backend = make_llm(f"http://{host}:{port}#m", public_only=True)
            with pytest.raises(llms.EndpointRefused, match="is not allowed"):
                backend.complete(MESSAGES)
        assert server.requests == []
        make_llm(server.url + "#m").complete(MESSAGES)  # the same server, without the policy
        assert len(server.requests) == 1
    assert llms.is_public_address("93.184.215.14") and not llms.is_public_address("::ffff:192.168.1.1")
    assert not any(
        map(llms.is_public_address, ["10.0.0.1", "169.254.169.254", "224.0.0.1", "::1", "fe80::1"])
    )


def test_server_secrets_go_only_where_allowed(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-server-secret")
    with FakeOpenAI() as server:
        make_llm(server.url + "#m").complete(MESSAGES)
        make_llm(server.url + "#m", secrets_from_env=False).complete(MESSAGES)
        make_llm(server.url + "#m", "caller-token", secrets_from_env=False).complete(MESSAGES)
        sent = [{k.lower(): v for k, v in h.items()}.get("authorization") for h in server.headers]
    assert sent == ["Bearer sk-server-secret", "Bearer not-needed", "Bearer caller-token"]


def test_tokens_that_no_server_accepts_are_refused_without_echo():
    for token in ("hf_abc\r\nX-Evil: 1", "two words", "tab\there"):
        with pytest.raises(TokenRejected) as err:
            make_llm("http://example.invalid/v1#m", token)
        assert token not in str(err.value) and "X-Evil" not in str(err.value)


def test_redirects_are_not_followed_and_urls_are_redacted():
    with FakeOpenAI(
        handler=lambda r: Reply(status=307, headers={"Location": "http://169.254.169.254/"})
    ) as server:
        host = server.url.split("//")[1]
        with pytest.raises(llms.RequestRejected, match="redirect") as err:
            make_llm(f"http://user:pw-secret@{host}#m").complete(MESSAGES)
        assert len(server.requests) == 1 and "pw-secret" not in str(err.value)
    assert llms.redact_url("https://u:p@h.example:8443/v1?key=sk-1") == "https://***@h.example:8443/v1?***"
    assert llms.redact_url("http://h/v1") == "http://h/v1"


@BACKENDS
@pytest.mark.parametrize(
    "body",
    [b"{not json", b'{"choices": []}', b'{"choices": [{"index": 0, "message": {"role": "assistant"}}]}'],
)
def test_malformed_response_is_a_clear_error(factory, body):
    with FakeOpenAI(handler=lambda r: Reply(body=body)) as server:
        with pytest.raises(MalformedResponse, match=r"malformed|no choices|content"):
            factory(server.url, retry=RetryPolicy(sleep=RecordingSleep())).complete(MESSAGES)


@BACKENDS
def test_unreachable_endpoint_is_retried_then_reported(factory):
    with FakeOpenAI() as server:
        url = server.url
    sleep = RecordingSleep()
    with pytest.raises(EndpointUnreachable, match="cannot reach"):
        factory(url, retry=RetryPolicy(max_retries=2, sleep=sleep), timeout=2).complete(MESSAGES)
    assert len(sleep.delays) == 2


def test_missing_usage_is_estimated_and_marked():
    with FakeOpenAI(handler=lambda r: Reply(usage={})) as server:
        result = make_llm(server.url + "#m").complete(MESSAGES)
    assert result.estimated is True and result.prompt_tokens > 0 and result.completion_tokens > 0


def test_offline_mode_blocks_the_hub_in_plain_words_but_not_a_server_named_by_url(monkeypatch):
    assert os.environ["HF_HUB_OFFLINE"] == "1"  # every test runs offline (conftest)
    with FakeOpenAI() as server:
        assert hf_backend(server.url).complete(MESSAGES).texts  # loopback, named by its URL
    hosted = llms.HFInference("m", model="org/model", token="hf_test", retry=llms.RetryPolicy(max_retries=0))
    with pytest.raises(llms.EndpointUnreachable, match="offline mode is enabled"):
        hosted.complete(MESSAGES)  # refused before any connection: the Hub is what offline means
    monkeypatch.delenv("HF_TOKEN", raising=False)
    tokenless = llms.HFInference("m", model="org/model", retry=llms.RetryPolicy(max_retries=0))
    with pytest.raises(llms.TokenRejected, match="needs a Hugging Face token"):
        tokenless.complete(MESSAGES)


def test_hf_backend_sends_the_token():
    with FakeOpenAI() as server:
        hf_backend(server.url).complete(MESSAGES)
        headers = {k.lower(): v for k, v in server.headers[0].items()}
    assert headers.get("authorization") == "Bearer hf_test"


@BACKENDS
def test_brag_report_counts_equal_the_server(factory):
    def handler(request):
        content = request["messages"][-1]["content"]
        if "Passages:" in content:
            return Reply(texts=["Answer: Bergen\nFollow-up query: Lina Berg birthplace"])
        return Reply(texts=["Bergen", "Oslo", "Bergen", "Bergen", "NONE"][: request.get("n", 1)])

    corpus = Corpus(["Lina Berg was born in Bergen.", "Oslo is a city.", "The tower is tall."])
    with FakeOpenAI(handler=handler, prompt_tokens=31, completion_tokens=3) as server:
        controller = BRAG(factory(server.url), calibration=PRIORS, lam=0.0, k=1)
        answer, report = controller.run("Where was Lina Berg born?", corpus)
        chat = server.chat_requests
        usage = list(server.usage_sent)
    assert answer == "Bergen"
    assert report["totals"]["llm_calls"] == len(chat) >= 2
    assert report["totals"]["llm_requests"] == len(chat)
    assert report["totals"]["prompt_tokens"] == sum(u["prompt_tokens"] for u in usage)
    assert report["totals"]["completion_tokens"] == sum(u["completion_tokens"] for u in usage)


def test_failure_mid_run_raises_with_the_partial_report():
    replies = iter([Reply(texts=["Answer: Bergen\nFollow-up query: x"]), Reply(status=401)])
    corpus = Corpus(["Lina Berg was born in Bergen.", "Oslo is a city.", "x y"])
    with FakeOpenAI(handler=lambda r: next(replies)) as server:
        with pytest.raises(brag.RunAborted, match="token rejected") as err:
            BRAG(make_llm(server.url + "#m"), calibration=PRIORS, lam=0.0, cost="calls").run(
                "Where was Lina Berg born?", corpus
            )
    assert err.value.report["totals"]["llm_calls"] == 1 and err.value.report["answer"] == "Bergen"
    assert isinstance(err.value.__cause__, TokenRejected)


# ---------------------------------------------------------------------------------- log-probabilities

READ_TOKENS = [("Answer", -0.1), (":", 0.0), (" Paris", -0.5), ("\n", -0.2), ("Follow-up query: x", -0.3)]


@BACKENDS
def test_token_log_probabilities_are_asked_for_and_returned(factory):
    reply = Reply(texts=["Answer: Paris\nFollow-up query: x"], logprobs=[READ_TOKENS])
    with FakeOpenAI(handler=lambda r: reply) as server:
        result = factory(server.url).complete(MESSAGES)
        assert server.chat_requests[0]["logprobs"] is True
    assert result.logprobs == [READ_TOKENS]
    assert brag.answer_logprobs("Paris", result.logprobs[0]) == [-0.5]


@BACKENDS
def test_a_server_that_refuses_log_probabilities_still_answers_and_is_not_asked_again(factory):
    def handler(request):
        if request.get("logprobs"):
            return Reply(
                status=400, body=json.dumps({"error": {"message": "logprobs are not supported"}}).encode()
            )
        return Reply()

    with FakeOpenAI(handler=handler) as server:
        backend = factory(server.url)
        first, second = backend.complete(MESSAGES), backend.complete(MESSAGES)
        asked = [bool(r.get("logprobs")) for r in server.chat_requests]
    assert first.texts == second.texts == ["Answer: Paris\nFollow-up query: Paris France"]
    assert first.logprobs is None and second.logprobs is None and asked == [True, False, False]


@BACKENDS
def test_a_refusal_about_something_else_is_not_blamed_on_log_probabilities(factory):
    refusal = json.dumps({"error": {"message": "max_tokens is too large"}}).encode()
    with FakeOpenAI(handler=lambda r: Reply(status=400, body=refusal)) as server:
        with pytest.raises(llms.RequestRejected):
            factory(server.url).complete(MESSAGES)
        assert len(server.chat_requests) == 1  # not sent again without logprobs


@pytest.mark.parametrize(
    "tokens",
    [[("Answer", 2.0)], [("Answer", "high")], [(None, -0.1)]],
    ids=["above-one", "not-a-number", "no-token"],
)
def test_malformed_log_probabilities_leave_the_evidence_missing_not_the_call_failed(tokens):
    with FakeOpenAI(handler=lambda r: Reply(logprobs=[tokens])) as server:
        result = make_llm(server.url + "#m").complete(MESSAGES)
    assert result.texts == ["Answer: Paris\nFollow-up query: Paris France"] and result.logprobs is None


class FixedLLM:
    """Writes ``text``, with log-probabilities when ``logprobs`` is set."""

    name = "fixed"

    def __init__(self, text: str, logprobs: list | None = None) -> None:
        self.text, self.logprobs, self.calls = text, logprobs, 0

    def complete(self, messages, *, n=1, temperature=0.0, max_tokens=64, stop=None, seed=None):
        self.calls += 1
        return Completion([self.text] * n, 5, n, logprobs=[self.logprobs] * n if self.logprobs else None)


def test_the_cache_keeps_log_probabilities_and_a_backfill_adds_them_only_to_the_stored_texts(tmp_path):
    path = tmp_path / "cache.sqlite"
    CachedLLM(FixedLLM("Answer: Paris"), path).complete(MESSAGES)  # stored without them
    CachedLLM(FixedLLM("Answer: Oslo"), path).complete(MESSAGES, temperature=0.7)
    other = FixedLLM("Answer: Lyon", [("Answer", -0.1), (": Lyon", -0.2)])
    filling = CachedLLM(other, path, mode="backfill")
    kept = filling.complete(MESSAGES)
    assert kept.texts == ["Answer: Paris"] and kept.logprobs is None and filling.mismatched == 1
    same = FixedLLM("Answer: Paris", [("Answer", -0.1), (": Paris", -0.2)])
    filling = CachedLLM(same, path, mode="backfill")
    filled = filling.complete(MESSAGES)
    assert filled.texts == ["Answer: Paris"] and filled.logprobs == [[("Answer", -0.1), (": Paris", -0.2)]]
    assert filling.complete(MESSAGES).logprobs == filled.logprobs and same.calls == 1  # filled once
    sampled = filling.complete(MESSAGES, temperature=0.7)  # a sample is never re-drawn
    assert sampled.texts == ["Answer: Oslo"] and sampled.logprobs is None and same.calls == 1
    replay = CachedLLM(FixedLLM("unused"), path, model="fixed", mode="replay")
    assert replay.complete(MESSAGES).logprobs == filled.logprobs


def test_a_cache_written_before_log_probabilities_were_kept_still_opens(tmp_path):
    path = tmp_path / "old.sqlite"
    old = sqlite3.connect(path)
    old.execute(
        "CREATE TABLE responses (key TEXT PRIMARY KEY, texts TEXT NOT NULL, prompt_tokens INTEGER, "
        "completion_tokens INTEGER, estimated INTEGER, requests INTEGER, seconds REAL)"
    )
    key = llms.request_key("fixed", MESSAGES, 1, 0.0, 64, None, None)
    old.execute("INSERT INTO responses VALUES (?, ?, 3, 1, 0, 1, 0.5)", (key, json.dumps(["Answer: Rome"])))
    old.commit()
    old.close()
    hit = CachedLLM(FixedLLM("unused"), path, mode="replay").complete(MESSAGES)
    assert hit.texts == ["Answer: Rome"] and hit.logprobs is None and hit.seconds == 0.5


# ---------------------------------------------------------------------------------- cache


class CountingLLM:
    name = "counting"

    def __init__(self) -> None:
        self.calls = 0
        self._lock = threading.Lock()

    def complete(self, messages, *, n=1, temperature=0.0, max_tokens=64, stop=None, seed=None):
        with self._lock:
            self.calls += 1
            call = self.calls
        time.sleep(0.01)
        return Completion([f"{messages[-1]['content'][-12:]}#{call}#{i}" for i in range(n)], 11, 2 * n)


def test_cache_hit_miss_and_identical_replay(tmp_path):
    path = tmp_path / "cache.sqlite"
    inner = CountingLLM()
    cache = CachedLLM(inner, path)
    first = cache.complete(MESSAGES, n=2, temperature=0.7, seed=1)
    second = cache.complete(MESSAGES, n=2, temperature=0.7, seed=1)
    other_seed = cache.complete(MESSAGES, n=2, temperature=0.7, seed=2)
    assert inner.calls == 2 and (cache.hits, cache.misses) == (1, 2)
    assert first.cached is False and second.cached is True
    assert second.texts == first.texts and second.prompt_tokens == 11 and second.completion_tokens == 4
    assert other_seed.texts != first.texts
    cache.close()

    replay = CachedLLM(CountingLLM(), path, model="counting", mode="replay")
    assert replay.complete(MESSAGES, n=2, temperature=0.7, seed=1).texts == first.texts
    with pytest.raises(CacheMiss, match="no cached response"):
        replay.complete(MESSAGES, n=3, temperature=0.7, seed=1)


def test_cache_stores_hashes_not_prompt_text(tmp_path):
    path = tmp_path / "cache.sqlite"
    secret = "Zanzibar-unique-passage-text"
    cache = CachedLLM(CountingLLM(), path)
    cache.complete([{"role": "user", "content": f"{secret} padding to the end of the prompt"}])
    cache.close()
    assert secret.encode() not in path.read_bytes()
    keys = [row[0] for row in sqlite3.connect(path).execute("SELECT key FROM responses")]
    assert len(keys) == 1 and len(keys[0]) == 64


def test_cache_is_safe_under_concurrent_writers(tmp_path):
    path = tmp_path / "cache.sqlite"
    inner = CountingLLM()
    cache = CachedLLM(inner, path)
    prompts = [[{"role": "user", "content": f"question {i % 20}"}] for i in range(200)]
    with ThreadPoolExecutor(max_workers=16) as pool:
        results = list(pool.map(lambda m: cache.complete(m).texts, prompts))
    # Every repeat of a prompt got the one stored response, whichever thread stored it.
    by_prompt = {}
    for messages, texts in zip(prompts, results, strict=True):
        by_prompt.setdefault(messages[0]["content"], set()).add(tuple(texts))
    assert all(len(v) == 1 for v in by_prompt.values())
    rows = sqlite3.connect(path).execute("SELECT COUNT(*) FROM responses").fetchone()[0]
    assert rows == 20


MEASURED = {"policy_us", "llm_wait_s", "wall_time_s", "cached_calls"}  # this run's clock and cache


def test_brag_replay_reproduces_the_run_and_counts_cached_calls(tmp_path):
    path = tmp_path / "cache.sqlite"
    corpus = Corpus(["Lina Berg was born in Bergen.", "Oslo is a city.", "The tower is tall."])
    question = "Where was Lina Berg born?"

    def differing(request):
        """Replies and latencies that differ by prompt; closed-book samples that differ by sample.

        The samples tie Bergen with Oslo, Bergen first: the vote breaks a tie by the answer
        seen first, so samples replayed in another order would change the answer.
        """
        prompt = request["messages"][-1]["content"]
        delay = 0.01 + 0.01 * (zlib.crc32(prompt.encode()) % 3)
        if "Passages:" in prompt:
            return Reply(texts=["Answer: NONE\nFollow-up query: Lina Berg birthplace"], delay=delay)
        return Reply(
            texts=["Bergen", "Oslo", "Bergen", "Oslo", "Trondheim"][: request.get("n", 1)], delay=delay
        )

    with FakeOpenAI(handler=differing) as server:
        live = CachedLLM(make_llm(server.url + "#m"), path)
        answer, report = BRAG(live, calibration=PRIORS, lam=0.0, k=1, cost="calls").run(question, corpus)
        live.close()
        made = len(server.chat_requests)
    replay = CachedLLM(make_llm(server.url + "#m"), path, mode="replay")  # server is gone
    answer2, report2 = BRAG(replay, calibration=PRIORS, lam=0.0, k=1, cost="calls").run(question, corpus)
    assert answer2 == answer == "Bergen"
    calls = report["totals"]["llm_calls"]
    assert made == calls >= 3 and "CB" in [s["action"] for s in report["steps"]]
    assert report2["totals"]["cached_calls"] == calls and report["totals"]["cached_calls"] == 0
    # Everything else, step by step: the actions, the replies, the posteriors, the token counts
    # and each call's latency as stored by the live run.
    assert without(report2, MEASURED) == without(report, MEASURED)
    latencies = [s["cost"]["llm_seconds"] for s in report["steps"] if s["action"]]
    assert len(set(latencies)) > 1 and all(t >= 0.01 for t in latencies)


def test_cache_keeps_each_calls_latency_for_replayed_runs(tmp_path):
    path = tmp_path / "cache.sqlite"
    corpus = Corpus(["Lina Berg was born in Bergen.", "Oslo is a city.", "The tower is tall."])
    question = "Where was Lina Berg born?"

    class Timed:
        """A backend that reports how long each call took (a different time per prompt)."""

        name = "timed"

        def __init__(self) -> None:
            self.reported: list[float] = []

        def complete(self, messages, **options) -> Completion:
            seconds = 0.25 + 0.01 * (zlib.crc32(messages[-1]["content"].encode()) % 50)
            self.reported.append(seconds)
            return Completion(["Answer: Bergen"] * options.get("n", 1), 10, 2, seconds=seconds)

    inner = Timed()
    live = CachedLLM(inner, path)
    _, report = BRAG(live, calibration=PRIORS, lam=0.0, k=1, cost="calls").run(question, corpus)
    live.close()
    calls = report["totals"]["llm_calls"]
    assert calls >= 2 and len(inner.reported) == calls
    # Live: each call's own time is what the report adds up, and what the cache stored.
    assert report["totals"]["llm_seconds"] == pytest.approx(sum(inner.reported), abs=1e-5)
    replay = CachedLLM(Timed(), path, mode="replay")
    _, again = BRAG(replay, calibration=PRIORS, lam=0.0, k=1, cost="calls").run(question, corpus)
    # Replayed: no call is made, but each step's stored latency comes back, in order.
    assert replay.llm.reported == [] and again["totals"]["cached_calls"] == calls
    per_step = [s["cost"]["llm_seconds"] for s in again["steps"] if s["action"]]
    assert per_step == pytest.approx(inner.reported, abs=1e-5)
    assert again["totals"]["llm_seconds_known"] is True


def test_a_cache_without_latencies_is_upgraded_and_retimed_once(tmp_path):
    path = tmp_path / "old.sqlite"
    key = llms.request_key("counting", MESSAGES, 1, 0.0, 64, None, None)
    db = sqlite3.connect(path)  # the schema before latencies were stored
    db.execute(
        "CREATE TABLE responses (key TEXT PRIMARY KEY, texts TEXT NOT NULL, prompt_tokens INTEGER, "
        "completion_tokens INTEGER, estimated INTEGER, requests INTEGER)"
    )
    db.execute("INSERT INTO responses VALUES (?, ?, 7, 1, 0, 1)", (key, json.dumps(["stored answer"])))
    db.commit()
    db.close()

    inner = CountingLLM()
    old = CachedLLM(inner, path, model="counting").complete(MESSAGES)
    assert (old.texts, old.seconds, old.cached, inner.calls) == (["stored answer"], None, True, 0)

    retimer = CachedLLM(inner, path, model="counting", mode="retime")
    timed = retimer.complete(MESSAGES)
    assert inner.calls == 1 and timed.texts == ["stored answer"]  # the stored reply is kept
    assert timed.seconds is not None and timed.seconds > 0  # measured now, then stored
    again = retimer.complete(MESSAGES)
    assert inner.calls == 1 and again.seconds == pytest.approx(timed.seconds)  # timed once only
    replayed = CachedLLM(inner, path, model="counting", mode="replay").complete(MESSAGES)
    assert replayed.seconds == pytest.approx(timed.seconds) and replayed.texts == ["stored answer"]


def test_unknown_latency_is_flagged_in_the_report(tmp_path):
    class Untimed:
        def complete(self, messages, **kwargs):
            return Completion(["Answer: Bergen"] * kwargs.get("n", 1), 5, 1, cached=True)

    _, report = BRAG(Untimed(), lam=0.0, k=1).run("Where was Lina Berg born?", Corpus(["Lina Berg."]))
    assert report["totals"]["llm_calls"] > 0
    assert report["totals"]["llm_seconds_known"] is False and report["totals"]["llm_seconds"] == 0.0


def test_cache_off_and_bad_mode(tmp_path):
    inner = CountingLLM()
    cache = CachedLLM(inner, tmp_path / "x.sqlite", mode="off")
    cache.complete(MESSAGES)
    cache.complete(MESSAGES)
    assert inner.calls == 2 and not (tmp_path / "x.sqlite").exists()
    with pytest.raises(ValueError, match="cache mode"):
        CachedLLM(inner, tmp_path / "y.sqlite", mode="sometimes")


# ---------------------------------------------------------------------------------- make_llm


def test_make_llm_routes_by_model_string(monkeypatch):
    assert isinstance(make_llm("http://127.0.0.1:9/v1"), OpenAICompatible)
    assert make_llm("https://example.invalid/v1#served").model == "served"
    hf = make_llm("Qwen/Qwen2.5-7B-Instruct", hf_token="hf_x", provider="together")
    assert isinstance(hf, HFInference) and hf.provider == "together" and hf.token == "hf_x"
    monkeypatch.setenv("HF_TOKEN", "hf_env")
    assert make_llm("org/model").token == "hf_env"
    with pytest.raises(ValueError, match="not a Hugging Face model id"):
        make_llm("not a model")


def test_default_model_follows_the_environment(monkeypatch):
    monkeypatch.delenv("BRAG_MODEL", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    assert llms.default_model() == "local"
    monkeypatch.setenv("HF_TOKEN", "hf_x")
    assert llms.default_model() == llms.DEFAULT_HF_MODEL
    monkeypatch.setenv("BRAG_MODEL", "http://127.0.0.1:8000/v1")
    assert llms.default_model() == "http://127.0.0.1:8000/v1"


# --------------------------------------------------------- issue 41: usage, numbers, a caller who goes


@BACKENDS
@pytest.mark.parametrize("usage", [-1_000_000_000, 2**70, 1.5], ids=["negative", "2**70", "fraction"])
def test_usage_no_request_could_have_is_estimated_not_believed(factory, usage):
    reply = Reply(usage={"prompt_tokens": usage, "completion_tokens": 3, "total_tokens": 3})
    with FakeOpenAI(handler=lambda request: reply) as server:
        result = factory(server.url).complete(MESSAGES)
    assert result.estimated and 0 < result.prompt_tokens < 1_000 and result.completion_tokens >= 1


@BACKENDS
def test_a_number_past_what_json_readers_take_is_a_malformed_response_in_plain_words(factory):
    digits = "9" * 5_000  # past Python's 4,300-digit limit for reading an integer
    body = (
        '{"choices": [{"message": {"role": "assistant", "content": "Paris"}}], '
        f'"usage": {{"prompt_tokens": {digits}, "completion_tokens": 1}}}}'
    ).encode()
    with FakeOpenAI(handler=lambda request: Reply(body=body)) as server:
        with pytest.raises(MalformedResponse) as failed:
            factory(server.url).complete(MESSAGES)
    message = str(failed.value)
    assert "malformed response" in message and "digits" not in message and "4300" not in message


@BACKENDS
def test_a_call_stops_soon_after_its_caller_goes_though_the_endpoint_says_nothing(factory):
    gone = threading.Event()
    with FakeOpenAI(handler=lambda request: Reply(delay=120)) as server:
        backend = factory(server.url, timeout=120)
        threading.Timer(0.5, gone.set).start()
        started = time.monotonic()
        with llms.cancellable(gone.is_set), pytest.raises(llms.Cancelled):
            backend.complete(MESSAGES)
        # Hang guard only: the endpoint would have held the call for two minutes.
        assert time.monotonic() - started < 60 and len(server.chat_requests) == 1


def test_a_retry_pause_ends_when_the_caller_goes():
    slept: list[float] = []
    gone = threading.Event()

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        gone.set()  # the caller leaves during the first slice of the pause

    policy = RetryPolicy(max_retries=3, base_delay=20.0, sleep=sleep)
    calls = []

    def send():
        calls.append(1)
        raise llms.errors.Retryable(RateLimited("busy"))

    with llms.cancellable(gone.is_set), pytest.raises(llms.Cancelled):
        policy.run(send)
    assert len(calls) == 1 and len(slept) == 1 and slept[0] <= llms.transport.CANCEL_POLL_SECONDS
