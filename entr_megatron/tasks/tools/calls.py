"""Tool calls in the Hermes / Qwen3 format: parse them, run them under limits, format the results.

    calls = parse_tool_calls('<tool_call>{"name":"search","arguments":{"query":"velora"}}</tool_call>')
    runner = ToolRunner([search_tool], timeout_s=5.0, max_output_chars=400)
    outcomes = [runner.run(c) for c in calls]          # never raises
    format_tool_responses(outcomes)                   # '<tool_response>d17 velora: ...</tool_response>'

The markers are those HF `apply_chat_template(tools=[tool_schema(t), ...])` renders for
Qwen3: a call is `<tool_call>` + a JSON object {"name", "arguments"} + `</tool_call>`, a
result is `<tool_response>` + text + `</tool_response>`. Qwen3's template puts newlines
around the JSON; `format_tool_call` writes it compact (sequences of the tiny tasks are
tokenized by character) and `parse_tool_calls` accepts both.

A policy writes anything, so nothing here trusts it: a malformed call, an unknown tool,
bad arguments, a tool that raises, hangs or floods all become a `ToolOutcome` with an
`error`, which the environment shows the policy as `<tool_response>error: ...</tool_response>`.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "INVALID_CALL", "TOOL_CALL_CLOSE", "TOOL_CALL_OPEN", "TOOL_RESPONSE_CLOSE", "TOOL_RESPONSE_OPEN",
    "TOOL_TOKENS", "TRUNCATION_MARK", "UNKNOWN_TOOL", "Tool", "ToolCall", "ToolOutcome", "ToolRunner",
    "format_tool_call", "format_tool_responses", "parse_tool_calls", "tool_schema",
]

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
TOOL_TOKENS = (TOOL_CALL_OPEN, TOOL_CALL_CLOSE, TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE)
"""The markers a tokenizer must hold as single tokens (the engine stops a turn on `</tool_call>`)."""
TRUNCATION_MARK = " ...[truncated]"
INVALID_CALL = "invalid"
"""`ToolOutcome.name` of a call that did not parse."""
UNKNOWN_TOOL = "unknown"
"""`ToolOutcome.name` of a call to a tool the runner lacks: the policy's made-up names stay out of
per-tool metric keys (the name is in the error text)."""

_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
    "object": (dict,), "array": (list,),
}


@dataclass(frozen=True)
class ToolCall:
    """One call as the policy wrote it."""

    name: str
    arguments: dict[str, Any]


@runtime_checkable
class Tool(Protocol):
    """A function the policy may call: a name, what it does, and a JSON Schema of its arguments."""

    name: str
    description: str
    parameters: dict
    """JSON Schema of the arguments object: {"type": "object", "properties": {...}, "required": [...]}."""

    def __call__(self, **arguments: Any) -> str:
        """The tool's answer as text; raise for a request it cannot serve (the runner reports it)."""
        ...


def tool_schema(tool: Tool) -> dict:
    """The entry HF `apply_chat_template(tools=[...])` takes for `tool`."""
    return {
        "type": "function",
        "function": {"name": tool.name, "description": tool.description, "parameters": tool.parameters},
    }


def _parse_body(body: str) -> ToolCall | str:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return f"tool call is not valid JSON ({e.msg} at char {e.pos})"
    if not isinstance(obj, dict):
        return f"tool call must be a JSON object, got {type(obj).__name__}"
    name = obj.get("name")
    if not isinstance(name, str):
        return 'tool call needs a string "name"'
    arguments = obj.get("arguments", {})
    if not isinstance(arguments, dict):
        return f'"arguments" of the call to {name!r} must be a JSON object, got {type(arguments).__name__}'
    return ToolCall(name, arguments)


def parse_tool_calls(text: str) -> list[ToolCall | str]:
    """Every `<tool_call>...</tool_call>` block of `text` in order: a `ToolCall`, or an error
    message (str) for a block whose body is not a JSON object with a string "name" and an
    object "arguments" (missing arguments mean {}). A block left open (at the end, or by the
    next `<tool_call>`) is an error too. Text outside blocks is ignored."""
    out: list[ToolCall | str] = []
    start = text.find(TOOL_CALL_OPEN)
    while start != -1:
        body_start = start + len(TOOL_CALL_OPEN)
        close = text.find(TOOL_CALL_CLOSE, body_start)
        reopen = text.find(TOOL_CALL_OPEN, body_start)
        if close == -1 or -1 < reopen < close:
            where = "the next " + TOOL_CALL_OPEN if close != -1 or reopen != -1 else "the end"
            out.append(f"{TOOL_CALL_OPEN} without {TOOL_CALL_CLOSE} before {where}")
            start = reopen
            continue
        out.append(_parse_body(text[body_start:close].strip()))
        start = text.find(TOOL_CALL_OPEN, close + len(TOOL_CALL_CLOSE))
    return out


def format_tool_call(call: ToolCall) -> str:
    """The call as the policy writes it, compact: `<tool_call>{"name":"x","arguments":{...}}</tool_call>`."""
    body = json.dumps({"name": call.name, "arguments": call.arguments}, separators=(",", ":"), ensure_ascii=False)
    return f"{TOOL_CALL_OPEN}{body}{TOOL_CALL_CLOSE}"


@dataclass(frozen=True)
class ToolOutcome:
    """What running one call gave: the tool's text, or an error (then `text` is "")."""

    name: str
    """The tool called; `INVALID_CALL` for a call that did not parse, `UNKNOWN_TOOL` for a name no tool has."""
    text: str
    error: str | None
    seconds: float
    """Wall time of the call (up to the timeout when the tool hung)."""


def format_tool_responses(outcomes: Sequence[ToolOutcome]) -> str:
    """One `<tool_response>...</tool_response>` per outcome, in order; an error reads "error: ..."."""
    return "".join(
        f"{TOOL_RESPONSE_OPEN}{o.text if o.error is None else 'error: ' + o.error}{TOOL_RESPONSE_CLOSE}"
        for o in outcomes
    )


def _argument_error(tool: Tool, arguments: dict[str, Any]) -> str | None:
    """What is wrong with `arguments` under the tool's schema (required, unknown keys, JSON types)."""
    schema = tool.parameters or {}
    properties = schema.get("properties", {})
    for key in schema.get("required", ()):
        if key not in arguments:
            return f"{tool.name!r} needs the argument {key!r}"
    for key, value in arguments.items():
        if key not in properties:
            return f"{tool.name!r} has no argument {key!r} (it takes {sorted(properties)})"
        kind = properties[key].get("type")
        types = _JSON_TYPES.get(kind) if isinstance(kind, str) else None
        # bool is an int in Python, never in JSON Schema.
        if types is not None and (not isinstance(value, types) or (isinstance(value, bool) and kind != "boolean")):
            return f"argument {key!r} of {tool.name!r} must be a {kind}, got {type(value).__name__}"
    return None


def _limit(text: str, max_chars: int) -> str:
    return text if len(text) <= max_chars else text[:max_chars] + TRUNCATION_MARK


class ToolRunner:
    """Runs calls against a fixed set of tools, never raising: every failure is an error outcome.

    timeout_s: each call runs in a daemon worker thread, abandoned (not killed: Python cannot
    kill a thread) after this long; a tool that may hang for good or must be stopped belongs in
    a subprocess (the sandboxed python tool, `tasks/tools/sandbox.py`). max_output_chars: a
    longer answer (or error message) keeps its first max_output_chars characters, then
    `TRUNCATION_MARK`. Holds no per-episode state: one runner may serve every environment.
    """

    def __init__(self, tools: Sequence[Tool], *, timeout_s: float = 5.0, max_output_chars: int = 1000):
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < math.inf:
            raise ValueError(f"timeout_s must be a finite number > 0, got {timeout_s!r}")
        if not isinstance(max_output_chars, int) or isinstance(max_output_chars, bool) or max_output_chars < 1:
            raise ValueError(f"max_output_chars must be an int >= 1, got {max_output_chars!r}")
        self.tools: dict[str, Tool] = {}
        for tool in tools:
            if not isinstance(tool, Tool):
                raise ValueError(f"{tool!r} is not a Tool (name, description, parameters, __call__)")
            if tool.name in self.tools:
                raise ValueError(f"two tools are named {tool.name!r}")
            self.tools[tool.name] = tool
        self.timeout_s, self.max_output_chars = float(timeout_s), max_output_chars

    def run(self, call: ToolCall | str) -> ToolOutcome:
        """The outcome of one parsed call (a str is a parse error from `parse_tool_calls`)."""
        t0 = time.perf_counter()

        def fail(name: str, error: str) -> ToolOutcome:
            return ToolOutcome(name, "", _limit(error, self.max_output_chars), time.perf_counter() - t0)

        if isinstance(call, str):
            return fail(INVALID_CALL, call)
        tool = self.tools.get(call.name)
        if tool is None:
            return fail(UNKNOWN_TOOL, f"no tool named {call.name!r} (the tools are {sorted(self.tools)})")
        bad = _argument_error(tool, call.arguments)
        if bad is not None:
            return fail(tool.name, bad)
        done: list[tuple[bool, Any]] = []

        def work() -> None:
            try:
                done.append((True, tool(**call.arguments)))
            except BaseException as e:  # noqa: BLE001 - the tool's failure is the policy's observation
                message = str(e)
                done.append((False, f"{type(e).__name__}: {message}" if message else type(e).__name__))

        worker = threading.Thread(target=work, name=f"tool-{tool.name}", daemon=True)
        worker.start()
        worker.join(self.timeout_s)
        if not done:
            return fail(tool.name, f"timed out after {self.timeout_s:g} s")
        ok, value = done[0]
        if not ok:
            return fail(tool.name, value)
        if not isinstance(value, str):
            return fail(tool.name, f"tool {tool.name!r} returned {type(value).__name__}, not str")
        return ToolOutcome(tool.name, _limit(value, self.max_output_chars), None, time.perf_counter() - t0)
