"""Bad tool input inside a training episode: every case becomes an observation, the episode goes on.

A scripted policy writes one turn per tool response it has seen (the real search task's tokenizer,
tools and ToolEnv, the sandboxed python tool on): a good search, malformed JSON, an unknown tool,
an infinite loop, a read and a write outside the sandbox, a flood of output, a fork bomb, a bad
document id, then the answer. The episode must end normally with every observation saying what
went wrong, and nothing may escape (the file outside the sandbox does not exist afterwards).
"""

import pytest

pytest.importorskip("bm25s")

from entr_megatron.rollout.engine import EngineHealth, GenerateRequest, GenerateResult, SamplingParams, generate  # noqa: E402
from entr_megatron.rollout.episodes import EpisodeBudgets, EpisodeEngine, episode_metrics  # noqa: E402
from entr_megatron.tasks.search import SearchTask  # noqa: E402
from entr_megatron.tasks.tools import TOOL_RESPONSE_CLOSE, TRUNCATION_MARK  # noqa: E402


def call(name, **arguments):
    import json

    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}, separators=(",", ":")) + "</tool_call>"


class TextPolicy:
    """Turn k of every episode is turns[k], k = the tool responses already in the prompt."""

    def __init__(self, tokenizer, turns):
        self.tok, self.turns, self.queue, self.version = tokenizer, turns, [], 0
        self.close = tokenizer.convert_tokens_to_ids(TOOL_RESPONSE_CLOSE)

    def submit(self, requests):
        for req in requests:
            text = self.turns[req.prompt_ids.count(self.close)]
            out = self.tok.encode(text, add_special_tokens=False)
            self.queue.append(GenerateResult(req.request_id, 0, req.prompt_ids, out, [-0.5] * len(out),
                                             [self.version] * len(out), "stop", entropy=[1.0] * len(out)))
        return [r.request_id for r in requests]

    def poll(self, timeout=0.0):
        out, self.queue = self.queue, []
        return out

    def health(self):
        return EngineHealth(alive=True, weight_version=self.version)

    @property
    def weight_version(self):
        return self.version

    def abort(self, ids): ...
    def pause(self): ...
    def resume(self): ...
    def update_weights(self, weights, version): raise NotImplementedError
    def shutdown(self): ...


def test_every_bad_tool_input_becomes_an_observation_and_nothing_escapes(tmp_path):
    # 8 s of wall time: at 3 s a sandboxed interpreter started on 2 busy cores was once killed before it
    # could read /etc/passwd (the full suite, 2026-12-06), which says nothing about escaping
    task = SearchTask(num_entities=16, python_tool=True, tool_timeout_s=8.0, max_tool_output_chars=300)
    problem = task.problems("train", 1, seed=0)[0]
    outside = tmp_path / "escaped.txt"
    turns = [
        call("search", query=problem.chain[0]),
        '<tool_call>{"name":"search","arguments":{"query":</tool_call>',   # malformed JSON
        call("shell", command="rm"),                                        # unknown tool
        call("search", q="x"),                                              # wrong argument
        call("python", code="while True: pass"),                            # infinite loop
        call("python", code="print(open('/etc/passwd').read())"),           # read outside
        call("python", code=f"open('{outside}','w').write('x')"),           # write outside
        call("python", code="print('x'*10000000)"),                         # output flood
        call("python", code="import os\nwhile True: os.fork()"),            # fork bomb
        call("open", doc_id="d999"),                                        # no such document
        problem.answer + "</s>",
    ]
    engine = EpisodeEngine(TextPolicy(task.tokenizer, turns), task.new_environment,
                           EpisodeBudgets(max_turns=len(turns), max_response_tokens=4000))
    (r,) = generate(engine, [GenerateRequest(task.prompts("train", 1, 0)[0][0], SamplingParams(max_new_tokens=2000))],
                    timeout_s=60)
    engine.close()
    text = task.tokenizer.decode(r.output_ids, skip_special_tokens=False)
    responses = [part.split("<tool_response>")[-1] for part in text.split(TOOL_RESPONSE_CLOSE)[:-1]]
    assert len(responses) == len(turns) - 1 and r.finish_reason == "stop" and r.episode["turns"] == len(turns)
    doc = task.corpus.document_of(problem.chain[0])
    assert responses[0].startswith(f"{doc.doc_id} {doc.text}")
    assert responses[1].startswith("error:") and "json" in responses[1].lower()
    assert responses[2].startswith("error:") and "shell" in responses[2] and "search" in responses[2]
    assert responses[3].startswith("error:") and "q" in responses[3]
    assert "killed: cpu_time" in responses[4] or "killed: wall_time" in responses[4]
    assert "root:" not in responses[5] and "Error" in responses[5]
    assert "Error" in responses[6] and not outside.exists()
    assert len(responses[7]) <= 300 + len(TRUNCATION_MARK) and TRUNCATION_MARK in responses[7]
    assert "Error" in responses[8] or "killed" in responses[8]
    assert responses[9].startswith("error:") and "d999" in responses[9]
    assert task.reward(r.to_sample(), problem.answer) == 1.0
    m = episode_metrics([r.to_sample()])
    assert m["agent/tool_calls/python"] == 5 and m["agent/tool_calls/search"] == 2 and m["agent/tool_calls/open"] == 1
    assert m["agent/tool_errors/invalid"] == 1 and m["agent/tool_errors/unknown"] == 1
    assert m["agent/tool_errors/search"] == 1 and m["agent/tool_errors/open"] == 1
