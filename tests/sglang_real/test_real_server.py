"""One real SGLang 0.5.23 server on CPU (conftest `server`), driven as learner rank 0 and the
controller drive it: weights pushed over gloo through /begin_weight_update,
/update_weights_from_distributed and /end_weight_update, generation through SGLangEngine. Every
answer is checked against an independent reference: the same weights in transformers (real_server.Reference).
"""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from entr_megatron.rollout.engine import generate
from entr_megatron.rollout.sglang import SGLangClient, SGLangEngine, SGLangEngineConfig, SGLangError
from entr_megatron.rollout.sglang.tensor_payload import serialize_named_tensors, shared_buffer
from entr_megatron.tasks import build_char_tokenizer

from real_server import (
    FLOAT32_ATOL,
    PROMPT,
    Reference,
    full_time,
    link,
    link_shared,
    max_diff,
    nothing_for,
    request,
    results,
    submit_and_pause_midway,
)

LONG = 56
"""Tokens of a long response (the model has 64 positions, the prompt 6)."""

VOCAB = len(build_char_tokenizer())


@pytest.fixture(scope="module")
def ref(model_dir) -> Reference:
    return Reference(model_dir)


@pytest.fixture(scope="module")
def url(server) -> str:
    return server.url


def raw(url: str, recorder, name: str, method: str, path: str, body=None):
    """One call through the raw client, recorded; returns (status, answer)."""
    client = SGLangClient(url, 120)
    try:
        status, answer = 200, client.call(method, path, body)
    except SGLangError as e:
        status = e.status
        try:
            answer = json.loads(e.body) if e.body else None
        except ValueError:
            answer = e.body
    recorder(name, method, path, body, status, answer)
    return status, answer


def test_logprobs_equal_transformers_on_the_same_weights(url, ref, recorder):
    weights = ref.weights(seed=1)
    with link(url, VOCAB) as engine:
        version = engine.weight_version + 1
        engine.update_weights(weights, version)
        (greedy,) = generate(engine, [request(16, temperature=0.0)], timeout_s=120)
        assert greedy.output_ids == ref.greedy(weights, PROMPT, 16)
        assert max_diff(greedy.logprobs, ref.logprobs(weights, PROMPT, greedy.output_ids)) < FLOAT32_ATOL
        assert greedy.versions == [version] * 16 and greedy.finish_reason == "length"
        for temperature in (1.0, 0.7):  # SGLang reports log_softmax(logits / T) of the sampled token
            samples = generate(engine, [request(12, temperature=temperature, n=3)], timeout_s=120)
            for s in samples:
                want = ref.logprobs(weights, PROMPT, s.output_ids, temperature)
                assert max_diff(s.logprobs, want) < FLOAT32_ATOL, (temperature, s.logprobs, want)
        # top-k: the behaviour log-prob is the one renormalised over the k kept tokens (return_sampling_mask)
        samples = generate(engine, [request(10, temperature=1.0, n=2, top_k=5, return_raw_logprobs=True)], timeout_s=120)
        for s in samples:
            logits = ref.logits(weights, PROMPT + s.output_ids)
            kept = logits.topk(5, dim=-1).values
            want = [(logits[len(PROMPT) - 1 + i, t] - torch.logsumexp(kept[len(PROMPT) - 1 + i], 0)).item()
                    for i, t in enumerate(s.output_ids)]
            assert max_diff(s.logprobs, want) < FLOAT32_ATOL
            assert max_diff(s.raw_logprobs, ref.logprobs(weights, PROMPT, s.output_ids)) < FLOAT32_ATOL
    body = {"input_ids": PROMPT, "rid": "rec-single", "return_logprob": True, "stream": False,
            "sampling_params": {"max_new_tokens": 4, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "ignore_eos": True}}
    raw(url, recorder, "generate", "POST", "/generate", body)
    body = {"input_ids": [PROMPT, PROMPT], "rid": ["rec-b-0", "rec-b-1"], "return_logprob": True, "stream": False,
            "return_sampling_mask": True,
            "sampling_params": {"max_new_tokens": 3, "temperature": 1.0, "top_p": 0.9, "top_k": 5, "ignore_eos": True}}
    raw(url, recorder, "generate_batch_sampling_mask", "POST", "/generate", body)


def test_a_push_changes_the_answers_exactly_as_the_weights_and_labels_each_token(url, ref, recorder):
    """Pushed mid-generation with the request retracted (kv_on_update 'recompute'): the tokens before
    the push are those of the old weights, the ones after those of the new weights over the whole
    prefix (the KV cache recomputed), each labelled with its version."""
    old, new = ref.weights(seed=2), ref.weights(seed=3)
    with link(url, VOCAB, kv_on_update="recompute") as engine:
        v_old = engine.weight_version + 1
        engine.update_weights(old, v_old)
        make = lambda: request(LONG, temperature=0.0)  # noqa: E731
        submit_and_pause_midway(engine, make, full_time(engine, make))  # the caller's pause: kept by update_weights
        report = engine.update_weights(new, v_old + 1)
        engine.resume()
        (s,) = results(engine, 1)
        assert report.num_tensors == len(old) and len(s.output_ids) == LONG
        k = s.versions.count(v_old)
        assert 0 < k < LONG and s.versions == [v_old] * k + [v_old + 1] * (LONG - k), s.versions
        assert s.output_ids[:k] == ref.greedy(old, PROMPT, k)
        assert max_diff(s.logprobs[:k], ref.logprobs(old, PROMPT, s.output_ids[:k])) < FLOAT32_ATOL
        tail = ref.logprobs(new, PROMPT + s.output_ids[:k], s.output_ids[k:])
        assert max_diff(s.logprobs[k:], tail) < FLOAT32_ATOL  # the new weights over the whole prefix
        assert s.output_ids[k:] == ref.greedy(new, PROMPT + s.output_ids[:k], LONG - k)
    # kept in place (kv_on_update 'keep'): the versions are right and nothing is lost
    with link(url, VOCAB, kv_on_update="keep") as engine:
        v = engine.weight_version
        make = lambda: request(LONG, temperature=1.0)  # noqa: E731
        submit_and_pause_midway(engine, make, full_time(engine, make))
        engine.update_weights(old, v + 1)
        engine.resume()
        (s,) = results(engine, 1)
        k = s.versions.count(v)
        assert len(s.output_ids) == LONG and 0 < k < LONG and s.versions == [v] * k + [v + 1] * (LONG - k), s.versions
        assert max_diff(s.logprobs[:k], ref.logprobs(new, PROMPT, s.output_ids[:k])) < FLOAT32_ATOL


def test_a_push_through_shared_memory_changes_the_answers_exactly_as_the_weights(url, ref, recorder):
    """rollout.placement colocated: each bucket packed into shared memory and loaded by
    /update_weights_from_tensor, whose payload SGLang's own SafeUnpickler and torch 2.14.1 read
    (ours is 2.13.0). Two versions through the same buffers, each served exactly."""
    with link_shared(url, VOCAB, weight_bucket_bytes=256 << 10) as engine:  # a dozen buckets a version
        for seed in (5, 6):
            weights = ref.weights(seed=seed)
            version = engine.weight_version + 1
            report = engine.update_weights(weights, version)
            assert report.num_tensors == len(weights) and report.version == version
            (greedy,) = generate(engine, [request(16, temperature=0.0)], timeout_s=120)
            assert greedy.output_ids == ref.greedy(weights, PROMPT, 16)
            assert max_diff(greedy.logprobs, ref.logprobs(weights, PROMPT, greedy.output_ids)) < FLOAT32_ATOL
            assert greedy.versions == [version] * 16
    # refused outside a session before the payload is read (recorded: the mock replays it)
    norm = shared_buffer(128 * 4).view(torch.float32)
    body = {"serialized_named_tensors": [serialize_named_tensors([("model.norm.weight", norm)])],
            "flush_cache": False, "abort_all_requests": False, "weight_version": None}
    status, answer = raw(url, recorder, "update_weights_from_tensor_without_session", "POST",
                         "/update_weights_from_tensor", body)
    assert status == 400 and "begin_weight_update" in answer["message"]


def test_a_push_refused_midway_never_serves_mixed_weights(url, ref, recorder):
    """SGLang loads each bucket as it arrives: a version refused at its third bucket leaves the
    server holding part of it. The engine keeps the server paused (labelled -1) until a whole
    version arrives; a request waiting meanwhile is served by that version only."""
    good, next_good = ref.weights(seed=4), ref.weights(seed=5)
    bad = dict(ref.weights(seed=6))
    bad["model.norm.weight"] = torch.ones(64)  # the model's is 128 wide; last in order: a late bucket
    client = SGLangClient(url, 60)
    with link(url, VOCAB, weight_bucket_bytes=1 << 20) as engine:
        v = engine.weight_version + 1
        engine.update_weights(good, v)
        # refused before any bucket (a session is open already): the old version keeps serving
        raw(url, recorder, "begin_weight_update", "POST", "/begin_weight_update", {"selector": "all"})
        raw(url, recorder, "begin_weight_update_while_open", "POST", "/begin_weight_update", {"selector": "all"})
        with pytest.raises(SGLangError, match="begin_weight_update"):
            engine.update_weights(next_good, v + 1)
        raw(url, recorder, "end_weight_update", "POST", "/end_weight_update", {})
        (s,) = generate(engine, [request(8, temperature=0.0)], timeout_s=60)
        assert s.versions == [v] * 8 and s.output_ids == ref.greedy(good, PROMPT, 8)
        # refused at a late bucket: held paused, labelled -1
        with pytest.raises(SGLangError) as e:
            engine.update_weights(bad, v + 1)
        assert e.value.status == 400 and "partially updated" in e.value.body, e.value.body
        assert any("stay paused, labelled version -1" in n for n in e.value.__notes__)
        recorder("update_weights_refused", "POST", "/update_weights_from_distributed", None, e.value.status,
                 json.loads(e.value.body))
        assert client.weight_version() == "-1"
        with SGLangEngine(SGLangEngineConfig(urls=(url,), vocab_size=VOCAB)) as user:  # the controller's engine
            user.submit([request(8, temperature=0.0)])
            assert nothing_for(user, 3.0), "a held server generated with part of a version"
            engine.update_weights(next_good, v + 2)  # whole: resumes it
            (s,) = results(user, 1)
        assert s.versions == [v + 2] * 8 and s.output_ids == ref.greedy(next_good, PROMPT, 8)
        assert max_diff(s.logprobs, ref.logprobs(next_good, PROMPT, s.output_ids)) < FLOAT32_ATOL


def test_a_push_kept_in_place_leaves_old_prefixes_in_the_cache(url, ref):
    """Why servers for kv_on_update 'keep' run without the prefix cache (sglang_servers.NO_PREFIX_CACHE):
    a push paused in place does not flush it, and a new request reuses its prompt's old KV."""
    old, new = ref.weights(seed=9), ref.weights(seed=10)
    with link(url, VOCAB, kv_on_update="recompute") as engine:  # pushed with a flush
        engine.update_weights(old, engine.weight_version + 1)
        (s,) = generate(engine, [request(4, temperature=0.0)], timeout_s=60)  # PROMPT's KV cached, old weights
        assert s.output_ids == ref.greedy(old, PROMPT, 4)
    with link(url, VOCAB, kv_on_update="keep") as engine:
        engine.update_weights(new, engine.weight_version + 1)  # no flush
        (stale,) = generate(engine, [request(4, temperature=0.0)], timeout_s=60)
        SGLangClient(url).flush_cache()
        (fresh,) = generate(engine, [request(4, temperature=0.0)], timeout_s=60)
    assert fresh.output_ids == ref.greedy(new, PROMPT, 4)
    want = ref.logprobs(new, PROMPT, fresh.output_ids)
    assert max_diff(fresh.logprobs, want) < FLOAT32_ATOL
    assert max_diff(stale.logprobs, ref.logprobs(new, PROMPT, stale.output_ids)) > 100 * FLOAT32_ATOL


def test_pause_and_continue_mid_generation_lose_nothing(url, ref):
    weights = ref.weights(seed=7)
    for kv in ("keep", "recompute"):  # SGLang pause modes in_place and retract
        with link(url, VOCAB, kv_on_update=kv) as engine:
            engine.update_weights(weights, engine.weight_version + 1)
            SGLangClient(url).flush_cache()  # (a push kept in place leaves old prefixes: test above)
            make = lambda: request(LONG, temperature=0.0)  # noqa: E731
            submit_and_pause_midway(engine, make, full_time(engine, make))
            assert nothing_for(engine, 2.0), f"{kv}: a paused server finished a request"
            engine.resume()
            (s,) = results(engine, 1)
            assert s.output_ids == ref.greedy(weights, PROMPT, LONG), kv
            assert max_diff(s.logprobs, ref.logprobs(weights, PROMPT, s.output_ids)) < FLOAT32_ATOL, kv


def test_abort_returns_the_tokens_so_far(url, ref, recorder):
    """Paused in place, an aborted request ends only once the server decodes again; retracted (back
    in the queue), at once. Either way with its tokens so far, which are the weights' own."""
    weights = ref.weights(seed=8)
    for kv, waits in (("keep", True), ("recompute", False)):
        with link(url, VOCAB, kv_on_update=kv) as engine:
            engine.update_weights(weights, engine.weight_version + 1)
            SGLangClient(url).flush_cache()
            make = lambda: request(LONG, temperature=0.0)  # noqa: E731
            rid = submit_and_pause_midway(engine, make, full_time(engine, make))
            engine.abort([rid])
            if waits:
                assert nothing_for(engine, 2.0), "an aborted request paused in place ended before the resume"
                engine.resume()
                (s,) = results(engine, 1)
            else:  # retracted: back in the queue, it ends at once; its answer has no tokens (0.5.23), unless
                (s,) = results(engine, 1, timeout_s=10)  # the abort reached it before the retraction did
                engine.resume()
                assert s.finish_reason == "abort" and len(s.output_ids) < LONG
                assert s.output_ids == ref.greedy(weights, PROMPT, len(s.output_ids)), kv
                continue
            assert s.finish_reason == "abort" and 0 < len(s.output_ids) < LONG, (kv, s.finish_reason, len(s.output_ids))
            assert s.output_ids == ref.greedy(weights, PROMPT, len(s.output_ids)), kv
            assert max_diff(s.logprobs, ref.logprobs(weights, PROMPT, s.output_ids)) < FLOAT32_ATOL, kv
            (rid,) = engine.submit([request(LONG, temperature=0.0)])  # running: ends within a step or two
            engine.abort([rid])
            (s,) = results(engine, 1)
            assert s.finish_reason == "abort" and len(s.output_ids) < LONG
    raw(url, recorder, "abort_request_unknown", "POST", "/abort_request", {"rid": "no-such-rid", "abort_all": False})
    for mode in ("in_place", "retract"):
        record_abort_while_paused(url, recorder, mode)


def record_abort_while_paused(url: str, recorder, mode: str) -> None:
    """The raw answer of a request aborted while the server is paused in `mode` (recorded)."""
    client = SGLangClient(url, 120)
    body = {"input_ids": PROMPT, "return_logprob": True, "stream": False,
            "sampling_params": {"max_new_tokens": LONG, "temperature": 0.0, "ignore_eos": True}}
    t0 = time.monotonic()
    client.call("POST", "/generate", {**body, "rid": "rec-timing"})
    t_full = time.monotonic() - t0
    for attempt, fraction in enumerate((0.4, 0.25, 0.15, 0.08, 0.4, 0.25, 0.15, 0.08)):
        rid, box = f"rec-abort-{mode}-{attempt}", {}
        thread = threading.Thread(target=lambda: box.setdefault("answer", client.call("POST", "/generate", {**body, "rid": rid})))
        thread.start()
        time.sleep(fraction * t_full)
        client.call("POST", "/pause_generation", {"mode": mode})
        client.call("POST", "/abort_request", {"rid": rid, "abort_all": False})
        thread.join(2.0 if mode == "in_place" else 10.0)
        client.call("POST", "/continue_generation", {})
        thread.join(30)
        answer = box["answer"]
        tokens = len(answer["output_ids"])
        # in place: its tokens so far; retracted: "Abort in waiting queue", no tokens (the abort may also reach
        # a request before its retraction: then it is the in-place answer, and we try again)
        wanted = (0 < tokens < LONG) if mode == "in_place" else tokens == 0
        if answer["meta_info"]["finish_reason"]["type"] == "abort" and wanted:
            recorder(f"generate_aborted_while_paused_{mode}", "POST", "/generate", {**body, "rid": rid}, 200, answer)
            return
    raise AssertionError(f"no request was caught paused ({mode}) and aborted in {attempt + 1} tries")


def test_control_answers(url, recorder):
    """What the routes the engine uses answer (recorded; the mock replays them)."""
    raw(url, recorder, "health", "GET", "/health")
    raw(url, recorder, "model_info", "GET", "/model_info")
    raw(url, recorder, "pause_generation_in_place", "POST", "/pause_generation", {"mode": "in_place"})
    raw(url, recorder, "continue_generation", "POST", "/continue_generation", {})
    raw(url, recorder, "flush_cache", "POST", "/flush_cache")
    raw(url, recorder, "update_weights_without_session", "POST", "/update_weights_from_distributed",
        {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[128]], "group_name": "weight_update_group",
         "flush_cache": False, "abort_all_requests": False, "weight_version": None, "load_format": "flattened_bucket"})
    raw(url, recorder, "destroy_unknown_group", "POST", "/destroy_weights_update_group", {"group_name": "no-such-group"})
    raw(url, recorder, "generate_unknown_sampling_field", "POST", "/generate",
        {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2, "top_q": 0.5}})
    raw(url, recorder, "generate_top_k_zero", "POST", "/generate",
        {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2, "top_k": 0}})
    status, info = raw(url, recorder, "server_info", "GET", "/server_info")
    assert status == 200 and info["version"] == "0.5.23" and info["device"] == "cpu"
    assert info["attention_backend"] == "torch_native" and info["host"] == "127.0.0.1"
    version = SGLangClient(url).weight_version()
    raw(url, recorder, "update_weight_version", "POST", "/update_weight_version",
        {"new_version": version, "abort_all_requests": False})
