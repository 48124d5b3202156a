"""A server that answers badly (HTTP 500, garbage, a body cut short, too slowly): the engine names
the failure and sends the request again with fresh rids (the failed ones aborted), so nothing is
lost; a 4xx answer (the request itself is wrong) is not sent again; retries are bounded.

The mock generates tokens as a function of the prompt and the seed (`sglang_mock.mock_token`), so
a request sent again gives exactly the samples the failed attempt would have given: the reference
is the same request on a server that answered well."""

from __future__ import annotations

import threading
import time

import pytest

from entr_megatron.rollout.engine import GenerateRequest, SamplingParams, generate
from entr_megatron.rollout.sglang import SGLangError

from sglang_mock import MockSGLangServer, engine_for

PARAMS = SamplingParams(max_new_tokens=5, temperature=1.0, n=3, seed=11)


def request() -> GenerateRequest:
    return GenerateRequest([4, 5, 6], PARAMS, request_id="g1")


def samples(results) -> list[list[int]]:
    return [r.output_ids for r in sorted(results, key=lambda r: r.sample_index)]


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    """What a well-behaved server gives for `request()`."""
    with MockSGLangServer() as server, engine_for(server) as engine:
        return samples(generate(engine, [request()], timeout_s=20))


def rids(server: MockSGLangServer) -> list[list[str]]:
    return [call["rid"] for call in server.calls_to("/generate")]


def once(fn):
    """A tamper that applies `fn` to the first answer only."""
    done = threading.Event()

    def tamper(answer):
        if done.is_set():
            return answer
        done.set()
        return fn(answer)

    return tamper


def test_a_500_is_sent_again_with_fresh_rids_and_nothing_is_lost(reference):
    with MockSGLangServer() as server, engine_for(server) as engine:
        server.fail_next["/generate"] = (500, {"error": {"message": "internal error (mock)"}})
        assert samples(generate(engine, [request()], timeout_s=20)) == reference
        assert rids(server) == [["g1-0", "g1-1", "g1-2"], ["g1-0.r1", "g1-1.r1", "g1-2.r1"]]
        assert engine.generate_retries == 1
        aborted = {c["rid"] for c in server.calls_to("/abort_request")}
        assert {"g1-0", "g1-1", "g1-2"} <= aborted  # the failed attempt's rids, in case the server still ran them


@pytest.mark.parametrize("garbage", [
    lambda answer: "<html>502 from a proxy</html>",      # not JSON
    lambda answer: {"output_ids": [1]},                  # no list, no meta_info
    lambda answer: [dict(a, output_ids=a["output_ids"][:1]) for a in answer],  # lengths disagree
])
def test_garbage_is_named_and_sent_again(reference, garbage):
    with MockSGLangServer() as server, engine_for(server) as engine:
        server.tamper = once(garbage)
        assert samples(generate(engine, [request()], timeout_s=20)) == reference
        assert len(rids(server)) == 2 and engine.generate_retries == 1


def test_a_body_cut_short_is_sent_again(reference):
    with MockSGLangServer() as server, engine_for(server) as engine:
        server.truncate_next["/generate"] = 20
        assert samples(generate(engine, [request()], timeout_s=20)) == reference
        assert len(rids(server)) == 2


def test_a_slow_server_times_out_its_attempt_is_aborted_and_the_request_sent_again(reference):
    with MockSGLangServer(token_delay_s=0.3) as server, engine_for(server, generate_timeout_s=1.0) as engine:
        # the first attempt takes 5 x 0.3 s > 1 s; the next ones are fast
        threading.Timer(1.1, lambda: setattr(server, "token_delay_s", 0.0)).start()
        t0 = time.monotonic()
        assert samples(generate(engine, [request()], timeout_s=20)) == reference
        assert time.monotonic() - t0 < 10
        assert rids(server)[0] == ["g1-0", "g1-1", "g1-2"] and rids(server)[-1][0].startswith("g1-0.r")
        assert "g1-0" in {c["rid"] for c in server.calls_to("/abort_request")}


def test_a_4xx_is_not_sent_again():
    with MockSGLangServer() as server, engine_for(server) as engine:
        server.fail_next["/generate"] = (400, {"error": "unknown field `top_q`"})
        engine.submit([request()])
        with pytest.raises(SGLangError) as e:
            engine.poll(timeout=10)
        assert e.value.status == 400 and len(rids(server)) == 1 and engine.generate_retries == 0


def test_retries_are_bounded_and_the_error_names_the_server_request_and_answer():
    with MockSGLangServer() as server, engine_for(server, retries=2) as engine:
        server.tamper = lambda answer: "garbage"
        engine.submit([request()])
        with pytest.raises(SGLangError) as e:
            engine.poll(timeout=20)
        text = str(e.value)
        assert text.startswith(f"POST {server.url}/generate: the answer is not JSON")
        assert text.endswith("; gave up after 3 attempts (2 retries, each with fresh rids)")
        assert "server answer: garbage" in e.value.__notes__[0] and "request g1 (3 samples)" in e.value.__notes__
        assert len(rids(server)) == 3


def test_an_abort_between_two_attempts_ends_the_request():
    with MockSGLangServer() as server, engine_for(server, retry_backoff_s=1.0) as engine:
        server.fail_next["/generate"] = (503, "overloaded")
        (rid,) = engine.submit([request()])
        time.sleep(0.3)  # inside the backoff
        engine.abort([rid])
        results = generate_results(engine, 3)
        assert {r.finish_reason for r in results} == {"abort"} and len(rids(server)) == 1


def generate_results(engine, n: int, timeout_s: float = 20.0):
    out, deadline = [], time.monotonic() + timeout_s
    while len(out) < n and time.monotonic() < deadline:
        out += engine.poll(timeout=0.5)
    assert len(out) == n, out
    return out
