"""SGLang's HTTP protocol as we use it: the endpoints, the bodies we build, the answers we parse.

Checked against SGLang 0.5.23 (PyPI wheel, see `SGLANG_SOURCE`) in
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
| /generate | POST | {input_ids, rid, sampling_params, return_logprob, return_sampling_mask, return_routed_experts, stream} | {output_ids, meta_info} or a list of them |
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

The answers, checked and read into our records: `answers.py`; the weight bucket: `flat_bucket.py`.

A weight update pauses every server (in place or retracting its requests, see
`KV_ON_UPDATE`), opens a session, posts one `/update_weights_from_distributed`
per bucket while the sender broadcasts that bucket from rank 0 of the group, then
closes the session and continues (the engine pauses, `weight_sync.transports`
runs the rest). Generation stops for the whole transfer (SGLang has no staging
copy); requests stay. A bucket is SGLang's "flattened_bucket": the tensors' bytes
back to back in one uint8 tensor, no padding, every offset a multiple of the
tensor's element size (flat_bucket.py).

Run against real 0.5.23 servers on CPU (tests/sglang_real, docs/SGLANG_ON_CPU.md): every
endpoint above with our bodies, `/health` as the readiness check, the weight handshake over
gloo, `output_token_sampling_logprobs` for every sample of a top-k batch; their answers are
recorded in tests/unit/sglang_answers_0.5.23.json. Still to confirm on GPUs: the NCCL weight
group, the router's `/health`, and `meta_info.routed_experts` of a real MoE model (row count
with the prefix cache and retraction, with EP / DP attention).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from entr_megatron.rollout.engine import SamplingParams
from entr_megatron.utils.seeding import mix_seed

__all__ = [
    "KV_ON_UPDATE",
    "ROUTES_FLAG",
    "SAMPLING_SEED_MODULUS",
    "SGLANG_SOURCE",
    "SGLANG_VERSION",
    "asks_sampling_mask",
    "generate_payload",
    "init_group_payload",
    "sample_rids",
    "sample_seed",
    "sampling_params_payload",
    "update_weights_from_tensor_payload",
    "update_weights_payload",
]

SGLANG_VERSION = "0.5.23"
"""SGLang release whose HTTP protocol this package implements (and `sglang_mock` imitates)."""
SGLANG_SOURCE = (
    "sglang 0.5.23 from PyPI: sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl, sha256 "
    "00b3cd5b265ac76c64185fbb6b95424f324ddd9f428d0306b77bc9db9d859937 (git tag v0.5.23; the wheel "
    "records no commit); sglang-router 0.3.2 for the router flags"
)
KV_ON_UPDATE = {"recompute": "retract", "keep": "in_place"}
"""Our name -> SGLang's pause mode during a weight update. "recompute": running requests go back
to the queue and their KV cache (and the prefix cache) is rebuilt with the new weights. "keep":
requests keep the KV cache of the old weights (in-flight update, as the embedded engine's
default); the prefix cache cannot be flushed then and keeps serving old-weight prefixes to new
requests (seen on a real 0.5.23 server), so `train` launches servers for "keep" with
--disable-radix-cache (controller/sglang_servers.NO_PREFIX_CACHE); start servers given by URL so too."""
SAMPLING_SEED_MODULUS = 1 << 63
"""SGLang's sampling_seed is an int64."""
ROUTES_FLAG = "--enable-return-routed-experts"
"""The server flag without which SGLang ignores `return_routed_experts` (srt/arg_groups/fields/exec_.py)."""


# --- /generate: the body --------------------------------------------------------------------


def asks_sampling_mask(params: SamplingParams) -> bool:
    """Whether a request with `params` asks for `return_sampling_mask`: top-p or top-k truncate the
    support, so the behaviour log-prob is the renormalised one (answers.py)."""
    return not params.greedy and (params.top_p < 1.0 or params.top_k > 0)


def sample_seed(seed: int, index: int) -> int:
    """SGLang `sampling_seed` of sample `index` of a request seeded with `seed`."""
    return mix_seed(seed, index, modulus=SAMPLING_SEED_MODULUS)


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


def generate_payload(prompt_ids: Sequence[int], params: SamplingParams, rids: Sequence[str], seed: int | None = None,
                     *, routes: bool = False) -> dict[str, Any]:
    """The /generate body for `len(rids)` samples of one prompt (`seed` when params.seed is None);
    `routes`: ask for each sample's MoE routes (`meta_info.routed_experts`)."""
    n = len(rids)
    sps = [sampling_params_payload(params, i, seed) for i in range(n)]
    payload: dict[str, Any] = {
        "input_ids": list(prompt_ids) if n == 1 else [list(prompt_ids)] * n,
        "rid": rids[0] if n == 1 else list(rids),
        "sampling_params": sps[0] if n == 1 or "sampling_seed" not in sps[0] else sps,
        "return_logprob": True,
        "stream": False,
    }
    if asks_sampling_mask(params):
        payload["return_sampling_mask"] = True
    if routes:
        payload["return_routed_experts"] = True
    return payload


# --- weight updates: the bodies -------------------------------------------------------------


def init_group_payload(master_address: str, master_port: int, rank_offset: int, world_size: int,
                       group_name: str, backend: str) -> dict[str, Any]:
    """The /init_weights_update_group body: join ranks rank_offset .. + tp_size - 1 of the group."""
    return {
        "master_address": master_address, "master_port": int(master_port), "rank_offset": int(rank_offset),
        "world_size": int(world_size), "group_name": group_name, "backend": backend,
    }


def update_weights_from_tensor_payload(
    serialized_named_tensors: Sequence[str], *, flush_cache: bool, weight_version: str | None,
    load_format: str | None, abort_all_requests: bool,
) -> dict[str, Any]:
    """The /update_weights_from_tensor body of one bucket: one base64 payload per TP rank of the
    server (tensor_payload.serialize_named_tensors; load_format None: SGLang loads [(name, tensor)]
    with the model's own load_weights, as from a checkpoint)."""
    if not serialized_named_tensors or not all(isinstance(s, str) and s for s in serialized_named_tensors):
        raise ValueError("serialized_named_tensors must be one non-empty base64 string per TP rank")
    payload: dict[str, Any] = {
        "serialized_named_tensors": list(serialized_named_tensors), "flush_cache": flush_cache,
        "abort_all_requests": abort_all_requests, "weight_version": weight_version,
    }
    if load_format is not None:
        payload["load_format"] = load_format
    return payload


def update_weights_payload(
    names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]], *, group_name: str,
    flush_cache: bool, weight_version: str | None, load_format: str | None, abort_all_requests: bool,
) -> dict[str, Any]:
    """The /update_weights_from_distributed body of one bucket (load_format None: left out, so an
    older server takes one broadcast per tensor)."""
    if not (len(names) == len(dtypes) == len(shapes)) or not names:
        raise ValueError(f"names, dtypes and shapes must have the same non-zero length, got {len(names)}, {len(dtypes)}, {len(shapes)}")
    payload: dict[str, Any] = {
        "names": list(names), "dtypes": list(dtypes), "shapes": [list(s) for s in shapes],
        "group_name": group_name, "flush_cache": flush_cache, "abort_all_requests": abort_all_requests,
        "weight_version": weight_version,
    }
    if load_format is not None:
        payload["load_format"] = load_format
    return payload
