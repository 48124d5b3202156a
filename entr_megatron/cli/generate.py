"""`entr-megatron generate`: samples from a rollout engine, with the log-probs ENTR needs.

    entr-megatron generate --model HF_DIR --input prompts.jsonl --output samples.jsonl \\
        --temperature 1 --n 4 --seed 0 [--dtype bfloat16] [--engine sglang --tp 2]

Engines: "embedded" (default; HF transformers in its own process, CPU or GPU) or
"sglang" (launches `python -m sglang.launch_server` with --tp/--port/--mem-fraction
and --sglang-args="...", or drives running servers given with --sglang-url; --model
is then optional and only supplies the tokenizer and the vocabulary check).

Input: JSONL, one object per line with "input_ids": [token ids] or "prompt": "text"
(tokenized with --model's tokenizer as `tokenizer(prompt)` does: special tokens such
as BOS included, no chat template). A line with both uses "input_ids". Blank lines
are skipped. Every line is checked before the engine starts; errors name the line.

Output: --n lines per input line, in input order and then sample order, each with all
the input's fields plus
  "sample_index":     0 .. n-1
  "prompt_ids":       the tokenized prompt (only for "prompt" lines, and with --emit-score-input)
  "output_ids":       the sampled tokens (a stop/EOS token that ended the sample included)
  "output_text":      their decoding (special tokens skipped), when the model has a tokenizer
  "rollout_logprobs": log q(token) per output token under the distribution it was sampled
                      from: softmax(logits / T) truncated by top-k/top-p; greedy: the model's
                      log softmax(logits) at T = 1, untruncated (as SGLang reports it)
  "entropy":          H(q) per output token (greedy: of that T = 1 softmax), when the engine
                      reports it (SGLang does not)
  "finish_reason":    "stop" (stop/EOS token) or "length" (--max-new-tokens or context)
  "weight_version":   the newest weight version that produced a token; "weight_versions":
                      the version of each output token
Per-sample seeds derive from (--seed, line position, sample index): the same --seed and
input give the same tokens whatever the batching (the log-probs agree to fp32 rounding:
batch shapes change it); SGLang honours seeds only on servers started with
--enable-deterministic-inference. Without --seed one is drawn and printed.

Train-inference mismatch with `score`: score reads the LAST len(rollout_logprobs)
tokens of "input_ids" as the response, so its input must be input_ids = prompt +
output_ids. --emit-score-input writes exactly that ("prompt_ids" keeps the prompt,
and "entropy" becomes "rollout_entropy" so score's own "entropy" does not overwrite it):

    entr-megatron generate --model M --input p.jsonl --output s.jsonl --temperature 1 --emit-score-input
    entr-megatron score --model M --input s.jsonl --output scored.jsonl --temperature 1

(or from plain output: jq -c '.input_ids = (.prompt_ids // .input_ids) + .output_ids',
where score then replaces "entropy" with its own).
Score compares against the full softmax(logits / T): use the same temperature (greedy:
score with --temperature 1) and no top-k/top-p (their log-probs refer to the truncated q).

Progress goes to stderr; the output file appears atomically when every sample is done.
"""

from __future__ import annotations

import argparse

from entr_megatron.config.rollout import ENGINES

__all__ = ["add_parser"]

DTYPES = ("float32", "bfloat16")


def run(args) -> None:
    """Validate everything, generate, write the output atomically (cli/generation.py)."""
    from entr_megatron.cli.generation import run as generate  # lazy: torch, only when the command runs

    generate(args)


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="sample from a rollout engine (embedded or SGLang) with behaviour log-probs",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", metavar="DIR",
                   help="HF model directory (config.json + safetensors, tokenizer for \"prompt\" lines); "
                        "optional with --sglang-url")
    p.add_argument("--input", required=True, metavar="FILE.jsonl",
                   help='lines {"input_ids": [...]} or {"prompt": "..."}')
    p.add_argument("--output", required=True, metavar="FILE.jsonl", help="written atomically when done")
    p.add_argument("--engine", choices=ENGINES, default="embedded", help="default: embedded")
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (default 1)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus truncation, in (0, 1] (default 1: off)")
    p.add_argument("--top-k", type=int, default=-1, help="keep the k most likely tokens (default -1: off)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="default 128")
    p.add_argument("--n", type=int, default=1, help="samples per input line (default 1)")
    p.add_argument("--seed", type=int, default=None, help="default: drawn at random and printed")
    p.add_argument("--stop-token-ids", type=int, nargs="+", default=[], metavar="ID",
                   help="end a sample when one of these is sampled (kept in output_ids); EOS always does")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the model's EOS token(s)")
    p.add_argument("--dtype", choices=DTYPES, default=None,
                   help="engine numerics (default: float32 embedded, the checkpoint's with SGLang)")
    p.add_argument("--emit-score-input", action="store_true",
                   help="input_ids = prompt + output_ids, ready for `entr-megatron score` (see above)")
    p.add_argument("--no-output-text", action="store_true", help="do not decode output_ids into output_text")
    p.add_argument("--max-batch-size", type=int, default=None, help="embedded: samples decoded together (default 32)")
    g = p.add_argument_group("SGLang (--engine sglang)")
    g.add_argument("--sglang-url", nargs="+", metavar="URL", default=None,
                   help="use these running servers instead of launching one")
    g.add_argument("--tp", type=int, default=None, help="tensor-parallel size of the launched server (default 1)")
    g.add_argument("--port", type=int, default=None, help="port of the launched server (default 30000)")
    g.add_argument("--mem-fraction", type=float, default=None, help="--mem-fraction-static of the launched server")
    g.add_argument("--sglang-args", default=None, metavar='"ARGS"',
                   help='more sglang.launch_server flags, one string: --sglang-args="--disable-radix-cache"')
    g.add_argument("--sglang-log-dir", default=None, metavar="DIR", help="server log (default: a new temp dir)")
    g.add_argument("--startup-timeout", type=float, default=1800.0,
                   help="seconds to wait for the launched server (default 1800)")
    p.set_defaults(func=run)
