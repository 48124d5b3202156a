"""The environment of a Hermes-format tool task: each turn that ends in `</tool_call>` runs its calls.

    env = ToolEnv(tokenizer, ToolRunner([search, open_doc]))
    policy:  q: home of founder of velora?<tool_call>{"name":"search","arguments":{"query":"velora"}}</tool_call>
    env:     <tool_response>d17 velora: founder marek, base tarnis.</tool_response>      # loss mask False
    policy:  ...more calls... dunmore</s>                                             # done; the task scores it

A turn ending with the `</tool_call>` token is a call turn: its calls are parsed
(`tasks.tools.parse_tool_calls`) and run by the `ToolRunner`; the observation is one
`<tool_response>...</tool_response>` per call, errors included (`error: ...`), so a
malformed call costs the policy a turn, never the episode. Any other turn (EOS, token
budget) ends the episode with reward 0: the task's `reward` scores the whole response.
"""

from __future__ import annotations

from typing import Any

from entr_megatron.tasks.base import single_token_id
from entr_megatron.tasks.environment import Step
from entr_megatron.tasks.tools.calls import (
    TOOL_CALL_CLOSE, TOOL_CALL_OPEN, TOOL_RESPONSE_CLOSE, TOOL_RESPONSE_OPEN, TOOL_TOKENS, ToolRunner,
    format_tool_responses, parse_tool_calls,
)

__all__ = ["ToolEnv", "marker_token_id"]


def marker_token_id(tokenizer: Any, marker: str) -> int:
    """The id of the Hermes `marker`, which must be one token of `tokenizer` (Qwen3 tokenizers and
    build_char_tokenizer(tool_tokens=tasks.tools.TOOL_TOKENS) have them)."""
    return single_token_id(tokenizer, marker, "tool calls", TOOL_TOKENS)


class ToolEnv:
    """One episode with a set of tools (implements `environment.Environment`).

    Holds nothing but the tokenizer and the runner: no history, no call count. Each step
    depends on that turn's ids alone, so an episode paused and continued later may use a
    fresh `ToolEnv` (or one shared by many episodes) and behave exactly the same.
    """

    def __init__(self, tokenizer: Any, runner: ToolRunner):
        self.tokenizer, self.runner = tokenizer, runner
        self.close_id = marker_token_id(tokenizer, TOOL_CALL_CLOSE)
        for marker in (TOOL_CALL_OPEN, TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE):
            marker_token_id(tokenizer, marker)
        self.stop_token_ids = (self.close_id,)
        marker_ids = {marker_token_id(tokenizer, m) for m in TOOL_TOKENS}
        # A tool's text that spells a special token ("</s>", "<|im_end|>") must not become one.
        self._special_ids = frozenset(tokenizer.all_special_ids) - marker_ids

    def reset(self, prompt_ids: list[int], reference: Any) -> list[int]:
        """The initial observation: the prompt itself."""
        return list(prompt_ids)

    def step(self, generated_ids: list[int]) -> Step:
        """Runs the calls of a turn ending in `</tool_call>`; any other turn ends the episode."""
        if not generated_ids or generated_ids[-1] != self.close_id:
            return Step([], True, 0.0, ())
        text = self.tokenizer.decode(generated_ids, skip_special_tokens=True)
        calls = parse_tool_calls(text) or [f"{TOOL_CALL_CLOSE} without a {TOOL_CALL_OPEN} before it"]
        outcomes = tuple(self.runner.run(c) for c in calls)
        return Step(self.encode_observation(format_tool_responses(outcomes)), False, 0.0, outcomes)

    def encode_observation(self, text: str) -> list[int]:
        """Token ids of the tool responses; special tokens a tool's text spelled out become <unk>
        (dropped when the tokenizer has none), so an observation never holds an EOS."""
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        unk = self.tokenizer.unk_token_id
        return [t if t not in self._special_ids else unk for t in ids if t not in self._special_ids or unk is not None]
