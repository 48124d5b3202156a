"""One request's /generate call with its answer checked (`call_generate`), and which failures the
engine sends again (`retryable`).

A failed call is one of: an HTTP error (a status), no usable answer (no connection, no answer in
time, a body cut off: `SGLangError.transient`), or an answer we cannot use (not JSON, no
meta_info, a field failing `answers.parse_generate_output`: status None). The engine sends a
request again (`SGLangEngine`, at most `SGLangEngineConfig.retries` times, waiting `retry_backoff_s`
and twice as long each time) after any of these but a 4xx answer, which says that the request
itself is wrong and would be refused again. Each attempt has fresh rids (`attempt_rids`), and the
rids of the failed one are aborted first: the server may still run them (a timeout), and a rid
sent twice is refused while the first runs. A retried request is a new sample from the same
seed: nothing of the failed attempt was kept, so nothing is lost or counted twice.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from entr_megatron.rollout.engine import GenerateRequest
from entr_megatron.rollout.sglang.answers import BadAnswer, ParsedSample, parse_generate_output
from entr_megatron.rollout.sglang.client import SGLangClient, SGLangError
from entr_megatron.rollout.sglang.engine_config import SGLangEngineConfig
from entr_megatron.rollout.sglang.protocol import generate_payload, sample_rids

__all__ = ["attempt_rids", "call_generate", "retryable"]


def attempt_rids(request_id: str, n: int, attempt: int) -> list[str]:
    """The rids of attempt `attempt` (0: the first) of a request's n samples."""
    rids = sample_rids(request_id, n)
    return rids if attempt == 0 else [f"{rid}.r{attempt}" for rid in rids]


def retryable(error: SGLangError) -> bool:
    """Whether the same request may succeed when sent again (module docstring): all but 4xx answers."""
    return error.status is None or error.status >= 500 or error.transient


def call_generate(client: SGLangClient, request: GenerateRequest, rids: Sequence[str], seed: int,
                  config: SGLangEngineConfig) -> list[ParsedSample]:
    """POST /generate for `rids` (one per sample of `request`), each answer checked and parsed;
    raises SGLangError naming the server, the request, the sample and what is wrong."""
    r = request
    payload = generate_payload(r.prompt_ids, r.params, rids, seed=seed, routes=config.routes is not None)
    outs = client.generate(payload, timeout=config.generate_timeout_s)
    url = client.url + "/generate"
    by_rid = {o["meta_info"].get("id"): o for o in outs}
    if set(by_rid) == set(rids):
        outs = [by_rid[rid] for rid in rids]
    if len(outs) != len(rids):
        raise SGLangError(f"unusable /generate answer from {url} for request {r.request_id}: {len(outs)} answers for "
                          f"{len(rids)} samples", url=url, body=json.dumps(outs)[:4000])
    parsed = []
    for i, (rid, o) in enumerate(zip(rids, outs)):
        try:
            parsed.append(parse_generate_output(o, r.params, default_version=config.initial_version,
                                                vocab_size=config.vocab_size, routes=config.routes,
                                                prompt_len=len(r.prompt_ids)))
        except (BadAnswer, ValueError, KeyError, TypeError, IndexError) as e:
            what = str(e) if isinstance(e, BadAnswer) else f"{type(e).__name__}: {e}"
            raise SGLangError(f"unusable /generate answer from {url} for request {r.request_id} (sample {i} of "
                              f"{len(outs)}, rid {rid}): {what}", url=url, body=json.dumps(o)[:4000]) from e
    return parsed
