"""Hermes tool calls: parsing, formatting, and the runner's checks and limits (tasks/tools/calls.py)."""

import json
import time

import pytest

from entr_megatron.tasks.tools import (
    INVALID_CALL, TOOL_CALL_CLOSE, TOOL_CALL_OPEN, TRUNCATION_MARK, UNKNOWN_TOOL, ToolCall, ToolOutcome, ToolRunner,
    format_tool_call, format_tool_responses, parse_tool_calls, tool_schema,
)


class FnTool:
    """A tool around a function, with a fixed schema."""

    def __init__(self, name, fn, properties=None, required=()):
        self.name, self.description, self.fn = name, f"the {name} tool", fn
        self.parameters = {"type": "object", "properties": properties or {}, "required": list(required)}

    def __call__(self, **arguments):
        return self.fn(**arguments)


def echo_tool():
    return FnTool("echo", lambda text, times=1: text * times,
                  {"text": {"type": "string"}, "times": {"type": "integer"}}, required=["text"])


def block(body):
    return f"{TOOL_CALL_OPEN}{body}{TOOL_CALL_CLOSE}"


# --- parse / format ---------------------------------------------------------------------------

def test_parse_one_call_in_qwen3_layout():
    text = 'thinking<tool_call>\n{"name": "search", "arguments": {"query": "velora"}}\n</tool_call>'
    assert parse_tool_calls(text) == [ToolCall("search", {"query": "velora"})]


def test_parse_several_calls_in_order_and_missing_arguments():
    text = block('{"name":"a","arguments":{"x":1}}') + " between " + block('{"name":"b"}')
    assert parse_tool_calls(text) == [ToolCall("a", {"x": 1}), ToolCall("b", {})]


def test_parse_no_call():
    assert parse_tool_calls("just an answer") == []
    assert parse_tool_calls("stray </tool_call> close") == []


@pytest.mark.parametrize("body, words", [
    ('{"name": "a", "arguments": {', "not valid JSON"),
    ('["a", {}]', "JSON object, got list"),
    ('"search"', "JSON object, got str"),
    ('{"arguments": {}}', '"name"'),
    ('{"name": 3, "arguments": {}}', '"name"'),
    ('{"name": "a", "arguments": "query=x"}', '"arguments"'),
    ('{"name": "a", "arguments": [1]}', "got list"),
])
def test_parse_bad_blocks_are_error_messages(body, words):
    (out,) = parse_tool_calls(block(body))
    assert isinstance(out, str) and words in out


def test_parse_unclosed_blocks():
    (tail,) = parse_tool_calls('<tool_call>{"name":"a","arguments":{}}')
    assert isinstance(tail, str) and "the end" in tail
    # An open left by the next open is an error, and the next block still parses.
    first, second = parse_tool_calls('<tool_call>{"name":"a"' + block('{"name":"b"}'))
    assert isinstance(first, str) and "next" in first
    assert second == ToolCall("b", {})


def test_format_is_compact_and_round_trips():
    call = ToolCall("search", {"query": "velora dunmore", "k": 2, "exact": True})
    text = format_tool_call(call)
    assert text == '<tool_call>{"name":"search","arguments":{"query":"velora dunmore","k":2,"exact":true}}</tool_call>'
    assert parse_tool_calls(text + text) == [call, call]


def test_format_tool_responses():
    ok, bad = ToolOutcome("search", "d1 x", None, 0.0), ToolOutcome("open", "", "LookupError: no", 0.0)
    assert format_tool_responses([ok, bad]) == (
        "<tool_response>d1 x</tool_response><tool_response>error: LookupError: no</tool_response>"
    )
    assert format_tool_responses([]) == ""


def test_tool_schema_is_what_chat_templates_take():
    tool = echo_tool()
    schema = tool_schema(tool)
    assert schema == {"type": "function", "function": {
        "name": "echo", "description": "the echo tool", "parameters": tool.parameters}}
    json.dumps(schema)  # serialisable, as a chat template needs


# --- runner -----------------------------------------------------------------------------------

def test_runner_runs_a_valid_call():
    out = ToolRunner([echo_tool()]).run(ToolCall("echo", {"text": "ab", "times": 2}))
    assert (out.name, out.text, out.error) == ("echo", "abab", None)
    assert out.seconds >= 0


def test_runner_reports_a_parse_error():
    out = ToolRunner([echo_tool()]).run("tool call is not valid JSON")
    assert (out.name, out.text, out.error) == (INVALID_CALL, "", "tool call is not valid JSON")


def test_runner_unknown_tool_lists_the_known_ones():
    out = ToolRunner([echo_tool(), FnTool("zap", lambda: "z")]).run(ToolCall("browse", {}))
    assert out.name == UNKNOWN_TOOL and "browse" in out.error and "echo" in out.error and "zap" in out.error


@pytest.mark.parametrize("arguments, words", [
    ({}, "'text'"),                                # required missing
    ({"text": "a", "colour": "red"}, "'colour'"),  # unknown key
    ({"text": 3}, "'text'"),                       # wrong type
    ({"text": "a", "times": "2"}, "'times'"),
    ({"text": "a", "times": 2.5}, "'times'"),
    ({"text": "a", "times": True}, "'times'"),     # a bool is no JSON integer
])
def test_runner_checks_arguments_against_the_schema(arguments, words):
    calls = []
    tool = FnTool("echo", lambda **kw: calls.append(kw) or "ran",
                  {"text": {"type": "string"}, "times": {"type": "integer"}}, required=["text"])
    out = ToolRunner([tool]).run(ToolCall("echo", arguments))
    assert out.error is not None and words in out.error and out.text == ""
    assert calls == []  # never called with bad arguments


def test_runner_number_and_boolean_types():
    tool = FnTool("f", lambda x, flag: f"{x} {flag}", {"x": {"type": "number"}, "flag": {"type": "boolean"}})
    runner = ToolRunner([tool])
    assert runner.run(ToolCall("f", {"x": 1, "flag": False})).text == "1 False"
    assert runner.run(ToolCall("f", {"x": 1.5, "flag": True})).text == "1.5 True"
    assert runner.run(ToolCall("f", {"x": 1, "flag": 1})).error is not None


def test_runner_turns_an_exception_into_an_error():
    def boom(**_):
        raise KeyError("no such page")

    out = ToolRunner([FnTool("boom", boom)]).run(ToolCall("boom", {}))
    assert out.error == "KeyError: 'no such page'" and "Traceback" not in out.error and out.text == ""


def test_runner_abandons_a_tool_past_its_timeout():
    tool = FnTool("slow", lambda: time.sleep(5.0) or "late")
    t0 = time.perf_counter()
    out = ToolRunner([tool], timeout_s=0.2).run(ToolCall("slow", {}))
    took = time.perf_counter() - t0
    assert out.error == "timed out after 0.2 s" and out.text == ""
    assert 0.2 <= took < 1.5 and 0.2 <= out.seconds < 1.5


def test_runner_truncates_long_output():
    tool = FnTool("flood", lambda: "x" * 100_000)
    out = ToolRunner([tool], max_output_chars=50).run(ToolCall("flood", {}))
    assert out.error is None and out.text == "x" * 50 + TRUNCATION_MARK
    short = ToolRunner([FnTool("s", lambda: "y" * 50)], max_output_chars=50).run(ToolCall("s", {}))
    assert short.text == "y" * 50


def test_runner_refuses_a_non_str_return():
    out = ToolRunner([FnTool("num", lambda: 42)]).run(ToolCall("num", {}))
    assert out.error is not None and "int" in out.error and out.text == ""


@pytest.mark.parametrize("kwargs", [{"timeout_s": 0}, {"timeout_s": float("inf")}, {"max_output_chars": 0}])
def test_runner_validates_its_limits(kwargs):
    with pytest.raises(ValueError):
        ToolRunner([echo_tool()], **kwargs)


def test_runner_refuses_two_tools_with_one_name():
    with pytest.raises(ValueError, match="echo"):
        ToolRunner([echo_tool(), echo_tool()])
