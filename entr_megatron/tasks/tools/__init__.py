"""Tools a policy calls during an episode, in the Hermes / Qwen3 tool-call format.

- `calls.py`: the markers, `ToolCall` / `Tool` / `tool_schema`, `parse_tool_calls`,
  `format_tool_call`, and `ToolRunner` (argument checks, time and output limits; never
  raises) with `format_tool_responses`;
- `sandbox.py` (imported on use): `PythonTool`, Python code run in a sandboxed process with
  CPU-time, memory, output and wall-clock limits, no network and no files outside a scratch
  directory (`PythonSandbox`, `SandboxLimits`; what is and is not contained: its docstring);
  its child runs `sandbox_launcher.py` (namespaces, a private root, rlimits) then
  `sandbox_guard.py` (an audit hook, the code), both as scripts (`sandbox.py` imports them only for their source and constants).

The environment that drives them is `tasks.tool_env.ToolEnv`; the search task
(`tasks.search`) brings a `search` and an `open` tool.
"""

from entr_megatron.tasks.tools.calls import (
    INVALID_CALL, TOOL_CALL_CLOSE, TOOL_CALL_OPEN, TOOL_RESPONSE_CLOSE, TOOL_RESPONSE_OPEN, TOOL_TOKENS,
    TRUNCATION_MARK, UNKNOWN_TOOL, Tool, ToolCall, ToolOutcome, ToolRunner, format_tool_call,
    format_tool_responses, parse_tool_calls, tool_schema,
)

__all__ = [
    "INVALID_CALL", "TOOL_CALL_CLOSE", "TOOL_CALL_OPEN", "TOOL_RESPONSE_CLOSE", "TOOL_RESPONSE_OPEN",
    "TOOL_TOKENS", "TRUNCATION_MARK", "UNKNOWN_TOOL", "Tool", "ToolCall", "ToolOutcome", "ToolRunner",
    "format_tool_call", "format_tool_responses", "parse_tool_calls", "tool_schema",
]
