"""Answers of a real SGLang 0.5.23 server, recorded (sglang_answers_0.5.23.json), and how two
exchanges are compared: the live server against the recording (tests/sglang_real), the mock
against the recording (test_sglang_mock_replay.py), so that the mock cannot drift from the server.

An exchange is {method, path, request, status, answer}. Two agree when their statuses are equal,
their answers have the same shape (`shape`: the same keys, and the same types down to every
leaf; a list whose items share one shape is that shape once) and the same fixed texts
(`FIXED_KEYS` exactly; "message" and text answers with their numbers blanked, since they name
versions, ports and counts). Values that depend on sampling (token ids, log-probs, times) are
compared by type only.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

ANSWERS_PATH = Path(__file__).resolve().parent / "sglang_answers_0.5.23.json"
FIXED_KEYS = frozenset({"success", "status", "object", "type", "code", "finish_reason"})
"""Dict keys whose values must be equal (finish_reason: its "type" and message)."""
VARYING = frozenset({"id", "e2e_latency", "queue_time", "prefill_launch_delay", "prefill_launch_latency",
                     "prefill_finished_ts", "response_sent_to_client_ts", "request_received_ts", "decode_throughput",
                     "inference_time", "last_token_latency", "first_token_latency"})
"""Keys whose values are numbers of this run (compared by type: int and float alike)."""


def shape(value: Any, key: str | None = None) -> Any:
    """The structure of a JSON value with its leaves replaced by their type names."""
    if isinstance(value, dict):
        return {k: shape(v, k) for k, v in sorted(value.items())}
    if isinstance(value, list):
        items = [shape(v) for v in value]
        if items and all(i == items[0] for i in items):
            return ["*", items[0]]
        return items
    if key in VARYING and isinstance(value, (int, float)) and not isinstance(value, bool):
        return "number"
    return {bool: "bool", int: "int", float: "float", str: "str", type(None): "null"}.get(type(value), type(value).__name__)


def blank_numbers(text: str) -> str:
    return re.sub(r"\d+", "N", text)


def fixed(value: Any, key: str | None = None) -> Any:
    """The parts of a value that must be equal: FIXED_KEYS' values, messages and texts with numbers blanked."""
    if isinstance(value, dict):
        out = {}
        for k, v in sorted(value.items()):
            if k in FIXED_KEYS:
                out[k] = blank_numbers(str(v)) if isinstance(v, (str, dict)) else v
            elif k == "message" and isinstance(v, str):
                out[k] = blank_numbers(v)
            elif isinstance(v, (dict, list)):
                inner = fixed(v, k)
                if inner:
                    out[k] = inner
        return out
    if isinstance(value, list):
        inner = [fixed(v) for v in value]
        return inner if any(inner) else []
    if isinstance(value, str) and key is None:
        return blank_numbers(value)
    return None


def compare_exchange(expected: dict, got: dict) -> list[str]:
    """What differs between two exchanges of one request (empty: they agree)."""
    problems = []
    if expected["status"] != got["status"]:
        problems.append(f"status {got['status']} != {expected['status']}")
    a, b = shape(expected["answer"]), shape(got["answer"])
    if a != b:
        problems.append(f"answer shape {b} != {a}")
    fa, fb = fixed(expected["answer"]), fixed(got["answer"])
    if fa != fb:
        problems.append(f"answer texts {fb} != {fa}")
    return problems
