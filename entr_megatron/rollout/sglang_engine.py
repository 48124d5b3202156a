"""The SGLang engine: `RolloutEngine` over SGLang HTTP servers, and the HTTP client beneath it.

    servers = launch_servers([SGLangServerConfig(model_dir, tp_size=2, port=30000 + i) for i in range(4)],
                             log_dir="logs/sglang")                        # sglang_launcher.py
    engine = SGLangEngine(SGLangEngineConfig(urls=tuple(s.url for s in servers)))
    group = engine.init_weights_update_group("10.0.0.1", 29600, backend="nccl", join=learner_joins)
    engine.set_weight_sender(sender)          # rank 0 of `group`: broadcasts one flat bucket at a time
    engine.submit([GenerateRequest(prompt_ids, SamplingParams(temperature=1.0, n=8))])
    results = engine.poll(timeout=1.0)
    report = engine.update_weights(hf_state_dict, version=engine.weight_version + 1)

Control calls (abort, pause, weights) go to every server; `/generate` goes to the
sglang-router when one is configured, else to the server with the fewest of our
requests in flight. `SGLangClient` is one server's HTTP API (standard library only,
proxies bypassed); every call has a timeout, and a failed call raises `SGLangError`
carrying the server's answer as a note. Nothing here imports sglang.

Protocol: checked against SGLang 0.5.23 (PyPI wheel, see `SGLANG_SOURCE`) in
srt/entrypoints/http_server.py, srt/managers/io_struct.py, the JSON contract
api/v1/api_types.py, and the tokenizer manager / scheduler code that fills the
answers (srt/managers/tokenizer_manager.py, srt/utils/weight_versions.py,
srt/weight_sync/tensor_bucket.py). The whole SGLang repository was too large to
fetch, so no git commit was recorded (the wheel's `_version.py` has commit_id=None).

| endpoint | method | body we send | answer |
|---|---|---|---|
| /health | GET | - | 200 ready, 503 starting/unhealthy (0.5.23: also runs a 1-token generation when idle) |
| /model_info (/get_model_info before) | GET | - | {model_path, weight_version, is_generation, ...} |
| /server_info (/get_server_info before) | GET | - | server args (tp_size, ...) + "version" |
| /generate | POST | {input_ids, rid, sampling_params, return_logprob, return_sampling_mask, stream} | {output_ids, meta_info} or a list of them |
| /abort_request | POST | {rid} (exact rid; unknown rids are ignored) | 200, empty |
| /pause_generation | POST | {mode: "in_place" or "retract" ("abort" is the default!)} | {message, status: "ok"} |
| /continue_generation | POST | {} | {message, status: "ok"} |
| /flush_cache | POST | - | text; 400 while requests run |
| /init_weights_update_group | POST | {master_address, master_port, rank_offset, world_size, group_name, backend} | {success, message}; 400 |
| /begin_weight_update | POST | {selector: "all"} | {success, message}; 404 on older servers (e.g. 0.5.3) |
| /update_weights_from_distributed | POST | {names, dtypes, shapes, group_name, flush_cache, abort_all_requests, weight_version, load_format: "flattened_bucket"} | {success, message}; 400 |
| /end_weight_update | POST | {} | {success, message} |
| /destroy_weights_update_group | POST | {group_name} | {success, message}; 400 |
| /update_weight_version | POST | {new_version, abort_all_requests} (its default aborts everything) | {success, message, new_version} |

Errors: a body failing the pydantic parse gives 400 {"object": "error", "message",
"type", "param", "code"}; `/generate` answers a contract violation (e.g. an unknown
sampling parameter) with 400 {"error": "<text>"} and a rejected request with
400 {"error": {"message"}}.

How an answer becomes a `GenerateResult`:
- `meta_info.output_token_logprobs` is a list of [logprob, token_id, text or null]
  with logprob = log_softmax(logits / temperature), *before* top-p/top-k truncation
  (greedy: log_softmax(logits), which we keep, as `sampling.py` does). That is the
  behaviour log-prob only without truncation. With truncation we ask for `return_sampling_mask` and take
  `meta_info.output_token_sampling_logprobs` (one float per token: the sampled
  token's log-prob renormalised over the kept support). The server aborts such a
  request when the support is larger than --sampling-mask-max-tokens (4096), so
  use top_k below that with top_p. Greedy requests ignore top-p/top-k, so they
  never ask for the mask.
- Entropy: SGLang reports none (its `return_entropy` is never filled in 0.5.23);
  `entropy` is None, greedy included.
- Versions: `meta_info.weight_versions` lists spans {version, start, end} over the
  output tokens; the scheduler records one when the weight version changes while
  a request lives, so tokens before and after an in-flight update carry the right
  version. Older servers give only `meta_info.weight_version` (the server's version
  when the answer was built): then every token gets it, which mislabels the tokens
  before an in-flight update. Versions are strings in SGLang; ours are their int
  value (non-numeric ones, e.g. SGLang's "default", read as `initial_version`).
- Seeds: each sample sends sampling_seed (from SamplingParams.seed, else a random one,
  mixed with the sample index); only servers launched with --enable-deterministic-inference
  use it (and would give every unseeded request seed 42).
- Stop tokens stay in `output_ids` (finished_len = matched position + 1). An aborted running request still decodes one
  more step; while paused in place, it ends only after `resume`.

A weight update pauses every server (in place or retracting its requests, see
`kv_on_update`), opens a session, posts one `/update_weights_from_distributed`
per bucket while the sender broadcasts that bucket from rank 0 of the group, then
closes the session and continues. Generation stops for the whole transfer (SGLang
has no staging copy); requests stay. A bucket is SGLang's "flattened_bucket": the
tensors' bytes back to back in one uint8 tensor, no padding, every offset a
multiple of the tensor's element size (`pack_flattened_bucket`).

Not yet run against a real SGLang server (no GPU here); to confirm there:
pydantic's handling of our control bodies, `/health` as a readiness check, the
router's `/health`, and that `output_token_sampling_logprobs` is present for every
sample of a batch with top-p/top-k.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import json
import random
import socket
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Callable, Protocol, runtime_checkable

import torch

from entr_megatron.rollout.engine import (
    EngineError,
    EngineHealth,
    GenerateRequest,
    GenerateResult,
    SamplingParams,
    WeightReceiver,
    WeightSource,
    WeightUpdateReport,
)

__all__ = [
    "KV_ON_UPDATE",
    "SGLANG_SOURCE",
    "SGLANG_VERSION",
    "FlatBucket",
    "SGLangClient",
    "SGLangEngine",
    "SGLangEngineConfig",
    "SGLangError",
    "SGLangTimeout",
    "WeightGroup",
    "WeightSender",
    "generate_payload",
    "iter_flattened_buckets",
    "pack_flattened_bucket",
    "parse_generate_output",
    "sampling_params_payload",
]

SGLANG_VERSION = "0.5.23"
"""SGLang release whose HTTP protocol this module implements (and `sglang_mock` imitates)."""
SGLANG_SOURCE = (
    "sglang 0.5.23 from PyPI: sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl, sha256 "
    "00b3cd5b265ac76c64185fbb6b95424f324ddd9f428d0306b77bc9db9d859937 (git tag v0.5.23; the wheel "
    "records no commit); sglang-router 0.3.2 for the router flags"
)
KV_ON_UPDATE = {"recompute": "retract", "keep": "in_place"}
"""Our name -> SGLang's pause mode during a weight update. "recompute": running requests go back
to the queue and their KV cache (and the prefix cache) is rebuilt with the new weights. "keep":
requests keep the KV cache of the old weights (in-flight update, as the embedded engine's
default); the prefix cache cannot be flushed then and keeps serving old-weight prefixes."""


# --- errors and the HTTP client --------------------------------------------------------


class SGLangError(EngineError):
    """An SGLang server answered with an error or not at all; its answer is in the notes."""

    def __init__(self, message: str, *, url: str, status: int | None = None, body: str | None = None):
        super().__init__(message)
        self.url, self.status, self.body = url, status, body
        if body:
            self.add_note(f"server answer: {body}")


class SGLangTimeout(SGLangError, TimeoutError):
    """No answer within the call's timeout."""


_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))
"""Talks to the servers directly, whatever http_proxy says."""


def _decode(raw: bytes) -> Any:
    text = raw.decode("utf-8", errors="replace")
    if not text:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return text


class SGLangClient:
    """One SGLang server's HTTP API. `timeout_s` bounds each socket operation of a call."""

    def __init__(self, url: str, timeout_s: float = 60.0):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"SGLangClient url must start with http:// or https://, got {url!r}")
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s

    def __repr__(self) -> str:
        return f"SGLangClient({self.url!r})"

    def call(self, method: str, path: str, payload: Any = None, *, timeout: float | None = None) -> Any:
        """One request; returns the decoded JSON (or text, or None for an empty body)."""
        url = self.url + path
        data = None if payload is None else json.dumps(payload).encode()
        headers = {"Content-Type": "application/json"} if data is not None else {}
        req = urllib.request.Request(url, data=data, method=method, headers=headers)
        timeout = self.timeout_s if timeout is None else timeout
        try:
            with _OPENER.open(req, timeout=timeout) as resp:
                body = _decode(resp.read())
        except urllib.error.HTTPError as e:
            text = e.read().decode("utf-8", errors="replace")
            raise SGLangError(f"{method} {url} failed: HTTP {e.code} {e.reason}", url=url, status=e.code, body=text) from None
        except (TimeoutError, socket.timeout) as e:
            raise SGLangTimeout(f"{method} {url}: no answer within {timeout:g} s", url=url) from e
        except urllib.error.URLError as e:
            if isinstance(e.reason, (TimeoutError, socket.timeout)):
                raise SGLangTimeout(f"{method} {url}: no answer within {timeout:g} s", url=url) from e
            raise SGLangError(f"{method} {url}: cannot reach the server ({e.reason})", url=url) from e
        except (ConnectionError, OSError) as e:  # reset mid-answer, etc.
            raise SGLangError(f"{method} {url}: connection failed ({e!r})", url=url) from e
        if isinstance(body, dict) and body.get("success") is False:
            raise SGLangError(f"{method} {url} failed", url=url, status=200, body=json.dumps(body))
        return body

    def _get_first(self, paths: Sequence[str], timeout: float | None = None) -> Any:
        """GET the first path the server has (0.5.23 renamed /get_model_info to /model_info)."""
        for path in paths[:-1]:
            try:
                return self.call("GET", path, timeout=timeout)
            except SGLangError as e:
                if e.status != 404:
                    raise
        return self.call("GET", paths[-1], timeout=timeout)

    # --- state ---------------------------------------------------------------------------

    def is_healthy(self, timeout: float = 30.0, path: str = "/health") -> bool:
        """GET /health (or /health_generate) answers 200; never raises."""
        try:
            self.call("GET", path, timeout=timeout)
            return True
        except SGLangError:
            return False

    def model_info(self, timeout: float | None = None) -> dict:
        return self._get_first(("/model_info", "/get_model_info"), timeout)

    def server_info(self, timeout: float | None = None) -> dict:
        return self._get_first(("/server_info", "/get_server_info"), timeout)

    def weight_version(self, timeout: float | None = None) -> str:
        """The server's weight version string (model_info's "weight_version"; "default" if absent)."""
        return str(self.model_info(timeout).get("weight_version", "default"))

    # --- generation ----------------------------------------------------------------------

    def generate(self, payload: Mapping[str, Any], timeout: float | None = None) -> list[dict]:
        """POST /generate (non-streaming); always a list of answers, in rid order."""
        out = self.call("POST", "/generate", dict(payload), timeout=timeout)
        if isinstance(out, dict):
            out = [out]
        if not isinstance(out, list) or not all(isinstance(o, dict) and "meta_info" in o for o in out):
            raise SGLangError("POST /generate: unexpected answer", url=self.url + "/generate", body=str(out)[:2000])
        return out

    def abort_request(self, rid: str = "", abort_all: bool = False, timeout: float | None = None) -> None:
        """End one request (its exact rid) or, with abort_all, every request on the server."""
        if not rid and not abort_all:
            raise ValueError("abort_request needs a rid or abort_all=True")
        self.call("POST", "/abort_request", {"rid": rid, "abort_all": abort_all}, timeout=timeout)

    def pause_generation(self, mode: str, timeout: float | None = None) -> None:
        """mode "in_place" (keep KV), "retract" (requests back to the queue) or "abort" (end them all)."""
        if mode not in ("in_place", "retract", "abort"):
            raise ValueError(f"pause mode must be 'in_place', 'retract' or 'abort', got {mode!r}")
        self.call("POST", "/pause_generation", {"mode": mode}, timeout=timeout)

    def continue_generation(self, timeout: float | None = None) -> None:
        self.call("POST", "/continue_generation", {}, timeout=timeout)

    def flush_cache(self, timeout: float | None = None) -> str:
        """Drop the prefix cache; fails (400) while requests run."""
        return self.call("POST", "/flush_cache", timeout=timeout) or ""

    # --- weights -------------------------------------------------------------------------

    def init_weights_update_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int,
        group_name: str = "weight_update_group", backend: str = "nccl", timeout: float | None = None,
    ) -> dict:
        """Join the learner's broadcast group as ranks rank_offset .. rank_offset + tp_size - 1.
        Blocks until every rank has joined."""
        payload = {
            "master_address": master_address, "master_port": int(master_port), "rank_offset": int(rank_offset),
            "world_size": int(world_size), "group_name": group_name, "backend": backend,
        }
        return self.call("POST", "/init_weights_update_group", payload, timeout=timeout)

    def begin_weight_update(self, selector: str = "all", timeout: float | None = None) -> bool:
        """Open a weight-update session (0.5.23 refuses updates outside one); False for an older server."""
        try:
            self.call("POST", "/begin_weight_update", {"selector": selector}, timeout=timeout)
            return True
        except SGLangError as e:
            if e.status == 404:
                return False
            raise

    def end_weight_update(self, timeout: float | None = None) -> dict:
        return self.call("POST", "/end_weight_update", {}, timeout=timeout)

    def update_weights_from_distributed(
        self, names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]], *,
        group_name: str = "weight_update_group", flush_cache: bool = False, weight_version: str | None = None,
        load_format: str | None = "flattened_bucket", abort_all_requests: bool = False, timeout: float | None = None,
    ) -> dict:
        """Receive tensors broadcast from rank 0 of the group (one flat bucket when load_format is
        "flattened_bucket", else one broadcast per tensor, in order) and load them."""
        if not (len(names) == len(dtypes) == len(shapes)) or not names:
            raise ValueError(f"names, dtypes and shapes must have the same non-zero length, got {len(names)}, {len(dtypes)}, {len(shapes)}")
        payload: dict[str, Any] = {
            "names": list(names), "dtypes": list(dtypes), "shapes": [list(s) for s in shapes],
            "group_name": group_name, "flush_cache": flush_cache, "abort_all_requests": abort_all_requests,
            "weight_version": weight_version,
        }
        if load_format is not None:
            payload["load_format"] = load_format
        return self.call("POST", "/update_weights_from_distributed", payload, timeout=timeout)

    def destroy_weights_update_group(self, group_name: str = "weight_update_group", timeout: float | None = None) -> dict:
        return self.call("POST", "/destroy_weights_update_group", {"group_name": group_name}, timeout=timeout)

    def update_weight_version(self, new_version: str, abort_all_requests: bool = False, timeout: float | None = None) -> dict:
        """Relabel the weights (SGLang's own default aborts every request; ours does not)."""
        body = {"new_version": str(new_version), "abort_all_requests": abort_all_requests}
        return self.call("POST", "/update_weight_version", body, timeout=timeout)


# --- payloads and answers ----------------------------------------------------------------


def _truncated(params: SamplingParams) -> bool:
    return not params.greedy and (params.top_p < 1.0 or params.top_k > 0)


def sample_seed(seed: int, index: int) -> int:
    """SGLang `sampling_seed` of sample `index` of a request seeded with `seed`."""
    return (seed * 1_000_003 + index) % (1 << 63)


def sampling_params_payload(params: SamplingParams, index: int = 0, seed: int | None = None) -> dict[str, Any]:
    """SGLang `sampling_params` of one sample (n is expanded by us, see `generate_payload`).
    The seed (params.seed, else `seed`) takes effect only on servers started with
    --enable-deterministic-inference; those use 42 for a request without one."""
    sp: dict[str, Any] = {
        "max_new_tokens": params.max_new_tokens,
        "temperature": float(params.temperature),
        "top_p": float(params.top_p),
        "top_k": params.top_k if params.top_k > 0 else -1,  # SGLang: -1 disables; 0 is an error
        "ignore_eos": params.ignore_eos,
    }
    if params.stop_token_ids:
        sp["stop_token_ids"] = list(params.stop_token_ids)
    seed = params.seed if params.seed is not None else seed
    if seed is not None:
        sp["sampling_seed"] = sample_seed(seed, index)
    return sp


def sample_rids(request_id: str, n: int) -> list[str]:
    """SGLang rids of a request's samples. We expand n ourselves: with sampling_params.n SGLang
    gives the samples fresh uuids, which could not be aborted one by one."""
    return [f"{request_id}-{i}" for i in range(n)]


def generate_payload(prompt_ids: Sequence[int], params: SamplingParams, rids: Sequence[str], seed: int | None = None) -> dict[str, Any]:
    """The /generate body for `len(rids)` samples of one prompt (`seed` when params.seed is None)."""
    n = len(rids)
    sps = [sampling_params_payload(params, i, seed) for i in range(n)]
    payload: dict[str, Any] = {
        "input_ids": list(prompt_ids) if n == 1 else [list(prompt_ids)] * n,
        "rid": rids[0] if n == 1 else list(rids),
        "sampling_params": sps[0] if n == 1 or "sampling_seed" not in sps[0] else sps,
        "return_logprob": True,
        "stream": False,
    }
    if _truncated(params):
        payload["return_sampling_mask"] = True
    return payload


def version_number(version: Any, default: int) -> int:
    """Our int of an SGLang version string ("3" -> 3; "default" and the like -> `default`)."""
    try:
        return int(str(version))
    except ValueError:
        return default


def _token_versions(meta: Mapping[str, Any], num_tokens: int, default: int) -> list[int]:
    spans = meta.get("weight_versions") or []
    if not spans:
        return [version_number(meta.get("weight_version"), default)] * num_tokens
    versions = [version_number(spans[0]["version"], default)] * num_tokens
    for span in spans:
        v = version_number(span["version"], default)
        for t in range(max(0, int(span["start"])), min(num_tokens, int(span["end"]))):
            versions[t] = v
    return versions


def parse_generate_output(out: Mapping[str, Any], params: SamplingParams, *, default_version: int) -> dict[str, Any]:
    """One /generate answer -> the per-token fields of a GenerateResult (see the module docstring)."""
    meta = out["meta_info"]
    output_ids = [int(t) for t in out.get("output_ids") or []]
    n = len(output_ids)
    reason = meta.get("finish_reason")
    kind = reason.get("type") if isinstance(reason, dict) else None
    if kind not in ("stop", "length", "abort"):
        raise ValueError(f"unexpected finish_reason {reason!r}")
    entries = meta.get("output_token_logprobs") or []
    if len(entries) != n or any(int(e[1]) != t for e, t in zip(entries, output_ids)):
        raise ValueError(f"output_token_logprobs ({len(entries)} entries) do not match output_ids ({n} tokens)")
    reported = [float(e[0]) for e in entries]
    raw = reported if params.return_raw_logprobs else None
    if _truncated(params):
        sampling = meta.get("output_token_sampling_logprobs")
        if sampling is None:
            if n:
                raise ValueError(f"no output_token_sampling_logprobs: the server ignores return_sampling_mask (SGLang {SGLANG_VERSION} has it)")
            sampling = []
        logprobs = [float(x) for x in sampling]
        if len(logprobs) != n:
            raise ValueError(f"{len(logprobs)} output_token_sampling_logprobs for {n} tokens")
    else:
        logprobs = reported
    return dict(
        output_ids=output_ids, logprobs=logprobs, raw_logprobs=raw, entropy=None, finish_reason=kind,
        versions=_token_versions(meta, n, default_version),
    )


# --- weight buckets ----------------------------------------------------------------------


@dataclass
class FlatBucket:
    """SGLang "flattened_bucket": tensors' bytes back to back in one uint8 tensor."""

    names: list[str]
    dtypes: list[str]
    """torch dtype names without "torch." (SGLang does getattr(torch, dtype))."""
    shapes: list[list[int]]
    flat: torch.Tensor

    @property
    def num_bytes(self) -> int:
        return self.flat.numel()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def pack_flattened_bucket(named_tensors: Sequence[tuple[str, torch.Tensor]]) -> FlatBucket:
    """Pack tensors the way SGLang's FlattenedTensorBucket unpacks them: no padding, and larger
    elements first so that every offset is a multiple of its element size (SGLang refuses
    unaligned tensors)."""
    if not named_tensors:
        raise ValueError("cannot pack an empty bucket")
    order = sorted(named_tensors, key=lambda nt: -nt[1].element_size())  # stable: same sizes keep their order
    parts = [t.detach().contiguous().reshape(-1).view(torch.uint8) for _, t in order]
    return FlatBucket(
        names=[name for name, _ in order],
        dtypes=[_dtype_name(t.dtype) for _, t in order],
        shapes=[list(t.shape) for _, t in order],
        flat=torch.cat(parts) if len(parts) > 1 else parts[0].clone(),
    )


def unpack_flattened_bucket(bucket: FlatBucket) -> list[tuple[str, torch.Tensor]]:
    """The receiver's view (SGLang's FlattenedTensorBucket.empty + reconstruct_tensors)."""
    out, offset = [], 0
    for name, dtype_name, shape in zip(bucket.names, bucket.dtypes, bucket.shapes):
        dtype = getattr(torch, dtype_name)
        size = torch.Size(shape).numel() * dtype.itemsize
        assert offset % dtype.itemsize == 0, f"unaligned {name}: offset {offset}, {dtype}"
        out.append((name, bucket.flat[offset:offset + size].view(dtype).reshape(shape)))
        offset += size
    assert offset == bucket.flat.numel(), "bucket size does not match its tensors"
    return out


def iter_flattened_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, dtype: torch.dtype | None = None,
) -> Iterator[FlatBucket]:
    """Buckets of at most `bucket_bytes` (a larger tensor gets one of its own); floating tensors
    are cast to `dtype` when given (send what the servers store)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    pending: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in named_tensors:
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        nbytes = t.numel() * t.element_size()
        if pending and size + nbytes > bucket_bytes:
            yield pack_flattened_bucket(pending)
            pending, size = [], 0
        pending.append((name, t))
        size += nbytes
    if pending:
        yield pack_flattened_bucket(pending)


# --- weight group ------------------------------------------------------------------------


@dataclass(frozen=True)
class WeightGroup:
    """The broadcast group shared by the learner (rank 0) and every server rank."""

    master_address: str
    master_port: int
    world_size: int
    group_name: str
    backend: str
    rank_offsets: tuple[int, ...]
    """First rank of each server (server i holds rank_offsets[i] .. + tp_size - 1)."""
    streams: int = 1
    """gloo: TCP connections between each pair of ranks, used in turn by consecutive broadcasts
    (`weight_sync.stage_groups`); 1 for SGLang's groups, whose side opens one."""


@runtime_checkable
class WeightSender(Protocol):
    """Rank 0 of the weight group (the learner side; weight_sync provides the real one)."""

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Broadcast `tensor` from rank 0 of the group; returns when it is sent."""
        ...


# --- the engine --------------------------------------------------------------------------


@dataclass(frozen=True)
class SGLangEngineConfig:
    """How to reach and drive a set of SGLang servers."""

    urls: tuple[str, ...]
    """Every server (http://host:port); control calls go to each."""
    router_url: str | None = None
    """sglang-router in front of `urls`: /generate goes there."""
    request_timeout_s: float = 60.0
    """Control calls (abort, pause, info)."""
    generate_timeout_s: float = 3600.0
    """One /generate call (a whole non-streamed group of samples)."""
    weight_update_timeout_s: float = 1800.0
    """Group set-up and each bucket of a weight update."""
    max_concurrent_requests: int = 256
    """/generate calls in flight at once (one per GenerateRequest; the rest wait)."""
    kv_on_update: str = "recompute"
    """See KV_ON_UPDATE: "recompute" (SGLang "retract" pause) or "keep" ("in_place")."""
    group_name: str = "weight_update_group"
    weight_bucket_bytes: int = 512 << 20
    weight_dtype: str | None = None
    """Cast floating tensors to this torch dtype name while packing (e.g. "bfloat16"); None: as given."""
    flattened_buckets: bool = True
    """One broadcast per bucket (load_format "flattened_bucket"); False: one per tensor (old servers)."""
    tp_sizes: tuple[int, ...] | None = None
    """Ranks per server in the weight group; None: ask each server (/server_info tp_size)."""
    initial_version: int = 0
    """Version of the servers' weights before any update; a non-numeric server version is set to it."""
    abort_retry_s: float = 0.5
    """Re-send aborts this often until the request ends (an abort arriving before the server
    registered the rid is ignored by SGLang)."""

    def __post_init__(self):
        if not self.urls:
            raise ValueError("SGLangEngineConfig.urls is empty: give at least one server")
        if self.kv_on_update not in KV_ON_UPDATE:
            raise ValueError(f"SGLangEngineConfig.kv_on_update must be one of {sorted(KV_ON_UPDATE)}, got {self.kv_on_update!r}")
        if self.max_concurrent_requests < 1:
            raise ValueError(f"SGLangEngineConfig.max_concurrent_requests must be >= 1, got {self.max_concurrent_requests}")
        if self.weight_bucket_bytes <= 0:
            raise ValueError(f"SGLangEngineConfig.weight_bucket_bytes must be positive, got {self.weight_bucket_bytes}")
        if self.weight_dtype is not None and not isinstance(getattr(torch, self.weight_dtype, None), torch.dtype):
            raise ValueError(f"SGLangEngineConfig.weight_dtype must be a torch dtype name, got {self.weight_dtype!r}")
        if self.tp_sizes is not None and (len(self.tp_sizes) != len(self.urls) or min(self.tp_sizes) < 1):
            raise ValueError(f"SGLangEngineConfig.tp_sizes must give a size >= 1 per url, got {self.tp_sizes}")
        for name in ("request_timeout_s", "generate_timeout_s", "weight_update_timeout_s", "abort_retry_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SGLangEngineConfig.{name} must be > 0, got {getattr(self, name)!r}")


@dataclass
class _Live:
    request: GenerateRequest
    rids: list[str]
    server: int | None  # index into the servers; None: the router
    aborted: bool = False


def _wait_all(futures: Sequence[cf.Future], timeout: float, what: str) -> list[Any]:
    """Results of all futures; the first failure (or a timeout) raises."""
    done, pending = cf.wait(futures, timeout=timeout, return_when=cf.FIRST_EXCEPTION)
    for f in futures:
        if f in done and f.exception() is not None:
            raise f.exception()
    if pending:
        raise EngineError(f"{what}: {len(pending)} of {len(futures)} calls unfinished after {timeout:.0f} s")
    return [f.result() for f in futures]


class SGLangEngine:
    """`RolloutEngine` over running SGLang servers (see the module docstring)."""

    def __init__(self, config: SGLangEngineConfig):
        self.config = config
        self.servers = [SGLangClient(u, config.request_timeout_s) for u in config.urls]
        self.router = None if config.router_url is None else SGLangClient(config.router_url, config.request_timeout_s)
        self._pool = cf.ThreadPoolExecutor(config.max_concurrent_requests, thread_name_prefix="sglang-generate")
        self._control = cf.ThreadPoolExecutor(2 * len(self.servers) + 4, thread_name_prefix="sglang-control")
        self._cond = threading.Condition()
        self._results: collections.deque[GenerateResult] = collections.deque()
        self._errors: list[BaseException] = []
        self._live: dict[str, _Live] = {}
        self._update_lock = threading.Lock()
        self._paused = False
        self._closed = False
        self._sender: WeightSender | None = None
        self.group: WeightGroup | None = None
        self._last_update: WeightUpdateReport | None = None
        self._aborter: threading.Thread | None = None
        self._version = self._sync_versions()

    def _sync_versions(self) -> int:
        """Read the servers' versions; label non-numeric ones (SGLang's "default") `initial_version`."""
        versions = set()
        for s in self.servers:
            v = s.weight_version()
            if not v.lstrip("-").isdigit():
                try:
                    s.update_weight_version(str(self.config.initial_version), abort_all_requests=False)
                except SGLangError as e:
                    if e.status != 404:  # an old server without versions: parse_generate_output maps them
                        raise
                v = str(self.config.initial_version)
            versions.add(int(v))
        if len(versions) != 1:
            raise EngineError(f"SGLang servers disagree on the weight version: {sorted(versions)} ({self.config.urls})")
        return versions.pop()

    # --- RolloutEngine -------------------------------------------------------------------

    @property
    def weight_version(self) -> int:
        return self._version

    def submit(self, requests: Sequence[GenerateRequest]) -> list[str]:
        """Queue requests (one /generate call each, n samples in it); returns their ids."""
        self._check_open()
        ids: list[str] = []
        for r in requests:
            p = r.params
            if p.return_raw_logprobs and not (p.greedy or p.temperature == 1.0):
                raise ValueError(
                    "SamplingParams.return_raw_logprobs needs temperature 1 or 0 with SGLang: it reports "
                    f"log-probs after temperature scaling (request {r.request_id}, temperature {p.temperature})"
                )
            if r.request_id is None:
                r.request_id = uuid.uuid4().hex
            if r.request_id in self._live or r.request_id in ids:
                raise ValueError(f"request id {r.request_id!r} is already in flight")
            ids.append(r.request_id)
        with self._cond:
            for r in requests:
                live = _Live(r, sample_rids(r.request_id, r.params.n), self._pick_server())
                self._live[r.request_id] = live
                self._pool.submit(self._run, live)
        return ids

    def poll(self, timeout: float | None = 0.0) -> list[GenerateResult]:
        """Finished samples (a request's n samples arrive together); waits up to `timeout` s for
        the first. A failed /generate call raises here, with the server's answer as a note."""
        with self._cond:
            self._cond.wait_for(lambda: self._results or self._errors, timeout)
            if self._errors:
                raise self._errors.pop(0)
            out = list(self._results)
            self._results.clear()
            return out

    def abort(self, request_ids: Iterable[str]) -> None:
        """End requests: each comes back with finish_reason "abort" and its tokens so far."""
        self._check_open()
        targets = []
        with self._cond:
            for rid in request_ids:
                live = self._live.get(rid)
                if live is not None and not live.aborted:
                    live.aborted = True
                    targets.append(live)
            if targets and self._aborter is None:
                self._aborter = threading.Thread(target=self._abort_loop, name="sglang-abort", daemon=True)
                self._aborter.start()
        self._send_aborts(targets)

    def pause(self) -> None:
        """Stop decoding on every server (SGLang pause mode from `kv_on_update`); requests stay."""
        self._check_open()
        mode = KV_ON_UPDATE[self.config.kv_on_update]
        _wait_all([self._control.submit(s.pause_generation, mode) for s in self.servers], self.config.request_timeout_s, "pause")
        self._paused = True

    def resume(self) -> None:
        self._check_open()
        _wait_all([self._control.submit(s.continue_generation) for s in self.servers], self.config.request_timeout_s, "resume")
        self._paused = False

    def health(self) -> EngineHealth:
        """Every server answers /model_info; never raises."""
        with self._cond:
            running = sum(len(live.rids) for live in self._live.values())
        base = dict(weight_version=self._version, paused=self._paused, num_running=running, last_update=self._last_update)
        if self._closed:
            return EngineHealth(alive=False, error="the engine was shut down", **base)
        errors = []
        for s in self.servers:
            try:
                s.model_info(timeout=min(self.config.request_timeout_s, 10.0))
            except SGLangError as e:
                errors.append("\n".join([str(e), *getattr(e, "__notes__", [])]))
        return EngineHealth(alive=not errors, error="\n".join(errors) or None, **base)

    def update_weights(self, weights: WeightSource, version: int) -> WeightUpdateReport:
        """Broadcast a complete set of HF-named tensors to every server as `version` (needs
        `init_weights_update_group` and `set_weight_sender`). Generation is paused for the
        whole transfer (the report's swap_s); requests stay and their later tokens carry
        `version`. On failure the servers are resumed and the error raised; the servers may
        then hold a partial update (SGLang loads each bucket as it arrives): send it again."""
        if isinstance(weights, WeightReceiver):
            raise TypeError("SGLang servers receive weights over their broadcast group, not through a WeightReceiver")
        if self.group is None or self._sender is None:
            raise ValueError("SGLangEngine.update_weights needs init_weights_update_group(...) and set_weight_sender(...) first")
        with self._update_lock:
            self._check_open()
            if version <= self._version:
                raise ValueError(f"weight version must increase: engine is at {self._version}, got {version}")
            t0 = time.time()
            was_paused = self._paused
            try:  # resume even after a partial pause (continue_generation is harmless on a running server)
                if not was_paused:
                    self.pause()
                t_paused = time.time()
                with self._cond:
                    running = sum(len(live.rids) for live in self._live.values())
                num_tensors, num_bytes = self._transfer(weights, version)
            finally:
                t_loaded = time.time()
                if not was_paused:
                    self.resume()
            t_end = time.time()
            self._version = version
            self._last_update = WeightUpdateReport(
                version=version, num_tensors=num_tensors, num_bytes=num_bytes, transfer_s=t_loaded - t0,
                swap_s=t_end - t_paused, wait_s=t_paused - t0, total_s=t_end - t0,
                decode_steps_during_transfer=0, running_at_swap=running,
            )
            return self._last_update

    def shutdown(self) -> None:
        """Abort our requests still on the servers (best effort) and stop the threads; idempotent.
        The servers keep running (the launcher owns them)."""
        if self._closed:
            return
        with self._cond:
            live = list(self._live.values())
            for entry in live:
                entry.aborted = True
        try:
            self._send_aborts(live, timeout=5.0)
        except EngineError:
            pass
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._control.shutdown(wait=False, cancel_futures=True)
        with self._cond:
            self._cond.notify_all()

    def __enter__(self) -> SGLangEngine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # --- weight group --------------------------------------------------------------------

    def tp_sizes(self) -> tuple[int, ...]:
        """Ranks each server holds in the weight group."""
        if self.config.tp_sizes is not None:
            return self.config.tp_sizes
        return tuple(int(s.server_info().get("tp_size", 1)) for s in self.servers)

    def init_weights_update_group(
        self, master_address: str, master_port: int, *, backend: str = "nccl",
        join: Callable[[WeightGroup], Any] | None = None,
    ) -> WeightGroup:
        """Create the broadcast group: rank 0 is the learner, server i holds ranks
        rank_offsets[i] .. + tp_size - 1. `join(group)` runs concurrently with the servers'
        joins (the learner side, e.g. creating its rank-0 process group and a sender)."""
        sizes = self.tp_sizes()
        offsets = tuple(1 + sum(sizes[:i]) for i in range(len(sizes)))
        group = WeightGroup(master_address, int(master_port), 1 + sum(sizes), self.config.group_name, backend, offsets)
        futures = [
            self._control.submit(
                s.init_weights_update_group, master_address, master_port, off, group.world_size,
                group.group_name, backend, timeout=self.config.weight_update_timeout_s,
            )
            for s, off in zip(self.servers, offsets)
        ]
        if join is not None:
            futures.append(self._control.submit(join, group))
        _wait_all(futures, self.config.weight_update_timeout_s, "init_weights_update_group")
        self.group = group
        return group

    def set_weight_sender(self, sender: WeightSender | None) -> None:
        """The rank-0 side of the group that `update_weights` broadcasts through."""
        if sender is not None and not isinstance(sender, WeightSender):
            raise TypeError(f"weight sender must have broadcast(tensor), got {type(sender).__name__}")
        self._sender = sender

    def destroy_weights_update_group(self) -> None:
        if self.group is None:
            return
        _wait_all(
            [self._control.submit(s.destroy_weights_update_group, self.group.group_name) for s in self.servers],
            self.config.request_timeout_s, "destroy_weights_update_group",
        )
        self.group, self._sender = None, None

    # --- plumbing ------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise EngineError("the SGLang engine was shut down")

    def _pick_server(self) -> int | None:
        if self.router is not None:
            return None
        load = collections.Counter(live.server for live in self._live.values())
        return min(range(len(self.servers)), key=lambda i: load[i])

    def _run(self, live: _Live) -> None:
        """One /generate call (in a pool thread)."""
        r = live.request
        try:
            if live.aborted:  # never reached a server
                parsed = [dict(output_ids=[], logprobs=[], raw_logprobs=[] if r.params.return_raw_logprobs else None,
                               entropy=None, finish_reason="abort", versions=[]) for _ in live.rids]
            else:
                client = self.router if live.server is None else self.servers[live.server]
                # Always seeded: a deterministic-inference server would give every unseeded sample seed 42.
                payload = generate_payload(r.prompt_ids, r.params, live.rids, seed=random.getrandbits(62))
                outs = client.generate(payload, timeout=self.config.generate_timeout_s)
                by_rid = {o["meta_info"].get("id"): o for o in outs}
                if set(by_rid) == set(live.rids):
                    outs = [by_rid[rid] for rid in live.rids]
                if len(outs) != len(live.rids):
                    raise SGLangError(f"/generate returned {len(outs)} answers for {len(live.rids)} samples", url=client.url)
                parsed = []
                for o in outs:
                    try:
                        parsed.append(parse_generate_output(o, r.params, default_version=self.config.initial_version))
                    except (ValueError, KeyError, TypeError, IndexError) as e:
                        raise SGLangError(f"unusable /generate answer for request {r.request_id}: {e}",
                                          url=client.url, body=json.dumps(o)[:4000]) from e
            results = [
                GenerateResult(request_id=r.request_id, sample_index=i, prompt_ids=list(r.prompt_ids),
                               group_id=r.group_id, metadata=dict(r.metadata), **p)
                for i, p in enumerate(parsed)
            ]
            with self._cond:
                self._results.extend(results)
        except BaseException as e:  # surfaced by poll()
            if isinstance(e, SGLangError):
                e.add_note(f"request {r.request_id} ({len(live.rids)} samples)")
            if isinstance(e, SGLangTimeout):  # do not leave it generating for nobody
                try:
                    self._send_aborts([live], timeout=5.0)
                except EngineError:
                    pass
            with self._cond:
                self._errors.append(e)
        finally:
            with self._cond:
                self._live.pop(r.request_id, None)
                self._cond.notify_all()

    def _send_aborts(self, targets: Sequence[_Live], timeout: float | None = None) -> None:
        calls = []
        for live in targets:
            # Behind a router we do not know which server has the request: ask all.
            servers = self.servers if live.server is None else [self.servers[live.server]]
            calls += [self._control.submit(s.abort_request, rid, timeout=timeout) for s in servers for rid in live.rids]
        if calls:
            _wait_all(calls, timeout or self.config.request_timeout_s, "abort")

    def _abort_loop(self) -> None:
        while not self._closed:
            time.sleep(self.config.abort_retry_s)
            with self._cond:
                targets = [live for live in self._live.values() if live.aborted]
            try:
                self._send_aborts(targets)
            except (EngineError, RuntimeError):  # the next round retries; poll reports dead servers
                pass

    def _transfer(self, weights: WeightSource, version: int) -> tuple[int, int]:
        """Begin the session on every server, broadcast the buckets, end it."""
        cfg, group, sender = self.config, self.group, self._sender
        timeout = cfg.weight_update_timeout_s
        # Own threads: each bucket's calls block until the broadcast, which must not queue behind them.
        # No waiting for them on failure: a broadcast nobody receives may never return.
        pool = cf.ThreadPoolExecutor(len(self.servers) + 1, thread_name_prefix="sglang-weights")
        try:
            sessions = _wait_all([pool.submit(s.begin_weight_update) for s in self.servers], timeout, "begin_weight_update")

            def end_sessions() -> None:
                _wait_all([pool.submit(s.end_weight_update) for s, opened in zip(self.servers, sessions) if opened],
                          timeout, "end_weight_update")

            try:
                counts = self._send_buckets(pool, weights, version, cfg, group, sender, timeout)
            except BaseException as e:  # close the sessions anyway, or the next update cannot begin
                try:
                    end_sessions()
                except EngineError as end_error:
                    e.add_note(f"closing the weight-update sessions failed too: {end_error}")
                raise
            end_sessions()
            return counts
        finally:
            pool.shutdown(wait=False, cancel_futures=True)

    def _send_buckets(self, pool, weights, version, cfg, group, sender, timeout) -> tuple[int, int]:
        items = weights.items() if isinstance(weights, Mapping) else weights
        dtype = None if cfg.weight_dtype is None else getattr(torch, cfg.weight_dtype)
        flush = cfg.kv_on_update == "recompute"  # a pause in place leaves requests that block the flush
        num_tensors = num_bytes = 0
        buckets = iter_flattened_buckets(items, cfg.weight_bucket_bytes, dtype)
        bucket = next(buckets, None)
        if bucket is None:
            raise ValueError("update_weights got no tensors")
        while bucket is not None:
            following = next(buckets, None)
            last = following is None
            kwargs = dict(group_name=group.group_name, flush_cache=flush and last,
                          weight_version=str(version) if last else None, timeout=timeout)
            if cfg.flattened_buckets:
                tensors = [bucket.flat]
                kwargs["load_format"] = "flattened_bucket"
            else:
                tensors = [t for _, t in unpack_flattened_bucket(bucket)]
                kwargs["load_format"] = None
            calls = [pool.submit(s.update_weights_from_distributed, bucket.names, bucket.dtypes, bucket.shapes, **kwargs)
                     for s in self.servers]
            calls.append(pool.submit(lambda ts=tensors: [sender.broadcast(t) for t in ts]))
            _wait_all(calls, timeout, f"update_weights_from_distributed (version {version})")
            num_tensors += len(bucket.names)
            num_bytes += bucket.num_bytes
            bucket = following
        return num_tensors, num_bytes
