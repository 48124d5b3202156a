"""An in-test stand-in for an SGLang 0.5.23 HTTP server (127.0.0.1 only, standard library only).

It answers the endpoints the SGLang engine uses with the request and answer shapes of
SGLang 0.5.23 (entr_megatron.rollout.sglang.protocol.SGLANG_SOURCE: http_server.py,
managers/io_struct.py, api/v1/api_types.py, utils/weight_versions.py) and generates
fake tokens deterministically (`mock_token`, `mock_logprob`). It is stricter than
SGLang where that catches client mistakes: unknown fields in any body are refused
(SGLang refuses them only in sampling_params).

Weight updates keep SGLang's bookkeeping (session, version spans of live requests,
flush refused while requests run) but move no tensors: the hooks `on_init_group`,
`on_update_weights`, `on_destroy_group` receive each payload, and are where the
weight-sync step joins the gloo group and receives the broadcast; `on_update_tensors` gets the
tensors of an /update_weights_from_tensor (read from the client's shared memory).

    with MockSGLangServer(token_delay_s=0.01) as server:
        SGLangClient(server.url).generate({...})
        server.calls          # [(method, path, payload), ...]

`crash()` (or `crash_after` /generate calls) makes it die like a killed server: open connections
dropped without an answer, new ones refused; a new server on the same port is its restart.

With `api_key` it checks `Authorization: Bearer <key>` on every endpoint but /health*,
/ready and /metrics, answering 401 {"error": "Unauthorized"} as SGLang's
add_api_key_middleware does. `tamper` rewrites /generate answers and `truncate_next`
cuts an answer's body short, for the tests of a client that does not trust its server.

With `routes=(num_layers, top_k, num_experts)` it is a server started with
--enable-return-routed-experts: a request with `return_routed_experts` gets
`meta_info.routed_experts` as SGLang 0.5.23 encodes it (state_capturer/base.py get_topk,
detokenizer_manager.py): base64 of the int32 little-endian bytes of
[prompt + output - 1, num_layers, top_k] (`mock_route`; none for a request aborted before
any token). Without `routes` the field is ignored, as SGLang does without the flag.

Run as a script it serves like `python -m sglang.launch_server` (same flags; unknown ones
ignored) until SIGTERM, for the launcher tests.
"""

from __future__ import annotations

import argparse
import base64
import json
import signal
import struct
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlparse

SGLANG_VERSION = "0.5.23"
_RECORDED = json.loads((Path(__file__).resolve().parent / "sglang_answers_0.5.23.json").read_text())
"""What a real server answered (tests/sglang_real records it): /model_info and /server_info are served from it."""
MOCK_ROUTE_LAYOUT = (2, 2, 8)
"""(num_layers, top_k, num_experts) of the mock served as a script with --enable-return-routed-experts."""

# Field names of the 0.5.23 request structs (io_struct.py) that the mock accepts.
GENERATE_FIELDS = {
    "rid", "text", "input_ids", "sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num",
    "token_ids_logprob", "return_sampling_mask", "sampling_logprobs_mode", "return_text_in_logprobs", "stream",
    "return_hidden_states", "return_entropy", "priority", "lora_path", "session_params", "custom_labels",
    "return_routed_experts", "routed_experts_start_len",
}
# api_types.py _FIELDS_SamplingParams: SGLang itself refuses any other key (HTTP 400).
SAMPLING_FIELDS = (
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema", "regex",
    "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
    "stream_interval", "logit_bias", "sampling_seed", "custom_params", "beam_width", "watermark", "choice",
)
# name -> (required, optional) fields of the control structs.
BODIES = {
    "/abort_request": (set(), {"rid", "abort_all"}),
    "/pause_generation": (set(), {"mode"}),
    "/continue_generation": (set(), {"torch_empty_cache"}),
    "/init_weights_update_group": ({"master_address", "master_port", "rank_offset", "world_size"}, {"group_name", "backend"}),
    "/update_weights_from_distributed": (
        {"names", "dtypes", "shapes"},
        {"group_name", "flush_cache", "abort_all_requests", "weight_version", "load_format", "selector", "torch_empty_cache"},
    ),
    "/update_weights_from_tensor": (
        {"serialized_named_tensors"},
        {"load_format", "flush_cache", "abort_all_requests", "weight_version", "selector", "torch_empty_cache"},
    ),
    "/destroy_weights_update_group": (set(), {"group_name"}),
    "/update_weight_version": ({"new_version"}, {"abort_all_requests"}),
    "/begin_weight_update": (set(), {"selector"}),
    "/end_weight_update": (set(), set()),
}
NOT_FLUSHED = (
    "Weights were updated, but the cache was not flushed because requests are still running or queued. "
    "Retract or finish them, then call /flush_cache."
)


def mock_token(prompt: list[int], seed: int | None, greedy: bool, t: int, vocab_size: int) -> int:
    """Token t of a response: a function of the prompt, the seed (ignored when greedy) and t."""
    base = sum((i + 1) * x for i, x in enumerate(prompt)) * 31 + len(prompt)
    if not greedy:
        base += 1_000_003 * (seed if seed is not None else 0) + 17
    return (base + 7919 * t) % vocab_size


def mock_logprob(token: int, temperature: float) -> float:
    """What the mock reports as output_token_logprobs (log_softmax(logits / T), untruncated)."""
    return -0.1 * (1 + token % 7) / max(temperature, 0.5)


def mock_route(fed: list[int], t: int, layer: int, j: int, num_experts: int) -> int:
    """Expert j of fed token t (of the prompt + output tokens) in layer `layer` (distinct over j)."""
    return (fed[t] * 13 + 7 * t + 3 * layer + j) % num_experts


def mock_routes(fed: list[int], num_layers: int, top_k: int, num_experts: int) -> list[list[list[int]]]:
    """[len(fed) - 1, num_layers, top_k] routes of a sequence (its last token is never fed)."""
    return [[[mock_route(fed, t, layer, j, num_experts) for j in range(top_k)] for layer in range(num_layers)]
            for t in range(len(fed) - 1)]


def encode_routes(routes: list[list[list[int]]]) -> str:
    """SGLang's encoding: base64 of the int32 little-endian bytes, row-major."""
    flat = [e for row in routes for layer in row for e in layer]
    return base64.b64encode(struct.pack(f"<{len(flat)}i", *flat)).decode("ascii")


def mock_sampling_logprob(token: int, temperature: float) -> float:
    """What the mock reports as output_token_sampling_logprobs (renormalised over the support)."""
    return mock_logprob(token, temperature) / 2


class _Req:
    def __init__(self, rid: str):
        self.rid = rid
        self.output_ids: list[int] = []
        self.events: list[tuple[str, int]] = []  # (old version, tokens so far) at each version change
        self.aborted = False


def weight_version_spans(events: list[tuple[str, int]], current: str, n: int) -> list[dict]:
    """utils/weight_versions.py compute_weight_version_spans + add_weight_versions_to_meta_info."""
    spans: list[dict] = []
    for version, end in [*events, (current, n)]:
        end = min(end, n)
        if spans and end <= spans[-1]["end"]:
            continue
        if spans and version == spans[-1]["version"]:
            spans[-1]["end"] = end
            continue
        spans.append({"version": version, "start": spans[-1]["end"] if spans else 0, "end": end})
    return [s for s in spans if s["start"] < n or s["start"] == 0]


def aborted_in_queue(rid: str, version: str) -> dict:
    """SGLang 0.5.23's answer to a request aborted in the waiting queue (never run, or retracted by a
    pause): no tokens, even those a retracted request had generated (recorded: sglang_answers)."""
    return {"text": "", "output_ids": [], "meta_info": {
        "id": rid, "finish_reason": {"type": "abort", "message": "Abort in waiting queue"}, "weight_version": version,
        "e2e_latency": 0.0, "weight_versions": [{"version": version, "start": 0, "end": 0}], "input_token_logprobs": [],
        "output_token_logprobs": [], "output_token_logprobs_length": 0, "completion_tokens": 0,
        "response_sent_to_client_ts": time.time()}}


class MockSGLangServer:
    """Threaded HTTP server on 127.0.0.1 with SGLang 0.5.23's endpoints (see the module docstring)."""

    def __init__(self, *, port: int = 0, vocab_size: int = 1000, eos_token_id: int | None = None,
                 token_delay_s: float = 0.0, weight_version: str = "default", tp_size: int = 1,
                 model_path: str = "mock-model", sessions: bool = True, api_key: str | None = None,
                 routes: tuple[int, int, int] | None = None, param_shapes: dict[str, list[int]] | None = None,
                 prefix_cache: bool = True):
        self.vocab_size, self.eos_token_id, self.token_delay_s = vocab_size, eos_token_id, token_delay_s
        self.weight_version, self.tp_size, self.model_path = weight_version, tp_size, model_path
        self.sessions = sessions
        self.prefix_cache = prefix_cache
        """False: a server started with --disable-radix-cache (what /server_info says)."""
        self.param_shapes = dict(param_shapes or {})
        """name -> shape of the model's parameters: an update of another shape is refused as SGLang
        refuses it (after loading what came before); other names load (SGLang skips unknown ones)."""
        self.routes = routes
        """(num_layers, top_k, num_experts): started with --enable-return-routed-experts; None: without."""
        """False: a server from before weight-update sessions (/begin_weight_update is 404)."""
        self.calls: list[tuple[str, str, Any]] = []
        self.fail_next: dict[str, tuple[int, Any]] = {}
        """path -> (status, body) answered once instead of the real answer."""
        self.delay: dict[str, float] = {}
        """path -> seconds to sleep before answering."""
        self.api_key = api_key
        """Required as `Authorization: Bearer <key>` (SGLang --api-key); None: no check."""
        self.unauthorized: list[tuple[str, str]] = []
        """(method, path) of the requests refused for a missing or wrong key."""
        self.tamper: Callable[[Any], Any] | None = None
        """Rewrites each successful /generate answer (a dict, or a list for a batch) before it is sent."""
        self.truncate_next: dict[str, int] = {}
        """path -> bytes of the next answer's body actually sent (the Content-Length announces all of it)."""
        self.on_init_group: Callable[[dict], None] = lambda payload: None
        self.on_update_weights: Callable[[dict], None] = lambda payload: None
        self.on_update_tensors: Callable[[list, dict], None] = lambda named, payload: None
        """/update_weights_from_tensor: rank 0's [(name, tensor)] (mapping the client's shared memory,
        valid during the call) and the body."""
        self.on_destroy_group: Callable[[dict], None] = lambda payload: None
        self.crash_after: int | None = None
        """Die (`crash`) on the /generate call after this many (None: never)."""
        self.crashed = False
        self.generates = 0
        self.groups: set[str] = set()
        self.session_open = False
        self.paused: str | None = None  # pause mode while paused
        self.stepping = 0  # decode steps in progress
        self.live: dict[str, _Req] = {}
        self.cond = threading.Condition()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), _make_handler(self))
        self.httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def start(self) -> MockSGLangServer:
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        with self.cond:
            for req in self.live.values():
                req.aborted = True
            self.paused = None
            self.cond.notify_all()
        self.httpd.shutdown()
        self.httpd.server_close()

    def crash(self) -> None:
        """Die like a killed server: every open connection dropped without an answer, none accepted."""
        self.crashed = True
        threading.Thread(target=self.stop, daemon=True).start()  # also from a handler thread

    def __enter__(self) -> MockSGLangServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def calls_to(self, path: str) -> list[Any]:
        """Payloads of the calls to `path`, in order."""
        return [payload for _, p, payload in list(self.calls) if p == path]

    # --- endpoints (return (status, body); body dict/list -> JSON, str -> text, None -> empty) ---

    def model_info(self) -> dict:
        """A real server's /model_info (recorded) with this mock's model path and version."""
        return {**_RECORDED["model_info"]["answer"], "model_path": self.model_path, "served_model_name": self.model_path,
                "tokenizer_path": self.model_path, "weight_version": self.weight_version}

    def server_info(self) -> dict:
        """A real server's /server_info (recorded) with this mock's model path, tp size, version and key."""
        info = dict(_RECORDED["server_info"]["answer"])
        info.update(model_path=self.model_path, tokenizer_path=self.model_path, served_model_name=self.model_path,
                    tp_size=self.tp_size, weight_version=self.weight_version, api_key=None,
                    disable_radix_cache=not self.prefix_cache)
        return info

    def generate(self, body: dict) -> tuple[int, Any]:
        unknown = set(body) - GENERATE_FIELDS
        if unknown:
            return 400, _error_response(f"mock: unexpected /generate fields {sorted(unknown)}")
        self.generates += 1
        if self.crash_after is not None and self.generates > self.crash_after:
            self.crash()
            return 500, None  # never sent
        ids, rid, sps = body.get("input_ids"), body.get("rid"), body.get("sampling_params") or {}
        batch = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
        prompts = ids if batch else [ids]
        for sp in sps if isinstance(sps, list) else [sps]:
            for key in sp:
                if key not in SAMPLING_FIELDS:
                    return 400, {"error": f"unknown field `{key}`, expected one of " + ", ".join(f"`{f}`" for f in SAMPLING_FIELDS)}
            top_k = sp.get("top_k", -1)
            if not isinstance(top_k, int) or (top_k < 1 and top_k != -1):
                return 400, {"error": {"message": f"top_k must be -1 (disable) or at least 1, got {top_k}."}}
        if any(not isinstance(p, list) or not all(isinstance(t, int) for t in p) for p in prompts):
            return 400, {"error": "invalid type: expected i64"}
        if sps and isinstance(sps, dict) and sps.get("n", 1) > 1:
            return 400, _error_response("mock: parallel sampling (n > 1) gives fresh rids; the client expands n itself")
        if batch:
            if not isinstance(rid, list) or len(rid) != len(prompts):
                return 400, {"error": {"message": "The specified rids length mismatch with the batch_size for batch processing."}}
            rids = rid
        else:
            rids = [rid if isinstance(rid, str) else f"mock-{time.monotonic_ns()}"]
        sp_list = sps if isinstance(sps, list) else [sps] * len(prompts)
        mask = body.get("return_sampling_mask", False)
        routes = bool(body.get("return_routed_experts")) and self.routes is not None
        with self.cond:
            if set(rids) & set(self.live):
                return 400, {"error": {"message": f"Duplicate request IDs {sorted(set(rids) & set(self.live))}"}}
            reqs = [_Req(r) for r in rids]
            for req in reqs:
                self.live[req.rid] = req
        outs: list[Any] = [None] * len(reqs)

        def run(i: int) -> None:
            outs[i] = self._decode(reqs[i], prompts[i], sp_list[i], bool(body.get("return_logprob")), mask, routes)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(reqs))]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        return 200, outs if batch else outs[0]

    def _decode(self, req: _Req, prompt: list[int], sp: dict, logprob: bool, mask: bool, routes: bool) -> dict:
        temperature = float(sp.get("temperature", 1.0))
        greedy = temperature < 1e-6
        stops = set(sp.get("stop_token_ids") or [])
        if self.eos_token_id is not None and not sp.get("ignore_eos", False):
            stops.add(self.eos_token_id)
        finish: dict = {"type": "length", "length": sp.get("max_new_tokens", 128)}
        queued = False  # aborted in the waiting queue (before its first step, or retracted): SGLang drops its tokens
        for t in range(sp.get("max_new_tokens", 128)):
            with self.cond:
                self.cond.wait_for(lambda: self.paused is None or req.aborted)
                if req.aborted:
                    queued = t == 0 or self.paused == "retract"
                    finish = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
                    break
                self.stepping += 1  # a decode step: pause waits for it to end
            if self.token_delay_s:
                time.sleep(self.token_delay_s)
            token = mock_token(prompt, sp.get("sampling_seed"), greedy, t, self.vocab_size)
            with self.cond:
                req.output_ids.append(token)
                self.stepping -= 1
                self.cond.notify_all()
            if token in stops:
                finish = {"type": "stop", "matched": token}
                break
        with self.cond:
            self.live.pop(req.rid, None)
            version = self.weight_version
        if queued:
            return aborted_in_queue(req.rid, version)
        n = len(req.output_ids)
        meta: dict[str, Any] = {
            "id": req.rid, "finish_reason": finish, "prompt_tokens": len(prompt), "weight_version": version,
            "num_retractions": 0, "reasoning_tokens": 0, "completion_tokens": n, "cached_tokens": 0,
            "cached_tokens_details": {"device": 0, "host": 0}, "dp_rank": None,
            "weight_versions": weight_version_spans(req.events, version, n), "e2e_latency": 0.0,
            "response_sent_to_client_ts": time.time(),
        }
        if logprob:
            meta["output_token_logprobs"] = [[mock_logprob(tok, 1.0 if greedy else temperature), tok, None] for tok in req.output_ids]
            meta["output_token_logprobs_length"] = n
            meta["input_token_logprobs"] = []
        if mask:
            meta["output_token_sampling_mask"] = [[tok] for tok in req.output_ids]
            meta["output_token_sampling_logprobs"] = [mock_sampling_logprob(tok, temperature) for tok in req.output_ids]
            meta["output_token_sampling_mask_length"] = n
        if routes and (n or finish["type"] != "abort"):  # aborted while queued: never prefilled
            meta["routed_experts"] = encode_routes(mock_routes(prompt + req.output_ids, *self.routes))
        return {"output_ids": list(req.output_ids), "meta_info": meta}

    def control(self, path: str, body: dict) -> tuple[int, Any]:
        required, optional = BODIES[path]
        missing, unknown = required - set(body), set(body) - required - optional
        if missing or unknown:
            return 400, _error_response(f"mock: {path} body: missing {sorted(missing)}, unexpected {sorted(unknown)}")
        with self.cond:
            if path == "/abort_request":
                for req in self.live.values():
                    if body.get("abort_all") or req.rid == body.get("rid"):  # tokenizer manager: exact rid
                        req.aborted = True
                self.cond.notify_all()
                return 200, None
            if path == "/pause_generation":
                mode = body.get("mode", "abort")
                if mode not in ("abort", "retract", "in_place"):
                    return 400, _error_response(f"Invalid mode: {mode!r}. Expected one of ['abort', 'retract', 'in_place'].")
                self.paused = mode
                if mode == "abort":
                    for req in self.live.values():
                        req.aborted = True
                self.cond.notify_all()
                self.cond.wait_for(lambda: self.stepping == 0)  # returns between two steps
                return 200, {"message": "Generation paused successfully.", "status": "ok"}
            if path == "/continue_generation":
                self.paused = None
                self.cond.notify_all()
                return 200, {"message": "Generation continued successfully.", "status": "ok"}
            if path == "/begin_weight_update":
                if not self.sessions:
                    return 404, {"detail": "Not Found"}
                if self.session_open:
                    return 400, {"success": False, "message": "a weight-update session is already open; call end_weight_update() first"}
                self.session_open = True
                return 200, {"success": True, "message": "Success"}
            if path == "/end_weight_update":
                if not self.sessions:
                    return 404, {"detail": "Not Found"}
                if not self.session_open:
                    return 400, {"success": False, "message": "no weight-update session is open; call begin_weight_update() first"}
                self.session_open = False
                return 200, {"success": True, "message": "Success"}
            if path == "/update_weight_version":
                if body.get("abort_all_requests", True):
                    for req in self.live.values():
                        req.aborted = True
                self._set_version(str(body["new_version"]))
                return 200, {"success": True, "message": f"Weight version updated to {body['new_version']}", "new_version": body["new_version"]}
        if path == "/init_weights_update_group":
            self.on_init_group(body)
            with self.cond:
                self.groups.add(body.get("group_name", "weight_update_group"))
            return 200, {"success": True, "message": "Succeeded to initialize custom process group."}
        if path == "/destroy_weights_update_group":
            name = body.get("group_name", "weight_update_group")
            with self.cond:
                if name not in self.groups:
                    return 400, {"success": False, "message": "The group to be destroyed does not exist."}
                self.groups.discard(name)
            self.on_destroy_group(body)
            return 200, {"success": True, "message": "Succeeded to destroy custom process group."}
        if path == "/update_weights_from_tensor":
            return self._update_weights_from_tensor(body)
        assert path == "/update_weights_from_distributed"
        return self._update_weights(body)

    def _update_weights_from_tensor(self, body: dict) -> tuple[int, Any]:
        """SGLang's scheduler: each TP rank reads its own entry (tp_worker.deserialize_own_rank) and
        loads [(name, tensor)] with the model's load_weights."""
        from entr_megatron.rollout.sglang.tensor_payload import deserialize_named_tensors

        with self.cond:
            if self.sessions and not self.session_open:
                return 400, {"success": False, "message": "update_weights_from_tensor must run between "
                             "begin_weight_update() and end_weight_update()"}
            if self.paused is None:
                self.cond.wait_for(lambda: not self.live, timeout=30)
        payloads = body["serialized_named_tensors"]
        if len(payloads) < self.tp_size:
            return 500, _error_response(f"list index out of range ({len(payloads)} payloads, tp_size {self.tp_size})")
        ranks = [deserialize_named_tensors(payloads[i]) for i in range(self.tp_size)]
        self.on_update_tensors(ranks[0], body)
        return self._loaded([(name, list(t.shape)) for name, t in ranks[0]], body, "Success")

    def _update_weights(self, body: dict) -> tuple[int, Any]:
        names, dtypes, shapes = body["names"], body["dtypes"], body["shapes"]
        if not (len(names) == len(dtypes) == len(shapes)):
            return 400, _error_response("names, dtypes and shapes differ in length")
        with self.cond:
            if self.sessions and not self.session_open:
                return 400, {"success": False, "message": "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()"}
            group = body.get("group_name", "weight_update_group")
            if group not in self.groups:
                return 400, {"success": False, "message": f"Failed to receive weights: Group {group} not in {sorted(self.groups)}. Please call `init_weights_update_group` first."}
            if self.paused is None:  # SGLang takes the writer lock: waits for running requests
                self.cond.wait_for(lambda: not self.live, timeout=30)
        self.on_update_weights(body)
        return self._loaded(list(zip(names, shapes)), body, "Succeeded to update parameter online.")

    def _loaded(self, shapes: list, body: dict, message: str) -> tuple[int, Any]:
        """After the tensors of an update arrived: SGLang's shape check, version and cache flush."""
        for name, shape in shapes:
            want = self.param_shapes.get(name)
            if want is not None and list(shape) != list(want):
                return 400, {"success": False, "message": (
                    f"Failed to update parameter online: Attempted to load weight (torch.Size({list(shape)})) into "
                    f"parameter (torch.Size({list(want)})). The full weights of the ModelRunner are partially "
                    "updated. Please discard the whole weights.")}
        with self.cond:
            if body.get("weight_version") is not None:
                self._set_version(str(body["weight_version"]))
            if body.get("flush_cache", True) and self.live and self.paused != "retract":
                return 400, {"success": False, "message": NOT_FLUSHED}
        if body.get("weight_version") is not None:
            message += f" Weight version updated to {body['weight_version']}."
        return 200, {"success": True, "message": message}

    def flush_cache(self) -> tuple[int, Any]:
        with self.cond:
            busy = bool(self.live) and self.paused != "retract"
        text = ("Cache flushed.\nPlease check backend logs for more details. "
                "(When there are running or waiting requests, the operation will not be performed.)\n")
        return (400, "Flush cache failed.\n") if busy else (200, text)

    def _set_version(self, new: str) -> None:
        """Scheduler.record_weight_version_change (caller holds self.cond)."""
        if new == self.weight_version:
            return
        for req in self.live.values():
            if req.output_ids:
                req.events.append((self.weight_version, len(req.output_ids)))
        self.weight_version = new


def engine_for(*servers: MockSGLangServer, **kw):
    """An SGLangEngine over mock servers with short timeouts and backoff (tests)."""
    from entr_megatron.rollout.sglang import SGLangEngine, SGLangEngineConfig

    kw.setdefault("request_timeout_s", 5.0)
    kw.setdefault("generate_timeout_s", 20.0)
    kw.setdefault("weight_update_timeout_s", 10.0)
    kw.setdefault("retry_backoff_s", 0.01)
    return SGLangEngine(SGLangEngineConfig(urls=tuple(s.url for s in servers), **kw))


def _error_response(message: str) -> dict:
    """The body of SGLang's RequestValidationError handler (HTTP 400)."""
    return {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400}


def _make_handler(server: MockSGLangServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:
            pass

        def _answer(self, status: int, body: Any, path: str = "") -> None:
            if body is None:
                data, ctype = b"", "text/plain"
            elif isinstance(body, str):
                data, ctype = body.encode(), "text/plain; charset=utf-8"
            else:
                data, ctype = json.dumps(body).encode(), "application/json"
            cut = server.truncate_next.pop(path, None)
            if server.crashed:  # a dead server answers nothing
                self.close_connection = True
                return
            try:
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data if cut is None else data[:cut])
            except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout tests)
                pass
            if cut is not None:  # hang up mid-body
                self.close_connection = True

        def _handle(self, method: str) -> None:
            path = urlparse(self.path).path
            body: Any = None
            length = int(self.headers.get("Content-Length") or 0)
            if length:
                try:
                    body = json.loads(self.rfile.read(length))
                except ValueError as e:
                    return self._answer(400, _error_response(f"JSON decode error: {e}"))
            server.calls.append((method, path, body))
            exempt = path.startswith(("/health", "/ready", "/metrics"))
            if server.api_key is not None and not exempt and \
                    self.headers.get("Authorization") != f"Bearer {server.api_key}":
                server.unauthorized.append((method, path))
                return self._answer(401, {"error": "Unauthorized"})
            if path in server.delay:
                time.sleep(server.delay[path])
            if path in server.fail_next:
                return self._answer(*server.fail_next.pop(path))
            if method == "GET" and path in ("/health", "/health_generate", "/ready"):
                return self._answer(200, None)
            if method == "GET" and path in ("/model_info", "/get_model_info"):
                return self._answer(200, server.model_info(), path)
            if method == "GET" and path in ("/server_info", "/get_server_info"):
                return self._answer(200, server.server_info())
            if path == "/flush_cache" and method in ("GET", "POST"):
                return self._answer(*server.flush_cache())
            if method in ("POST", "PUT") and path == "/generate":
                if not isinstance(body, dict):
                    return self._answer(400, _error_response("Field required: body"))
                status, answer = server.generate(body)
                if status == 200 and server.tamper is not None:
                    answer = server.tamper(answer)
                return self._answer(status, answer, path)
            if method == "POST" and path in BODIES:
                if not isinstance(body, dict):
                    return self._answer(400, _error_response("Field required: body"))
                return self._answer(*server.control(path, body))
            return self._answer(404, {"detail": "Not Found"})

        def do_GET(self) -> None:
            self._handle("GET")

        def do_POST(self) -> None:
            self._handle("POST")

        def do_PUT(self) -> None:
            self._handle("PUT")

    return Handler


def main(argv: list[str] | None = None) -> None:
    """Serve like `python -m sglang.launch_server` (launcher tests); --mock-* flags steer it."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--weight-version", default="default")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--enable-return-routed-experts", action="store_true")
    parser.add_argument("--disable-radix-cache", action="store_true")
    parser.add_argument("--mock-exit-code", type=int, default=None, help="exit at once with this code")
    parser.add_argument("--mock-startup-s", type=float, default=0.0, help="sleep before serving")
    args, unknown = parser.parse_known_args(argv)
    print(f"mock sglang {SGLANG_VERSION}: {args.model_path} tp={args.tp_size}; ignoring {unknown}", flush=True)
    print(f"server_args={vars(args)!r}", flush=True)  # as SGLang logs its ServerArgs, the key among them
    if args.mock_exit_code is not None:
        print("mock: failing on purpose", file=sys.stderr, flush=True)
        sys.exit(args.mock_exit_code)
    time.sleep(args.mock_startup_s)
    assert args.host == "127.0.0.1", "the mock only listens on 127.0.0.1"
    server = MockSGLangServer(port=args.port, tp_size=args.tp_size, weight_version=args.weight_version,
                              model_path=args.model_path, api_key=args.api_key,
                              routes=MOCK_ROUTE_LAYOUT if args.enable_return_routed_experts else None,
                              prefix_cache=not args.disable_radix_cache)
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.httpd.shutdown).start())
    print(f"The server is fired up and ready to roll! {server.url}", flush=True)
    server.httpd.serve_forever(poll_interval=0.05)
    print("mock: terminated", flush=True)


if __name__ == "__main__":
    main()
