"""The SGLang client does not trust its servers, and talks to them with a key when asked.

Against `sglang_mock` (SGLang 0.5.23's HTTP protocol): the API key end to end (servers and
router launched with `--api-key` from an environment variable, `Authorization: Bearer` on
every request, 401 without it, the key in no command line, log, dumped config, repr or
error), answers that break the protocol (NaN / inf / positive log-probs, token ids outside
the vocabulary, missing fields, lengths that differ, a body cut short) failing with the
server, the request, the field and the value, and bounded retries of idempotent calls only.
"""

from __future__ import annotations

import json
import logging
import math
import pathlib
import pickle
import re
import socket
import subprocess
import sys
import time

import psutil
import pytest

from entr_megatron.config.loader import dump_config, load_config
from entr_megatron.config.rollout import RolloutConfig, SGLangConfig
from entr_megatron.controller.job.sglang_setup import model_vocab_size
from entr_megatron.rollout.engine import GenerateRequest, SamplingParams, generate
from entr_megatron.rollout.sglang import (
    RouterConfig,
    SGLangClient,
    SGLangEngine,
    SGLangEngineConfig,
    SGLangError,
    SGLangServerConfig,
    launch_router,
    launch_servers,
    parse_generate_output,
    router_command,
    server_command,
    terminate_all,
)
from entr_megatron.rollout.sglang.answers import BadAnswer, RouteLayout
from entr_megatron.rollout.sglang.client import api_key_from_env
from entr_megatron.rollout.sglang.launcher import API_KEY_SHIM, REDACTED

import sglang_mock  # noqa: E402  (tests/unit is on sys.path under pytest's rootdir import mode)
from sglang_mock import MockSGLangServer, encode_routes, engine_for

VOCAB = 1000
KEY = "entr-test-Key_0123456789abcdef"
KEY_ENV = "ENTR_TEST_SGLANG_API_KEY"
MOCK_SCRIPT = pathlib.Path(sglang_mock.__file__)
GAVE_UP = "; gave up after 4 attempts (3 retries, each with fresh rids)"
"""How a bad /generate answer ends under the engine's default 3 retries (each attempt got the same bad answer)."""


@pytest.fixture
def server():
    with MockSGLangServer(vocab_size=VOCAB) as s:
        yield s


def generate_error(engine: SGLangEngine, params: SamplingParams | None = None) -> SGLangError:
    (rid,) = engine.submit([GenerateRequest([1, 2, 3], params or SamplingParams(max_new_tokens=3), request_id="req7")])
    with pytest.raises(SGLangError) as e:
        engine.poll(timeout=10)
    assert rid == "req7"
    return e.value


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def everything_said(e: BaseException) -> str:
    return "\n".join([str(e), *getattr(e, "__notes__", []), repr(e)])


# --- the API key ---------------------------------------------------------------------------


def test_requests_without_the_key_are_refused_and_with_it_served(monkeypatch, caplog):
    caplog.set_level(logging.DEBUG)
    with MockSGLangServer(vocab_size=VOCAB, api_key=KEY) as server:
        assert SGLangClient(server.url).is_healthy(timeout=5)  # /health needs no key, as in SGLang
        with pytest.raises(SGLangError) as e:
            SGLangClient(server.url).model_info()
        assert e.value.status == 401 and "the server wants an API key: set rollout.sglang.api_key_env" in str(e.value)
        with pytest.raises(SGLangError) as e:
            SGLangClient(server.url, api_key="not-" + KEY).model_info()
        assert e.value.status == 401 and "refused our API key" in str(e.value) and KEY not in everything_said(e.value)
        assert server.unauthorized == [("GET", "/model_info"), ("GET", "/model_info")]

        monkeypatch.setenv(KEY_ENV, KEY)
        with engine_for(server, api_key_env=KEY_ENV) as engine:
            (rid,) = engine.submit([GenerateRequest([1, 2], SamplingParams(max_new_tokens=3))])
            results = []
            while not results:
                results += engine.poll(timeout=10)
            assert len(results[0].output_ids) == 3
            engine.pause()
            engine.resume()
            assert engine.health().alive
            assert KEY not in repr(engine.config) and KEY not in repr(engine.servers[0])
        assert len(server.unauthorized) == 2  # none of the engine's calls was refused
        assert {p for _, p, _ in server.calls} >= {"/generate", "/model_info", "/pause_generation", "/continue_generation"}
    assert KEY not in caplog.text


def test_the_key_comes_from_the_environment_only(monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    with pytest.raises(ValueError, match=f"environment variable {KEY_ENV} is not set or empty"):
        api_key_from_env(KEY_ENV)
    with pytest.raises(ValueError, match=f"SGLangEngineConfig.api_key_env='{KEY_ENV}'"):
        SGLangEngine(SGLangEngineConfig(urls=("http://127.0.0.1:9",), api_key_env=KEY_ENV))
    monkeypatch.setenv(KEY_ENV, "two words")
    with pytest.raises(ValueError, match="without whitespace") as e:
        api_key_from_env(KEY_ENV)
    assert "two words" not in str(e.value)
    # A config that holds the key instead of a variable's name is refused without echoing it.
    with pytest.raises(ValueError, match="rollout.sglang.api_key_env='<not shown>' is not valid") as e:
        SGLangConfig(api_key_env="sk-" + KEY)
    assert KEY not in str(e.value)
    with pytest.raises(TypeError, match="not picklable"):
        pickle.dumps(SGLangClient("http://127.0.0.1:9", api_key=KEY))


def test_the_key_is_not_in_the_dumped_config(monkeypatch):
    monkeypatch.setenv(KEY_ENV, KEY)
    cfg = load_config(None, ["rollout.engine=sglang", "rollout.dtype=auto", "launcher.device=cuda",
                             "launcher.gpus_per_node=2", f"rollout.sglang.api_key_env={KEY_ENV}"])
    text = dump_config(cfg)
    assert f"api_key_env: {KEY_ENV}" in text and KEY not in text
    assert KEY not in repr(cfg) and KEY not in repr(SGLangEngineConfig.from_config(cfg.rollout, ["http://a:1"]))


def test_launched_server_and_router_get_the_key_without_a_command_line_or_log(tmp_path, monkeypatch):
    monkeypatch.setenv(KEY_ENV, KEY)
    prefix = (sys.executable, str(MOCK_SCRIPT))
    cfg = SGLangServerConfig("tiny", port=free_port(), command_prefix=prefix, api_key_env=KEY_ENV)
    argv = server_command(cfg)
    assert argv[:5] == [sys.executable, "-c", API_KEY_SHIM, KEY_ENV, "path"] and KEY not in " ".join(argv)
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    (proc,) = launch_servers([cfg], tmp_path, startup_timeout_s=30, interval_s=0.1)
    try:
        assert KEY not in " ".join(psutil.Process(proc.pid).cmdline())
        with pytest.raises(SGLangError, match="HTTP 401"):
            SGLangClient(cfg.url).model_info()
        assert SGLangClient(cfg.url, api_key=KEY).model_info()["model_path"] == "tiny"
        router = launch_router(RouterConfig(worker_urls=(cfg.url,), port=free_port(), api_key_env=KEY_ENV,
                                            command_prefix=(*prefix, "--model-path", "router")),
                               tmp_path / "router.log", startup_timeout_s=30, interval_s=0.1)
        try:
            assert KEY not in " ".join(psutil.Process(router.pid).cmdline())
            with pytest.raises(SGLangError, match="HTTP 401"):
                SGLangClient(router.url).model_info()
            with engine_for(proc, router_url=router.url, api_key_env=KEY_ENV) as engine:
                engine.submit([GenerateRequest([4], SamplingParams(max_new_tokens=2))])
                results = []
                while not results:
                    results += engine.poll(timeout=10)
        finally:
            router.terminate(grace_s=5)
    finally:
        terminate_all([proc], grace_s=5)
    for log in (tmp_path / f"sglang-{cfg.port}.log", tmp_path / "router.log"):
        text = log.read_text()
        assert KEY not in text and f"'api_key': '{REDACTED}'" in text  # the mock prints its args as SGLang does
        assert f"{KEY_ENV} path {MOCK_SCRIPT}" in text.splitlines()[0]


def test_listen_address_defaults_to_loopback():
    assert SGLangConfig().host == "127.0.0.1"
    cmd = server_command(SGLangServerConfig("m"))
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and "--api-key" not in cmd
    rc = RouterConfig(worker_urls=("http://127.0.0.1:1",))
    cmd = router_command(rc)
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and rc.url.startswith("http://127.0.0.1:")
    assert SGLangServerConfig("m", host="0.0.0.0", port=5).url == "http://127.0.0.1:5"
    assert SGLangServerConfig("m", host="::1", port=5).url == "http://[::1]:5"
    with pytest.raises(ValueError, match="needs a Python command"):
        server_command(SGLangServerConfig("m", command_prefix=("/usr/bin/sglang-wrapper",), api_key_env=KEY_ENV))


# --- answers that break the protocol ---------------------------------------------------------


def _set(path, value):
    """A `tamper` that sets answer[path...] = value (on a one-sample answer)."""
    def tamper(answer):
        node = answer
        for key in path[:-1]:
            node = node[key]
        if value is KeyError:
            del node[path[-1]]
        else:
            node[path[-1]] = value(node[path[-1]]) if callable(value) else value
        return answer
    return tamper


@pytest.mark.parametrize("path, value, message", [
    (("meta_info", "output_token_logprobs", 1, 0), math.nan,
     "meta_info.output_token_logprobs[1][0]=nan is not a finite log-prob"),
    (("meta_info", "output_token_logprobs", 0, 0), -math.inf,
     "meta_info.output_token_logprobs[0][0]=-inf is not a finite log-prob"),
    (("meta_info", "output_token_logprobs", 2, 0), 0.5, "meta_info.output_token_logprobs[2][0]=0.5 is not a log-prob (> 0)"),
    (("output_ids", 0), 999999, "output_ids[0]=999999 is not a token id of the vocabulary ([0, 1000))"),
    (("output_ids", 1), -1, "output_ids[1]=-1 is not a token id of the vocabulary ([0, 1000))"),
    (("output_ids",), lambda ids: ids[:2], "len(meta_info.output_token_logprobs)=3 and len(output_ids)=2 do not match"),
    (("output_ids",), KeyError, "output_ids=None is missing"),
    (("meta_info", "output_token_logprobs"), KeyError,
     "meta_info.output_token_logprobs=None is missing for 3 output tokens (return_logprob was set)"),
    (("meta_info", "output_token_logprobs", 1, 1), -5, "meta_info.output_token_logprobs[1][1]=-5 is not output_ids[1]="),
    (("meta_info", "finish_reason"), "done", "meta_info.finish_reason='done' is not {type: stop | length | abort}"),
])
def test_bad_answers_name_the_server_request_field_and_value(server, path, value, message):
    server.tamper = _set(path, value)
    with engine_for(server, vocab_size=VOCAB) as engine:
        e = generate_error(engine)
    text = str(e)
    assert text.startswith(f"unusable /generate answer from {server.url}/generate for request req7 (sample 0 of 1, rid req7-0.r3): ")
    assert message in text and text.endswith(GAVE_UP)
    assert "server answer: " in e.__notes__[0]  # the answer itself, for the record
    assert [c["rid"] for c in server.calls_to("/generate")] == ["req7-0", "req7-0.r1", "req7-0.r2", "req7-0.r3"]


def test_bad_sampling_logprobs_and_a_missing_meta_info(server):
    server.tamper = _set(("meta_info", "output_token_sampling_logprobs", 0), math.inf)
    with engine_for(server) as engine:
        e = generate_error(engine, SamplingParams(max_new_tokens=3, top_k=5))
    assert "meta_info.output_token_sampling_logprobs[0]=inf is not a finite log-prob" in str(e)
    server.tamper = _set(("meta_info", "output_token_sampling_logprobs"), lambda v: v[:1])
    with engine_for(server) as engine:
        e = generate_error(engine, SamplingParams(max_new_tokens=3, top_k=5))
    assert "len(meta_info.output_token_sampling_logprobs)=1 and len(output_ids)=3 do not match" in str(e)
    server.tamper = _set(("meta_info",), KeyError)
    with engine_for(server) as engine:
        e = generate_error(engine)
    assert str(e) == f"POST {server.url}/generate: answer 0 of 1 has no meta_info object (missing){GAVE_UP}"
    server.tamper = lambda answer: "not json {"
    with engine_for(server) as engine:
        e = generate_error(engine)
    assert str(e).startswith(f"POST {server.url}/generate: the answer is not JSON, not an object or a list of them")


def test_a_truncated_body_is_a_clear_error(server):
    server.truncate_next["/generate"] = 10
    with engine_for(server, retries=0) as engine:
        e = generate_error(engine)
    assert re.fullmatch(rf"POST {re.escape(server.url)}/generate: the answer was cut off after 10 bytes \(\d+ more were "
                        r"announced\); not retried \(retries=0\)", str(e)), str(e)
    assert e.transient and len(server.calls_to("/generate")) == 1
    n = len(server.calls_to("/model_info"))
    server.truncate_next["/model_info"] = 5  # idempotent: retried, and the second answer is whole
    assert SGLangClient(server.url, retries=1, retry_backoff_s=0.01).model_info()["model_path"] == "mock-model"
    assert len(server.calls_to("/model_info")) == n + 2


ROUTES = RouteLayout(num_layers=2, top_k=2, num_experts=8)
"""The layout of `routes_server`: prompt [1, 2, 3] + 3 tokens -> 5 rows."""


@pytest.fixture
def routes_server():
    with MockSGLangServer(vocab_size=VOCAB, routes=(ROUTES.num_layers, ROUTES.top_k, ROUTES.num_experts)) as s:
        yield s


@pytest.mark.parametrize("value, message", [
    (KeyError, "meta_info.routed_experts=None is missing (return_routed_experts was set): the server ignores it; "
               "relaunch it with --enable-return-routed-experts"),
    (123, "meta_info.routed_experts=123 is not a base64 string"),
    ("not base64!", "meta_info.routed_experts='not base64!' is not base64"),
    (lambda v: encode_routes([[[1, 2]] * 2] * 4), "len(meta_info.routed_experts)='64 bytes' is not (prompt 3 + output 3 - 1 "
                                                   "tokens) * 2 layers * top_k 2 = 20 int32 values (80 bytes)"),
    (lambda v: encode_routes([[[1, 2], [9, 0]]] + [[[1, 2]] * 2] * 4),
     "meta_info.routed_experts[0][1][0]=9 (decoded [tokens, moe_layers, top_k]) is not an expert id in [0, 8)"),
    (lambda v: encode_routes([[[1, 2]] * 2] * 4 + [[[3, -1], [0, 0]]]),
     "meta_info.routed_experts[4][0][1]=-1 (decoded [tokens, moe_layers, top_k]) is not an expert id in [0, 8)"),
])
def test_bad_routes_name_the_server_request_field_and_value(routes_server, value, message):
    routes_server.tamper = _set(("meta_info", "routed_experts"), value)
    with engine_for(routes_server, routes=ROUTES) as engine:
        e = generate_error(engine)
    text = str(e)
    assert text.startswith(f"unusable /generate answer from {routes_server.url}/generate for request req7 (sample 0 of 1, "
                           "rid req7-0.r3): ")
    assert message in text and text.endswith(GAVE_UP)


def test_a_server_without_the_routes_flag_is_refused_saying_so(server):
    with engine_for(server, routes=ROUTES) as engine:  # server: launched without --enable-return-routed-experts
        e = generate_error(engine)
    assert "meta_info.routed_experts=None is missing" in str(e) and "--enable-return-routed-experts" in str(e)
    assert server.calls_to("/generate")[0]["return_routed_experts"] is True
    aborted_in_queue = {"meta_info": {"finish_reason": {"type": "abort", "message": "Abort in waiting queue"}}}
    assert parse_generate_output(aborted_in_queue, SamplingParams(), default_version=0, routes=ROUTES,
                                 prompt_len=3)["routed_experts"] is None  # never prefilled: no routes, no error


def test_parse_checks_every_token():
    ok = {"output_ids": [1, 2], "meta_info": {"finish_reason": {"type": "length"},
                                              "output_token_logprobs": [[-0.5, 1, None], [0.0, 2, None]]}}
    assert parse_generate_output(ok, SamplingParams(), default_version=0, vocab_size=3)["logprobs"] == [-0.5, 0.0]
    with pytest.raises(BadAnswer) as e:
        parse_generate_output(ok, SamplingParams(), default_version=0, vocab_size=2)
    assert (e.value.field, e.value.value) == ("output_ids[1]", 2) and isinstance(e.value, ValueError)
    aborted_in_queue = {"meta_info": {"finish_reason": {"type": "abort", "message": "Abort in waiting queue"}}}
    assert parse_generate_output(aborted_in_queue, SamplingParams(), default_version=0)["output_ids"] == []
    spans = dict(ok, meta_info={**ok["meta_info"], "weight_versions": [{"version": "1", "start": "0", "end": 2}]})
    with pytest.raises(BadAnswer, match=r"meta_info.weight_versions\[0\]=.* is not a \{version, start, end\} span"):
        parse_generate_output(spans, SamplingParams(), default_version=0)


# --- timeouts and retries --------------------------------------------------------------------


def test_idempotent_calls_are_retried_with_backoff(server):
    server.fail_next["/model_info"] = (503, "starting up")
    with engine_for(server, retries=2) as engine:
        n = len(server.calls_to("/model_info"))
        server.fail_next["/model_info"] = (503, "starting up")
        assert engine.health().alive  # one 503, then an answer
        assert len(server.calls_to("/model_info")) == n + 2
        server.fail_next["/model_info"] = (400, {"error": "bad request"})  # an answer: not retried
        assert not engine.health().alive and len(server.calls_to("/model_info")) == n + 3
        server.fail_next["/generate"] = (503, "overloaded")  # the engine sends it again, with fresh rids
        (result,) = generate(engine, [GenerateRequest([1, 2, 3], SamplingParams(max_new_tokens=3))], timeout_s=10)
        assert len(result.output_ids) == 3
        first, second = (c["rid"] for c in server.calls_to("/generate"))
        assert second == first + ".r1" and engine.generate_retries == 1
        server.fail_next["/flush_cache"] = (502, "bad gateway")
        assert "flushed" in engine.servers[0].flush_cache()


def test_retries_are_bounded_and_say_so():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    t0 = time.monotonic()
    with pytest.raises(SGLangError) as e:
        SGLangClient(dead, timeout_s=1, retries=2, retry_backoff_s=0.1).model_info()
    elapsed = time.monotonic() - t0
    assert 0.3 <= elapsed < 3.0  # backoff 0.1 + 0.2
    assert str(e.value).startswith(f"GET {dead}/model_info: cannot reach the server")
    assert str(e.value).endswith("; gave up after 3 attempts (2 retries)")
    with pytest.raises(SGLangError, match=r"; not retried \(retries=0\)$"):
        SGLangClient(dead, timeout_s=1).model_info()


def test_timeouts_and_retries_are_config_fields():
    s = SGLangConfig(request_timeout_s=7.0, generate_timeout_s=120.0, weight_update_timeout_s=300.0, http_retries=5,
                     retry_backoff_s=0.25, api_key_env=KEY_ENV, host="10.0.0.3")
    c = SGLangEngineConfig.from_config(RolloutConfig(engine="sglang", dtype="auto", sglang=s), ["http://a:1"], vocab_size=50)
    assert (c.request_timeout_s, c.generate_timeout_s, c.weight_update_timeout_s, c.retries, c.retry_backoff_s,
            c.api_key_env, c.vocab_size) == (7.0, 120.0, 300.0, 5, 0.25, KEY_ENV, 50)
    d = SGLangEngineConfig.from_config(RolloutConfig(engine="sglang", dtype="auto"), ["http://a:1"])
    assert (d.request_timeout_s, d.generate_timeout_s, d.weight_update_timeout_s, d.retries) == (60.0, 3600.0, 1800.0, 3)
    for name in ("request_timeout_s", "generate_timeout_s", "weight_update_timeout_s", "retry_backoff_s", "startup_timeout_s"):
        for bad in (0, -1.0, math.inf, math.nan):
            with pytest.raises(ValueError, match=rf"^rollout\.sglang\.{name}={bad!r} is not valid; must be a "):
                SGLangConfig(**{name: bad})
    with pytest.raises(ValueError, match=r"rollout\.sglang\.http_retries=-1 is not valid"):
        SGLangConfig(http_retries=-1)
    with pytest.raises(ValueError, match="generate_timeout_s must be a positive finite number"):
        SGLangEngineConfig(urls=("http://a:1",), generate_timeout_s=math.inf)
    with pytest.raises(ValueError, match="timeout_s must be a positive finite number"):
        SGLangClient("http://a:1", timeout_s=math.nan)


def test_vocab_size_comes_from_the_model_config(tmp_path):
    (tmp_path / "config.json").write_text('{"vocab_size": 151936}')
    assert model_vocab_size(tmp_path) == 151936
    assert model_vocab_size(tmp_path / "missing") is None


FAKE_SERVER = '''
import json, multiprocessing as mp, sys

def child(q):
    q.put("child ok")

if __name__ == "__main__":
    ctx = mp.get_context("spawn")  # SGLang starts its scheduler processes this way
    q = ctx.Queue()
    p = ctx.Process(target=child, args=(q,))
    p.start()
    print(json.dumps({"argv": sys.argv[1:], "child": q.get(timeout=30)}), flush=True)
    p.join(30)
'''


def test_the_shim_runs_a_module_as_python_m_would(tmp_path, monkeypatch):
    """`python -m sglang.launch_server` through API_KEY_SHIM: the module runs as __main__ (its
    spawned children too) with --api-key appended, and the key is only in its sys.argv."""
    (tmp_path / "fakepkg").mkdir()
    (tmp_path / "fakepkg" / "__init__.py").write_text("")
    (tmp_path / "fakepkg" / "serve.py").write_text(FAKE_SERVER)
    monkeypatch.setenv(KEY_ENV, KEY)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    cfg = SGLangServerConfig("m", port=31234, command_prefix=(sys.executable, "-m", "fakepkg.serve"), api_key_env=KEY_ENV)
    argv = server_command(cfg)
    assert argv[:6] == [sys.executable, "-c", API_KEY_SHIM, KEY_ENV, "-m", "fakepkg.serve"] and KEY not in argv
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["child"] == "child ok"
    assert got["argv"][:4] == ["--model-path", "m", "--host", "127.0.0.1"] and got["argv"][-2:] == ["--api-key", KEY]
