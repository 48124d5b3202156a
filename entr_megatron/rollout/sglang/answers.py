"""What SGLang answers to /generate (protocol.py: the endpoints and what we send), checked and
read into the per-token fields of a `GenerateResult`.

How an answer becomes a `GenerateResult` (`parse_generate_output`):
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
- Routes (`RouteLayout`, MoE routing replay): with `return_routed_experts` a server launched with
  --enable-return-routed-experts puts `meta_info.routed_experts` in a finished answer: base64 of
  the int32 (native order: little-endian on the GPU hosts) bytes of a C-contiguous
  [P + R - 1, num_hidden_layers, num_experts_per_tok] array (state_capturer/base.py
  `get_topk`: rows [0, seqlen - 1) with seqlen = prompt + output tokens through the stop, i.e.
  every fed token; tokenizer_manager.py / detokenizer_manager.py encode it). The layer axis is
  every decoder layer by global layer id (routed_experts.py: num_layers = num_hidden_layers;
  a dense layer's column is never written and reads 0), the ids are logical experts (captured
  in layers/moe/topk.py before the EPLB logical->physical remap), fused shared experts are cut
  off. A server started without the flag leaves the field out; a request aborted while
  queued has none either (an aborted answer may lack it; any other is refused).
- Checks: an answer is refused (`BadAnswer`: the field's path, its value, the rule) for a
  missing field (output_ids may be absent only for a request aborted while queued), a token
  id outside [0, vocab_size), a log-prob that is not finite or above `LOGPROB_SLACK`, a
  log-prob entry whose token is not the output's, per-token lists of other lengths and, when
  asked for, routes missing, not base64, of another size or with an expert id outside
  [0, num_experts).
- Stop tokens stay in `output_ids` (finished_len = matched position + 1). An aborted running request still decodes one
  more step; while paused in place, it ends only after `resume`.
"""

from __future__ import annotations

import base64
import binascii
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypedDict

import numpy as np
import torch

from entr_megatron.rollout.engine import SamplingParams
from entr_megatron.rollout.hf_model import route_dtype
from entr_megatron.rollout.sglang.protocol import ROUTES_FLAG, SGLANG_VERSION, asks_sampling_mask

__all__ = [
    "LOGPROB_SLACK",
    "BadAnswer",
    "ParsedSample",
    "RouteLayout",
    "parse_generate_output",
    "parse_routed_experts",
    "version_number",
]

LOGPROB_SLACK = 1e-4
"""A reported log-prob may exceed 0 by this much (float rounding in log_softmax); more is a broken answer."""


@dataclass(frozen=True)
class RouteLayout:
    """What a server's `meta_info.routed_experts` holds for one model, and which part of it we keep."""

    num_layers: int
    """Decoder layers SGLang reports (HF num_hidden_layers: dense ones included)."""
    top_k: int
    """Experts per token (HF num_experts_per_tok)."""
    num_experts: int
    """Routed experts per MoE layer; every reported id must be below it."""
    moe_layers: tuple[int, ...] | None = None
    """0-based indices of the MoE layers among the num_layers, in order (our routes' moe_layers
    axis); None: every layer is MoE (all the model families we train)."""

    def __post_init__(self):
        for name in ("num_layers", "top_k", "num_experts"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"RouteLayout.{name} must be an integer >= 1, got {value!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"RouteLayout.top_k={self.top_k} must be <= num_experts={self.num_experts}")
        if self.moe_layers is not None and (not self.moe_layers or list(self.moe_layers) != sorted(set(self.moe_layers))
                                            or self.moe_layers[0] < 0 or self.moe_layers[-1] >= self.num_layers):
            raise ValueError(f"RouteLayout.moe_layers must be increasing layer indices in [0, {self.num_layers}), "
                             f"got {self.moe_layers!r}")


class ParsedSample(TypedDict):
    """The per-token fields of a `GenerateResult`, read from one /generate answer."""

    output_ids: list[int]
    logprobs: list[float]
    raw_logprobs: list[float] | None
    entropy: None
    finish_reason: str
    versions: list[int]
    routed_experts: torch.Tensor | None


class BadAnswer(ValueError):
    """A field of an SGLang answer that breaks the protocol: its path in the answer, the bad value
    (shortened) and what was expected, e.g. `meta_info.output_token_logprobs[3][0]=nan is not a
    finite log-prob`."""

    def __init__(self, field: str, value: Any, rule: str):
        super().__init__(field, value, rule)
        self.field, self.value, self.rule = field, value, rule

    def __str__(self) -> str:
        return f"{self.field}={_short(self.value)} {self.rule}"


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def version_number(version: Any, default: int) -> int:
    """Our int of an SGLang version string ("3" -> 3; "default" and the like -> `default`)."""
    try:
        return int(str(version))
    except ValueError:
        return default


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _logprob(x: Any, field: str) -> float:
    """A log-prob of an answer: a finite real number <= LOGPROB_SLACK."""
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        raise BadAnswer(field, x, "is not a finite log-prob")
    if x > LOGPROB_SLACK:
        raise BadAnswer(field, x, "is not a log-prob (> 0)")
    return float(x)


def _token_ids(ids: Any, vocab_size: int | None) -> list[int]:
    if not isinstance(ids, list):
        raise BadAnswer("output_ids", ids, "is not a list of token ids")
    for t, x in enumerate(ids):
        if not _is_int(x) or x < 0 or (vocab_size is not None and x >= vocab_size):
            span = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
            raise BadAnswer(f"output_ids[{t}]", x, f"is not a token id of the vocabulary ({span})")
    return list(ids)


def _token_versions(meta: Mapping[str, Any], num_tokens: int, default: int) -> list[int]:
    spans = meta.get("weight_versions") or []
    if not spans:
        return [version_number(meta.get("weight_version"), default)] * num_tokens
    if not isinstance(spans, list):
        raise BadAnswer("meta_info.weight_versions", spans, "is not a list of {version, start, end} spans")
    for i, span in enumerate(spans):
        if not isinstance(span, Mapping) or "version" not in span or not _is_int(span.get("start")) \
                or not _is_int(span.get("end")):
            raise BadAnswer(f"meta_info.weight_versions[{i}]", span, "is not a {version, start, end} span with int bounds")
    versions = [version_number(spans[0]["version"], default)] * num_tokens
    for span in spans:
        v = version_number(span["version"], default)
        for t in range(max(0, span["start"]), min(num_tokens, span["end"])):
            versions[t] = v
    return versions


def parse_routed_experts(meta: Mapping[str, Any], prompt_len: int, num_output: int, finish_reason: str,
                         layout: RouteLayout) -> torch.Tensor | None:
    """`meta_info.routed_experts` of an answer asked for routes -> our ``[P + R - 1, moe_layers, k]``
    (uint8, int16 above 256 experts; see the module docstring), None for an aborted answer without
    them. Raises `BadAnswer` when they are missing, not base64, of another size than
    (prompt_len + num_output - 1) * num_layers * top_k int32 values, or hold an id outside
    [0, num_experts)."""
    field = "meta_info.routed_experts"
    value = meta.get("routed_experts")
    if value is None:
        if finish_reason == "abort":  # aborted while queued: never prefilled, no routes
            return None
        raise BadAnswer(field, None, f"is missing (return_routed_experts was set): the server ignores it; relaunch it "
                                     f"with {ROUTES_FLAG} (SGLang {SGLANG_VERSION} has it)")
    if not isinstance(value, str):
        raise BadAnswer(field, value, "is not a base64 string")
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise BadAnswer(field, value, "is not base64") from None
    rows = max(0, prompt_len + num_output - 1)
    expected = rows * layout.num_layers * layout.top_k
    if len(raw) != 4 * expected:
        raise BadAnswer(f"len({field})", f"{len(raw)} bytes",
                        f"is not (prompt {prompt_len} + output {num_output} - 1 tokens) * {layout.num_layers} layers * "
                        f"top_k {layout.top_k} = {expected} int32 values ({4 * expected} bytes)")
    ids = np.frombuffer(raw, dtype="<i4").reshape(rows, layout.num_layers, layout.top_k)
    if layout.moe_layers is not None:  # a dense layer's column is never written (zeros)
        ids = ids[:, list(layout.moe_layers), :]
    bad = (ids < 0) | (ids >= layout.num_experts)
    if bad.any():
        t, layer, j = (int(i) for i in np.argwhere(bad)[0])
        raise BadAnswer(f"{field}[{t}][{layer}][{j}]", int(ids[t, layer, j]),
                        f"(decoded [tokens, moe_layers, top_k]) is not an expert id in [0, {layout.num_experts})")
    return torch.from_numpy(ids.astype(np.int16)).to(route_dtype(layout.num_experts))


def parse_generate_output(out: Mapping[str, Any], params: SamplingParams, *, default_version: int,
                          vocab_size: int | None = None, routes: RouteLayout | None = None,
                          prompt_len: int | None = None) -> ParsedSample:
    """One /generate answer -> the per-token fields of a GenerateResult (see the module docstring).
    Raises `BadAnswer` for a missing field, a token id outside [0, vocab_size) (None: >= 0), a
    log-prob that is not finite or above 0, or per-token lists whose lengths differ. With `routes`
    (the request asked for them; needs `prompt_len`) also reads `parse_routed_experts`."""
    if routes is not None and prompt_len is None:
        raise ValueError("parse_generate_output: routes need the prompt's length (prompt_len)")
    if not isinstance(out, Mapping):
        raise BadAnswer("answer", out, "is not a JSON object")
    meta = out.get("meta_info")
    if not isinstance(meta, Mapping):
        raise BadAnswer("meta_info", meta, "is missing or not an object")
    reason = meta.get("finish_reason")
    kind = reason.get("type") if isinstance(reason, Mapping) else None
    if kind not in ("stop", "length", "abort"):
        raise BadAnswer("meta_info.finish_reason", reason, "is not {type: stop | length | abort}")
    if "output_ids" not in out and kind != "abort":  # a request aborted while queued has none
        raise BadAnswer("output_ids", None, "is missing")
    output_ids = _token_ids(out.get("output_ids", []), vocab_size)
    n = len(output_ids)
    entries = meta.get("output_token_logprobs")
    if entries is None and n:
        raise BadAnswer("meta_info.output_token_logprobs", None, f"is missing for {n} output tokens (return_logprob was set)")
    entries = entries or []
    if not isinstance(entries, list):
        raise BadAnswer("meta_info.output_token_logprobs", entries, "is not a list of [logprob, token_id, text] entries")
    if len(entries) != n:
        raise BadAnswer("len(meta_info.output_token_logprobs)", len(entries), f"and len(output_ids)={n} do not match")
    reported = []
    for t, (e, token) in enumerate(zip(entries, output_ids)):
        if not isinstance(e, list) or len(e) < 2:
            raise BadAnswer(f"meta_info.output_token_logprobs[{t}]", e, "is not a [logprob, token_id, text] entry")
        if e[1] != token or not _is_int(e[1]):
            raise BadAnswer(f"meta_info.output_token_logprobs[{t}][1]", e[1], f"is not output_ids[{t}]={token}")
        reported.append(_logprob(e[0], f"meta_info.output_token_logprobs[{t}][0]"))
    raw = reported if params.return_raw_logprobs else None
    if asks_sampling_mask(params):
        sampling = meta.get("output_token_sampling_logprobs")
        if sampling is None:
            if n:
                raise BadAnswer("meta_info.output_token_sampling_logprobs", None,
                                f"is missing: the server ignores return_sampling_mask (SGLang {SGLANG_VERSION} has it)")
            sampling = []
        if not isinstance(sampling, list):
            raise BadAnswer("meta_info.output_token_sampling_logprobs", sampling, "is not a list of log-probs")
        if len(sampling) != n:
            raise BadAnswer("len(meta_info.output_token_sampling_logprobs)", len(sampling),
                            f"and len(output_ids)={n} do not match")
        logprobs = [_logprob(x, f"meta_info.output_token_sampling_logprobs[{t}]") for t, x in enumerate(sampling)]
    else:
        logprobs = reported
    return ParsedSample(
        output_ids=output_ids, logprobs=logprobs, raw_logprobs=raw, entropy=None, finish_reason=kind,
        versions=_token_versions(meta, n, default_version),
        routed_experts=None if routes is None else parse_routed_experts(meta, prompt_len, n, kind, routes),
    )
