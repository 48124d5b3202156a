"""The SGLang engine against `sglang_mock` (the HTTP protocol of SGLang 0.5.23), and its launcher.

Verified here only against the recorded protocol, never against a real SGLang (it needs
GPUs): payload fields, answer parsing (log-probs, per-token versions), errors that carry
the server's answer, timeouts, abort / pause / continue / flush, and the weight-update
handshake (group ranks, session, buckets, versions). The mock moves no tensors: the
bytes a sender would broadcast are checked against SGLang's bucket layout instead.
"""

from __future__ import annotations

import pathlib
import socket
import sys
import time

import pytest
import torch

from entr_megatron.rollout.engine import (
    GenerateRequest,
    RolloutEngine,
    SamplingParams,
    WeightReceiver,
    generate,
)
from entr_megatron.rollout.sglang import (
    ROUTES_FLAG,
    FlatBucket,
    RouteLayout,
    RouterConfig,
    SGLangClient,
    SGLangError,
    SGLangServerConfig,
    SGLangTimeout,
    generate_payload,
    iter_flattened_buckets,
    launch_router,
    launch_servers,
    pack_flattened_bucket,
    parse_generate_output,
    router_command,
    sample_seed,
    sampling_params_payload,
    server_command,
    terminate_all,
    unpack_flattened_bucket,
)
from entr_megatron.weight_sync.sglang_transports import SGLangWeightUpdate

import sglang_mock  # noqa: E402  (tests/unit is on sys.path under pytest's rootdir import mode)
from sglang_mock import (
    SAMPLING_FIELDS,
    MockSGLangServer,
    encode_routes,
    engine_for,
    mock_logprob,
    mock_routes,
    mock_sampling_logprob,
    mock_token,
)

VOCAB = 1000
MOCK_SCRIPT = pathlib.Path(sglang_mock.__file__)


@pytest.fixture
def server():
    with MockSGLangServer(vocab_size=VOCAB) as s:
        yield s


def wait_for(pred, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


class RecordingSender:
    """Rank 0 of the weight group, without the group: keeps what it would broadcast."""

    def __init__(self):
        self.sent: list[torch.Tensor] = []

    def broadcast(self, tensor: torch.Tensor) -> None:
        self.sent.append(tensor.clone())


# --- payloads and answers (pure) ---------------------------------------------------------


def test_sampling_params_use_only_recorded_fields():
    sp = sampling_params_payload(SamplingParams(temperature=0.7, top_p=0.9, top_k=0, max_new_tokens=5,
                                                stop_token_ids=(2, 3), seed=11), index=4)
    assert set(sp) <= set(SAMPLING_FIELDS)
    assert sp == {"max_new_tokens": 5, "temperature": 0.7, "top_p": 0.9, "top_k": -1, "ignore_eos": False,
                  "stop_token_ids": [2, 3], "sampling_seed": sample_seed(11, 4)}
    assert sampling_params_payload(SamplingParams(top_k=20))["top_k"] == 20
    assert "sampling_seed" not in sampling_params_payload(SamplingParams())
    assert sampling_params_payload(SamplingParams(temperature=0.0))["temperature"] == 0.0


def test_generate_payload_expands_n_with_own_rids():
    one = generate_payload([1, 2], SamplingParams(), ["r-0"])
    assert one == {"input_ids": [1, 2], "rid": "r-0", "sampling_params": sampling_params_payload(SamplingParams()),
                   "return_logprob": True, "stream": False}
    three = generate_payload([1, 2], SamplingParams(top_p=0.8, seed=3), ["r-0", "r-1", "r-2"])
    assert three["input_ids"] == [[1, 2]] * 3 and three["rid"] == ["r-0", "r-1", "r-2"]
    assert [sp["sampling_seed"] for sp in three["sampling_params"]] == [sample_seed(3, i) for i in range(3)]
    assert three["return_sampling_mask"] is True  # truncated: the behaviour log-prob needs the support
    assert "n" not in three["sampling_params"][0]
    unseeded = generate_payload([1], SamplingParams(n=2), ["a", "b"], seed=5)  # the engine always picks one
    assert [sp["sampling_seed"] for sp in unseeded["sampling_params"]] == [sample_seed(5, 0), sample_seed(5, 1)]


def test_generate_payload_asks_for_routes_only_when_recording():
    assert "return_routed_experts" not in generate_payload([1, 2], SamplingParams(), ["r-0"])
    both = generate_payload([1, 2], SamplingParams(n=2), ["r-0", "r-1"], routes=True)
    assert both["return_routed_experts"] is True  # one bool for the whole batch (io_struct.py)


def test_parse_routes_into_the_sample_layout():
    prompt, out = [4, 5, 6], [7, 8]
    meta = {"id": "x", "finish_reason": {"type": "length"},
            "output_token_logprobs": [[-0.5, t, None] for t in out],
            "routed_experts": encode_routes(mock_routes(prompt + out, 3, 2, 300))}
    ans = {"output_ids": out, "meta_info": meta}
    got = parse_generate_output(ans, SamplingParams(), default_version=0, routes=RouteLayout(3, 2, 300),
                                prompt_len=len(prompt))["routed_experts"]
    want = torch.tensor(mock_routes(prompt + out, 3, 2, 300))
    assert got.shape == (len(prompt) + len(out) - 1, 3, 2) and got.dtype == torch.int16 and torch.equal(got.long(), want)
    dense_middle = RouteLayout(3, 2, 300, moe_layers=(0, 2))  # SGLang reports every layer: keep the MoE ones
    got = parse_generate_output(ans, SamplingParams(), default_version=0, routes=dense_middle, prompt_len=3)["routed_experts"]
    assert torch.equal(got.long(), want[:, [0, 2]])
    assert parse_generate_output(ans, SamplingParams(), default_version=0)["routed_experts"] is None  # not asked
    for bad in (dict(num_layers=0, top_k=1, num_experts=2), dict(num_layers=2, top_k=3, num_experts=2),
                dict(num_layers=2, top_k=1, num_experts=2, moe_layers=(1, 0)),
                dict(num_layers=2, top_k=1, num_experts=2, moe_layers=(2,))):
        with pytest.raises(ValueError, match="RouteLayout"):
            RouteLayout(**bad)


def test_engine_returns_the_routes_the_server_encoded():
    prompts = [[3, 1, 4, 1, 5], [9]]
    with MockSGLangServer(vocab_size=VOCAB, routes=(2, 2, 8)) as server:
        with engine_for(server, routes=RouteLayout(num_layers=2, top_k=2, num_experts=8)) as engine:
            results = generate(engine, [GenerateRequest(p, SamplingParams(max_new_tokens=4, n=2), group_id=g)
                                        for g, p in enumerate(prompts)], timeout_s=10)
        assert all(p["return_routed_experts"] is True for p in server.calls_to("/generate"))
    assert len(results) == 4
    for r in results:
        fed = r.prompt_ids + r.output_ids
        assert r.routed_experts.dtype == torch.uint8 and r.routed_experts.shape == (len(fed) - 1, 2, 2)
        assert torch.equal(r.routed_experts.long(), torch.tensor(mock_routes(fed, 2, 2, 8)))
        assert torch.equal(r.to_sample().routed_experts, r.routed_experts)  # Sample checks P + R - 1 rows
    with MockSGLangServer(vocab_size=VOCAB, routes=(2, 2, 8)) as server, engine_for(server) as engine:
        (off,) = generate(engine, [GenerateRequest([1, 2], SamplingParams(max_new_tokens=2))], timeout_s=10)
        assert off.routed_experts is None and "return_routed_experts" not in server.calls_to("/generate")[0]


def answer(tokens, *, logprobs=None, sampling=None, spans=None, version="0", finish=None):
    meta = {"id": "x", "finish_reason": finish or {"type": "length", "length": len(tokens)}, "weight_version": version,
            "output_token_logprobs": [[lp, t, None] for lp, t in zip(logprobs or [-0.5] * len(tokens), tokens)]}
    if sampling is not None:
        meta["output_token_sampling_logprobs"] = sampling
    if spans is not None:
        meta["weight_versions"] = spans
    return {"output_ids": tokens, "meta_info": meta}


def test_parse_answer_logprobs_versions_and_finish():
    plain = parse_generate_output(answer([5, 6], logprobs=[-1.0, -2.0]), SamplingParams(), default_version=0)
    assert plain["logprobs"] == [-1.0, -2.0] and plain["entropy"] is None and plain["finish_reason"] == "length"
    trunc = parse_generate_output(answer([5, 6], sampling=[-0.1, -0.2]), SamplingParams(top_k=5), default_version=0)
    assert trunc["logprobs"] == [-0.1, -0.2]
    greedy = parse_generate_output(answer([5, 6], logprobs=[-1.0, -2.0], finish={"type": "stop", "matched": 6}),
                                   SamplingParams(temperature=0.0, return_raw_logprobs=True), default_version=0)
    assert greedy["logprobs"] == [-1.0, -2.0] and greedy["entropy"] is None and greedy["raw_logprobs"] == [-1.0, -2.0]
    assert greedy["finish_reason"] == "stop"
    spans = [{"version": "3", "start": 0, "end": 1}, {"version": "4", "start": 1, "end": 3}]
    assert parse_generate_output(answer([1, 2, 3], spans=spans, version="4"), SamplingParams(), default_version=0)["versions"] == [3, 4, 4]
    assert parse_generate_output(answer([1, 2], version="7"), SamplingParams(), default_version=0)["versions"] == [7, 7]
    assert parse_generate_output(answer([1], version="default"), SamplingParams(), default_version=2)["versions"] == [2]
    with pytest.raises(ValueError, match="do not match"):
        parse_generate_output(answer([1, 2], logprobs=[-1.0]), SamplingParams(), default_version=0)
    with pytest.raises(ValueError, match="sampling_logprobs"):
        parse_generate_output(answer([1, 2]), SamplingParams(top_p=0.5), default_version=0)


def test_flattened_bucket_matches_sglang_layout():
    tensors = [("a.bf16", torch.randn(3, 1).bfloat16()), ("b.f32", torch.randn(2, 2)), ("c.i8", torch.arange(5, dtype=torch.int8)),
               ("d.f64", torch.randn(3, dtype=torch.float64))]
    bucket = pack_flattened_bucket(tensors)
    assert bucket.flat.dtype == torch.uint8 and bucket.num_bytes == 6 + 16 + 5 + 24  # no padding
    assert bucket.names == ["d.f64", "b.f32", "a.bf16", "c.i8"]  # larger elements first: every offset aligned
    assert bucket.dtypes == ["float64", "float32", "bfloat16", "int8"] and bucket.shapes[2] == [3, 1]
    back = dict(unpack_flattened_bucket(bucket))
    for name, t in tensors:
        assert torch.equal(back[name], t)
    sizes = [b.names for b in iter_flattened_buckets([(f"w{i}", torch.zeros(4)) for i in range(5)], bucket_bytes=40)]
    assert sizes == [["w0", "w1"], ["w2", "w3"], ["w4"]]
    (cast,) = iter_flattened_buckets([("w", torch.ones(3)), ("i", torch.ones(2, dtype=torch.int64))], 1 << 20, torch.bfloat16)
    assert dict(zip(cast.names, cast.dtypes)) == {"w": "bfloat16", "i": "int64"}


# --- the engine against the mock --------------------------------------------------------


def test_engine_is_a_rollout_engine_and_labels_the_initial_version(server):
    with engine_for(server, initial_version=5) as engine:
        assert isinstance(engine, RolloutEngine)
        assert engine.weight_version == 5
        assert server.calls_to("/update_weight_version") == [{"new_version": "5", "abort_all_requests": False}]
        assert server.weight_version == "5"
        h = engine.health()
        assert h.alive and h.weight_version == 5 and h.error is None


def test_generate_round_trip_logprobs_and_versions(server):
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
    params = SamplingParams(temperature=0.8, max_new_tokens=6, seed=7, n=3)
    with engine_for(server) as engine:
        results = generate(engine, [GenerateRequest(p, params, group_id=g, metadata={"g": g}) for g, p in enumerate(prompts)], timeout_s=10)
    assert len(results) == 6
    for r in results:
        prompt = prompts[r.group_id]
        want = [mock_token(prompt, sample_seed(7, r.sample_index), False, t, VOCAB) for t in range(6)]
        assert r.prompt_ids == prompt and r.output_ids == want and r.metadata == {"g": r.group_id}
        assert r.logprobs == pytest.approx([mock_logprob(t, 0.8) for t in want])
        assert r.versions == [0] * 6 and r.finish_reason == "length" and r.entropy is None
        sample = r.to_sample()
        assert sample.behaviour_logprobs == r.logprobs and sample.versions == r.versions
    payload = next(p for p in server.calls_to("/generate") if p["input_ids"][0] == prompts[0])
    assert payload["rid"] == [f"{results[0].request_id}-{i}" for i in range(3)] and payload["return_logprob"] is True


def test_truncated_and_greedy_sampling(server):
    server.eos_token_id = mock_token([8, 8], None, True, 2, VOCAB)  # greedy hits EOS at step 2
    with engine_for(server) as engine:
        trunc, greedy = generate(engine, [
            GenerateRequest([1, 2, 3], SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_new_tokens=4, return_raw_logprobs=True)),
            GenerateRequest([8, 8], SamplingParams(temperature=0.0, max_new_tokens=10)),
        ])
        with pytest.raises(ValueError, match="return_raw_logprobs"):
            engine.submit([GenerateRequest([1], SamplingParams(temperature=0.5, return_raw_logprobs=True))])
    assert trunc.logprobs == pytest.approx([mock_sampling_logprob(t, 1.0) for t in trunc.output_ids])
    assert trunc.raw_logprobs == pytest.approx([mock_logprob(t, 1.0) for t in trunc.output_ids])
    payloads = {tuple(p["input_ids"]): p for p in server.calls_to("/generate")}
    assert payloads[(1, 2, 3)]["return_sampling_mask"] is True and "return_sampling_mask" not in payloads[(8, 8)]
    assert greedy.finish_reason == "stop" and len(greedy.output_ids) == 3 and greedy.output_ids[-1] == server.eos_token_id
    assert greedy.logprobs == pytest.approx([mock_logprob(t, 1.0) for t in greedy.output_ids]) and greedy.entropy is None


def test_errors_carry_the_server_answer(server):
    client = SGLangClient(server.url, timeout_s=5)
    with pytest.raises(SGLangError) as e:
        client.generate({"input_ids": [1], "sampling_params": {"max_new_tokens": 2, "top_q": 0.5}})
    assert e.value.status == 400 and "unknown field `top_q`" in "\n".join(e.value.__notes__)
    with pytest.raises(SGLangError) as e:
        client.call("GET", "/no_such_endpoint")
    assert e.value.status == 404 and "Not Found" in e.value.__notes__[0]
    server.groups.clear()
    server.session_open = True
    with pytest.raises(SGLangError) as e:
        client.update_weights_from_distributed(["w"], ["float32"], [[2]])
    assert "init_weights_update_group" in e.value.__notes__[0]
    with engine_for(server, retries=0) as engine:  # (retried: test_sglang_bad_input.py)
        server.fail_next["/generate"] = (500, {"error": {"message": "CUDA out of memory (mock)"}})
        engine.submit([GenerateRequest([1, 2], SamplingParams(max_new_tokens=2))])
        with pytest.raises(SGLangError) as e:
            engine.poll(timeout=5)
        assert e.value.status == 500 and any("CUDA out of memory (mock)" in n for n in e.value.__notes__)
        server.fail_next["/model_info"] = (500, "internal error (mock)")  # a 503 is retried (test_sglang_safety)
        h = engine.health()
        assert not h.alive and "internal error (mock)" in h.error


def test_timeouts_raise_quickly(server):
    server.delay["/model_info"] = 3.0
    t0 = time.monotonic()
    with pytest.raises(SGLangTimeout):
        SGLangClient(server.url, timeout_s=0.2).model_info()
    assert time.monotonic() - t0 < 1.5
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    t0 = time.monotonic()
    with pytest.raises(SGLangError, match="cannot reach"):
        SGLangClient(dead, timeout_s=2).model_info()
    assert time.monotonic() - t0 < 1.5
    server.delay.clear()
    server.token_delay_s = 0.05
    with engine_for(server, generate_timeout_s=0.3) as engine:
        t0 = time.monotonic()
        engine.submit([GenerateRequest([1], SamplingParams(max_new_tokens=200))])
        with pytest.raises(SGLangTimeout):
            engine.poll(timeout=5)
        assert time.monotonic() - t0 < 2.0


def test_abort_returns_partial_tokens(server):
    server.token_delay_s = 0.01
    with engine_for(server) as engine:
        (rid,) = engine.submit([GenerateRequest([4, 4], SamplingParams(max_new_tokens=2000, n=2))])
        wait_for(lambda: all(len(r.output_ids) >= 3 for r in list(server.live.values())) and len(server.live) == 2)
        engine.abort([rid])
        results = sorted(generate_results(engine, 2), key=lambda r: r.sample_index)
    assert [r.finish_reason for r in results] == ["abort", "abort"]
    assert all(3 <= len(r.output_ids) < 2000 and len(r.logprobs) == len(r.versions) == len(r.output_ids) for r in results)
    assert {p["rid"] for p in server.calls_to("/abort_request")} == {f"{rid}-0", f"{rid}-1"}
    assert all(p["abort_all"] is False for p in server.calls_to("/abort_request"))


def generate_results(engine, count, timeout=10.0):
    out, deadline = [], time.monotonic() + timeout
    while len(out) < count:
        assert time.monotonic() < deadline, f"only {len(out)} of {count} results"
        out += engine.poll(timeout=0.5)
    return out


def test_abort_before_the_server_knows_the_request_is_retried(server):
    server.token_delay_s = 0.01
    server.delay["/generate"] = 0.3  # the abort arrives while the rid is unknown (SGLang ignores it)
    with engine_for(server, abort_retry_s=0.1) as engine:
        (rid,) = engine.submit([GenerateRequest([1], SamplingParams(max_new_tokens=3000))])
        wait_for(lambda: server.calls_to("/generate"))
        engine.abort([rid])
        (r,) = generate_results(engine, 1, timeout=5)
    assert r.finish_reason == "abort" and len(r.output_ids) < 3000
    assert len(server.calls_to("/abort_request")) >= 2


def test_pause_continue_and_flush_payloads(server):
    server.token_delay_s = 0.01
    with engine_for(server, kv_on_update="keep") as engine:
        engine.submit([GenerateRequest([1, 2], SamplingParams(max_new_tokens=60))])
        wait_for(lambda: server.live and len(next(iter(server.live.values())).output_ids) >= 2)
        engine.pause()
        assert server.calls_to("/pause_generation") == [{"mode": "in_place"}] and engine.health().paused
        frozen = len(next(iter(server.live.values())).output_ids)
        with pytest.raises(SGLangError) as e:  # in place: the running request blocks the flush
            engine.servers[0].flush_cache()
        assert e.value.status == 400 and "Flush cache failed" in e.value.__notes__[0]
        time.sleep(0.1)
        assert len(next(iter(server.live.values())).output_ids) == frozen
        engine.resume()
        assert server.calls_to("/continue_generation") == [{}]
        (r,) = generate_results(engine, 1)
        assert r.finish_reason == "length" and len(r.output_ids) == 60
        assert "Cache flushed" in engine.servers[0].flush_cache()
    with engine_for(server) as engine:
        engine.pause()
        engine.resume()
    assert server.calls_to("/pause_generation")[-1] == {"mode": "retract"}


def test_weight_update_handshake():
    with MockSGLangServer(tp_size=2) as a, MockSGLangServer(tp_size=1) as b, engine_for(a, b, weight_bucket_bytes=64) as engine:
        joined = []
        handshake = SGLangWeightUpdate(engine)
        group = handshake.init_weights_update_group("127.0.0.1", 29555, backend="gloo", join=joined.append)
        assert joined == [group] and group.world_size == 4 and group.rank_offsets == (1, 3)
        for s, offset in ((a, 1), (b, 3)):
            assert s.calls_to("/init_weights_update_group") == [{
                "master_address": "127.0.0.1", "master_port": 29555, "rank_offset": offset, "world_size": 4,
                "group_name": "weight_update_group", "backend": "gloo"}]
        sender = RecordingSender()
        handshake.set_weight_sender(sender)
        hooked = []  # where the weight-sync step joins the group and receives the broadcast
        b.on_update_weights = hooked.append
        weights = {"embed.weight": torch.randn(4, 3), "norm.weight": torch.randn(5).bfloat16(), "layer.w": torch.randn(2, 6),
                   "step": torch.tensor([3], dtype=torch.int64)}
        report = engine.update_weights(weights, version=1)
        assert engine.weight_version == 1 and report.version == 1 and report.num_tensors == 4
        assert report.num_bytes == sum(t.numel() * t.element_size() for t in weights.values())
        for s in (a, b):
            paths = [p for _, p, _ in s.calls if p not in ("/model_info", "/server_info")]
            updates = s.calls_to("/update_weights_from_distributed")
            assert paths == ["/update_weight_version", "/init_weights_update_group", "/pause_generation", "/begin_weight_update",
                             *["/update_weights_from_distributed"] * len(updates), "/end_weight_update", "/continue_generation"]
            assert s.calls_to("/pause_generation") == [{"mode": "retract"}] and s.calls_to("/begin_weight_update") == [{"selector": "all"}]
            assert len(updates) == len(sender.sent) == 2  # 64-byte buckets (48 + 10, 48 + 8 bytes), one broadcast each
            assert [u["weight_version"] for u in updates] == [None, "1"]
            assert [u["flush_cache"] for u in updates] == [False, True]
            assert all(u["load_format"] == "flattened_bucket" and u["group_name"] == "weight_update_group"
                       and u["abort_all_requests"] is False for u in updates)
            assert s.weight_version == "1"
        assert hooked == b.calls_to("/update_weights_from_distributed")
        received = {}
        for u, flat in zip(a.calls_to("/update_weights_from_distributed"), sender.sent):
            received.update(unpack_flattened_bucket(FlatBucket(u["names"], u["dtypes"], u["shapes"], flat)))
        assert received.keys() == weights.keys() and all(torch.equal(received[k], v) for k, v in weights.items())
        handshake.destroy_weights_update_group()
        assert a.calls_to("/destroy_weights_update_group") == [{"group_name": "weight_update_group"}] and handshake.group is None


def test_in_flight_update_labels_tokens_by_version(server):
    server.token_delay_s = 0.01
    with engine_for(server, kv_on_update="keep") as engine:
        handshake = SGLangWeightUpdate(engine)
        handshake.init_weights_update_group("127.0.0.1", 29556)
        handshake.set_weight_sender(RecordingSender())
        engine.submit([GenerateRequest([5], SamplingParams(max_new_tokens=40))])
        wait_for(lambda: server.live and len(next(iter(server.live.values())).output_ids) >= 5)
        engine.update_weights({"w": torch.ones(2)}, version=1)
        (r,) = generate_results(engine, 1)
    (update,) = server.calls_to("/update_weights_from_distributed")
    assert update["flush_cache"] is False  # in place: running requests keep their KV, no flush
    k = r.versions.index(1)
    assert 5 <= k < 40 and r.versions == [0] * k + [1] * (40 - k) and len(r.output_ids) == 40


def test_update_errors_leave_servers_running(server):
    with engine_for(server) as engine:
        with pytest.raises(ValueError, match="init_weights_update_group"):
            engine.update_weights({"w": torch.ones(1)}, version=1)
        handshake = SGLangWeightUpdate(engine)
        handshake.init_weights_update_group("127.0.0.1", 29557)
        handshake.set_weight_sender(RecordingSender())
        with pytest.raises(TypeError):
            engine.update_weights(_NoReceiver(), version=1)
        with pytest.raises(ValueError, match="must increase"):
            engine.update_weights({"w": torch.ones(1)}, version=0)
        # refused before any bucket (the session): resumed on the old version
        server.fail_next["/begin_weight_update"] = (400, {"success": False, "message": "a weight-update session is already open"})
        with pytest.raises(SGLangError, match="begin_weight_update"):
            engine.update_weights({"w": torch.ones(1)}, version=1)
        assert engine.weight_version == 0 and server.paused is None and server.weight_version == "0"
        assert server.calls_to("/continue_generation") == [{}]
        # refused at a bucket: SGLang has loaded what came before, so the servers stay paused, labelled -1
        server.fail_next["/update_weights_from_distributed"] = (400, {"success": False, "message": "Failed to update parameter online: shape mismatch (mock)"})
        with pytest.raises(SGLangError) as e:
            engine.update_weights({"w": torch.ones(1)}, version=1)
        assert "shape mismatch (mock)" in e.value.__notes__[0]
        assert any("stay paused, labelled version -1" in n for n in e.value.__notes__)
        assert engine.weight_version == 0 and server.paused == "retract" and server.weight_version == "-1"
        assert len(server.calls_to("/continue_generation")) == 1 and not server.session_open  # session closed
        engine.update_weights({"w": torch.ones(1)}, version=1)  # a complete version resumes them
        assert engine.weight_version == 1 and server.paused is None and server.weight_version == "1"


class _NoReceiver(WeightReceiver):
    def receive(self, stage):
        raise AssertionError("never called")


def test_server_without_weight_update_sessions():
    with MockSGLangServer(sessions=False, weight_version="4") as old, engine_for(old, flattened_buckets=False) as engine:
        assert engine.weight_version == 4 and not old.calls_to("/update_weight_version")
        handshake = SGLangWeightUpdate(engine)
        handshake.init_weights_update_group("127.0.0.1", 29558)
        sender = RecordingSender()
        handshake.set_weight_sender(sender)
        engine.update_weights({"a": torch.ones(2), "b": torch.zeros(3)}, version=5)
        (update,) = old.calls_to("/update_weights_from_distributed")
        assert "load_format" not in update and update["names"] == ["a", "b"] and len(sender.sent) == 2  # one per tensor
        assert not old.calls_to("/end_weight_update") and old.weight_version == "5"


def test_router_gets_generation_and_servers_get_control():
    with MockSGLangServer() as worker, MockSGLangServer() as router:
        router.token_delay_s = 0.01
        with engine_for(worker, router_url=router.url) as engine:
            (rid,) = engine.submit([GenerateRequest([1], SamplingParams(max_new_tokens=500))])
            wait_for(lambda: router.live)
            engine.abort([rid])
            engine.pause()
            engine.resume()
        assert len(router.calls_to("/generate")) == 1 and not worker.calls_to("/generate")
        assert worker.calls_to("/abort_request")[0] == {"rid": f"{rid}-0", "abort_all": False}
        assert worker.calls_to("/pause_generation") and not router.calls_to("/pause_generation")


def test_requests_spread_over_servers():
    with MockSGLangServer() as a, MockSGLangServer() as b:
        a.token_delay_s = b.token_delay_s = 0.005
        with engine_for(a, b) as engine:
            results = generate(engine, [GenerateRequest([i + 1], SamplingParams(max_new_tokens=20)) for i in range(4)])
        assert len(results) == 4
        assert len(a.calls_to("/generate")) == 2 and len(b.calls_to("/generate")) == 2


# --- launcher ----------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_server_and_router_commands():
    cfg = SGLangServerConfig("/models/qwen", port=31000, tp_size=2, dtype="bfloat16", mem_fraction_static=0.8,
                             base_gpu_id=2, random_seed=1, extra_args=("--disable-radix-cache",))
    assert server_command(cfg) == [
        sys.executable, "-m", "sglang.launch_server", "--model-path", "/models/qwen", "--host", "127.0.0.1", "--port", "31000",
        "--tp-size", "2", "--dtype", "bfloat16", "--mem-fraction-static", "0.8", "--base-gpu-id", "2",
        "--weight-version", "0", "--random-seed", "1", "--disable-radix-cache"]
    assert cfg.url == "http://127.0.0.1:31000"
    rc = RouterConfig(worker_urls=("http://a:1", "http://b:2"), port=29000, policy="round_robin")
    assert router_command(rc) == [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", "http://a:1", "http://b:2",
                                  "--host", "127.0.0.1", "--port", "29000", "--policy", "round_robin"]
    assert ROUTES_FLAG == "--enable-return-routed-experts" and ROUTES_FLAG not in server_command(cfg)
    assert server_command(SGLangServerConfig("/m", return_routed_experts=True))[-1] == ROUTES_FLAG
    for bad in (dict(dtype="fp8"), dict(tp_size=0), dict(mem_fraction_static=1.5), dict(port=0)):
        with pytest.raises(ValueError, match="SGLangServerConfig"):
            SGLangServerConfig("m", **bad)
    with pytest.raises(ValueError, match="policy"):
        RouterConfig(worker_urls=("http://a:1",), policy="fastest")


def test_launch_wait_and_terminate_mock_servers(tmp_path):
    prefix = (sys.executable, str(MOCK_SCRIPT))
    cfgs = [SGLangServerConfig("tiny", port=free_port(), tp_size=2, command_prefix=prefix, extra_args=("--mock-startup-s", "0.3")),
            SGLangServerConfig("tiny", port=free_port(), command_prefix=prefix)]
    servers = launch_servers(cfgs, tmp_path, startup_timeout_s=20, interval_s=0.1)
    try:
        with engine_for(*servers) as engine:
            assert engine.tp_sizes() == (2, 1) and engine.weight_version == 0
            (r,) = generate(engine, [GenerateRequest([1, 2], SamplingParams(max_new_tokens=3))])
            assert len(r.output_ids) == 3
        router = launch_router(RouterConfig(worker_urls=tuple(s.url for s in servers), port=free_port(),
                                            command_prefix=(sys.executable, str(MOCK_SCRIPT), "--model-path", "router")),
                               tmp_path / "router.log", startup_timeout_s=20, interval_s=0.1)
        assert "--worker-urls" in router.log_tail() and router.alive()
        router.terminate(grace_s=5)
    finally:
        terminate_all(servers, grace_s=5)
    assert all(not s.alive() for s in servers)
    log = (tmp_path / f"sglang-{cfgs[0].port}.log").read_text()
    assert "--tp-size 2" in log and "fired up" in log and "terminated" in log


def test_launch_failures_raise_with_the_log(tmp_path):
    prefix = (sys.executable, str(MOCK_SCRIPT))
    t0 = time.monotonic()
    with pytest.raises(SGLangError, match="exited with code 3") as e:
        launch_servers([SGLangServerConfig("m", port=free_port(), command_prefix=prefix, extra_args=("--mock-exit-code", "3"))],
                       tmp_path, startup_timeout_s=20, interval_s=0.1)
    assert "failing on purpose" in e.value.__notes__[-1]
    with pytest.raises(SGLangError, match="not healthy after"):
        launch_servers([SGLangServerConfig("m", port=free_port(), command_prefix=prefix, extra_args=("--mock-startup-s", "30"))],
                       tmp_path, startup_timeout_s=1.0, interval_s=0.1)
    assert time.monotonic() - t0 < 10


def test_modes_that_push_between_rounds_do_not_pause(server):
    """pause_for_updates False (sync, one_step_off, fixed_lag: nothing generates during a push): no
    /pause_generation or /continue_generation around the update; a failed one still holds them paused."""
    from entr_megatron.rollout.sglang.engine_config import pushes_in_flight

    assert pushes_in_flight("fully_async") and not any(map(pushes_in_flight, ("sync", "one_step_off", "fixed_lag")))
    with engine_for(server, pause_for_updates=False) as engine:
        handshake = SGLangWeightUpdate(engine)
        handshake.init_weights_update_group("127.0.0.1", 29559)
        handshake.set_weight_sender(RecordingSender())
        engine.update_weights({"w": torch.ones(1)}, version=1)
        assert server.weight_version == "1" and server.paused is None
        assert not server.calls_to("/pause_generation") and not server.calls_to("/continue_generation")
        server.fail_next["/update_weights_from_distributed"] = (400, {"success": False, "message": "refused (mock)"})
        with pytest.raises(SGLangError):
            engine.update_weights({"w": torch.ones(1)}, version=2)
        assert server.paused == "retract" and server.weight_version == "-1"  # held
        engine.update_weights({"w": torch.ones(1)}, version=2)
        assert server.paused is None and server.weight_version == "2"


def test_buckets_pack_into_two_buffers_kept_across_versions():
    tensors = [(f"w{i}", torch.full((4,), float(i))) for i in range(5)]
    pool: list[torch.Tensor] = []
    first = [(b.flat.data_ptr(), b.flat.clone()) for b in iter_flattened_buckets(tensors, 40, buffers=pool)]
    assert len(first) == 3 and len(pool) == 2  # buckets 0 and 2 share slot 0: 2 was packed after 0 was sent
    # consumed as the sender does (each bucket sent before the one after next is packed)
    for b, (ptr, old) in zip(iter_flattened_buckets([(n, t + 1) for n, t in tensors], 40, buffers=pool), first,
                             strict=True):
        assert b.flat.data_ptr() == ptr  # the same memory, version after version
        assert torch.equal(b.flat.view(torch.float32), old.view(torch.float32) + 1)
