"""The mock replays what a real SGLang 0.5.23 server answered (sglang_answers_0.5.23.json, recorded
by tests/sglang_real with ENTR_SGLANG_RECORD=1): each recorded request is sent to a MockSGLangServer
in the state the server was in, and the answer must agree with the recording (status, shape, fixed
texts: sglang_answers.compare_exchange). So the mock cannot drift from the server: a field renamed,
added or dropped there fails here. The recorded answers must also pass our own parser."""

from __future__ import annotations

import json
import threading
import time

import pytest

from entr_megatron.rollout.engine import SamplingParams
from entr_megatron.rollout.sglang import SGLangClient, SGLangError, parse_generate_output

from sglang_answers import ANSWERS_PATH, compare_exchange
from sglang_mock import MockSGLangServer

RECORDED = json.loads(ANSWERS_PATH.read_text())
PARAM_SHAPES = {"model.norm.weight": [128]}
"""What the mock knows of the recorded model's parameters (the refused update names one)."""


def exchange(url: str, method: str, path: str, body) -> tuple[int, object]:
    client = SGLangClient(url, 30)
    try:
        return 200, client.call(method, path, body)
    except SGLangError as e:
        try:
            return e.status, json.loads(e.body) if e.body else None
        except ValueError:
            return e.status, e.body


def aborted_while_paused(server: MockSGLangServer, body: dict, mode: str) -> tuple[int, object]:
    """A request aborted while the server is paused in `mode`, as tests/sglang_real recorded it."""
    server.token_delay_s = 0.01
    box = {}
    thread = threading.Thread(target=lambda: box.update(answer=exchange(server.url, "POST", "/generate", body)))
    thread.start()
    time.sleep(0.1)
    exchange(server.url, "POST", "/pause_generation", {"mode": mode})
    exchange(server.url, "POST", "/abort_request", {"rid": body["rid"], "abort_all": False})
    thread.join(1.0 if mode == "in_place" else 10.0)
    exchange(server.url, "POST", "/continue_generation", {})
    thread.join(10)
    return box["answer"]


def replay(name: str, recorded: dict) -> tuple[int, object]:
    """The recorded request sent to a fresh mock in the state the real server was in."""
    method, path, body = recorded["method"], recorded["path"], recorded["request"]
    with MockSGLangServer(vocab_size=58, weight_version="1", param_shapes=PARAM_SHAPES) as server:
        url = server.url
        if name.startswith("generate_aborted_while_paused_"):
            return aborted_while_paused(server, body, name.removeprefix("generate_aborted_while_paused_"))
        if name in ("begin_weight_update_while_open", "end_weight_update"):
            exchange(url, "POST", "/begin_weight_update", {"selector": "all"})
        if name == "update_weights_refused":  # inside a session, in a group, a tensor of the wrong shape
            exchange(url, "POST", "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1,
                                                                 "rank_offset": 1, "world_size": 2})
            exchange(url, "POST", "/begin_weight_update", {"selector": "all"})
            body = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]],
                    "group_name": "weight_update_group", "flush_cache": False, "abort_all_requests": False,
                    "weight_version": None, "load_format": "flattened_bucket"}
        return exchange(url, method, path, body)


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_the_mock_answers_as_the_real_server_did(name):
    recorded = RECORDED[name]
    status, answer = replay(name, recorded)
    problems = compare_exchange(recorded, {**recorded, "status": status, "answer": answer})
    assert not problems, f"{name}: the mock differs from SGLang 0.5.23: {problems}"


def test_the_recording_covers_what_the_engine_sends():
    paths = {r["path"] for r in RECORDED.values()}
    assert {"/generate", "/abort_request", "/pause_generation", "/continue_generation", "/flush_cache",
            "/begin_weight_update", "/end_weight_update", "/update_weights_from_distributed", "/update_weights_from_tensor",
            "/destroy_weights_update_group", "/update_weight_version", "/model_info", "/server_info",
            "/health"} <= paths


@pytest.mark.parametrize("name", [n for n, r in sorted(RECORDED.items()) if r["path"] == "/generate" and r["status"] == 200])
def test_our_parser_reads_every_recorded_answer(name):
    recorded = RECORDED[name]
    answers = recorded["answer"] if isinstance(recorded["answer"], list) else [recorded["answer"]]
    sp = recorded["request"]["sampling_params"]
    params = SamplingParams(max_new_tokens=sp["max_new_tokens"], temperature=sp.get("temperature", 1.0),
                            top_p=sp.get("top_p", 1.0), top_k=sp.get("top_k", -1))
    for answer in answers:
        parsed = parse_generate_output(answer, params, default_version=0, vocab_size=58,
                                       prompt_len=len(recorded["request"]["input_ids"]))
        assert len(parsed["logprobs"]) == len(answer["output_ids"]) == len(parsed["versions"])
