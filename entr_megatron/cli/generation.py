"""What `entr-megatron generate` runs (the command, its flags, input and output: cli/generate.py): every
input line checked and tokenized, the engine opened (embedded, or SGLang launched or given by URL),
the samples written in input order, atomically.

    run(build_parser().parse_args(["generate", "--model", M, "--input", I, "--output", O, "--seed", "0"]))
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import secrets
import shlex
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from entr_megatron.checkpoint.model_inputs import check_model_dir, tokenizer_problem
from entr_megatron.rollout.embedded import EmbeddedEngine, EmbeddedEngineConfig
from entr_megatron.rollout.engine import GenerateRequest, GenerateResult, RolloutEngine, SamplingParams
from entr_megatron.rollout.hf_model import has_weights
from entr_megatron.rollout.sglang import SGLangEngine, SGLangEngineConfig, SGLangServerConfig, launch_servers, terminate_all
from entr_megatron.utils.jsonl import atomic_output, check_output_path, check_token_ids, read_jsonl_objects
from entr_megatron.utils.outputs import check_output
from entr_megatron.utils.run_log import PROGRESS_EVERY_S

SGLANG_ONLY = ("tp", "port", "mem_fraction", "sglang_args", "sglang_log_dir", "sglang_url")
"""Flags that mean nothing to the embedded engine (refused there rather than ignored)."""
LAUNCH_ONLY = ("tp", "port", "mem_fraction", "sglang_args", "sglang_log_dir")
"""Flags that only shape a server we launch (refused with --sglang-url)."""


# --- the model directory and its tokenizer ------------------------------------------------------


class LazyTokenizer:
    """The model's tokenizer, loaded on first use (importing transformers takes seconds)."""

    def __init__(self, source: str | None):
        self.source = source
        self._tokenizer: Any = None
        self.missing: str | None = None
        """Why there is no tokenizer (None: one is there, or may be: a hub id)."""
        if source is None:
            self.missing = "no --model was given"
        elif os.path.isdir(source) and tokenizer_problem(source) is not None:
            self.missing = f"--model {tokenizer_problem(source)}"  # none there, or a damaged one

    def get(self) -> Any:
        """The transformers tokenizer, or None (see `missing`)."""
        if self._tokenizer is None and self.missing is None:
            try:
                import transformers  # lazy: seconds of import, for "prompt" lines and output_text only

                self._tokenizer = transformers.AutoTokenizer.from_pretrained(self.source)
            except Exception as e:  # any loading failure means: no tokenizer, with the reason
                self.missing = f"the tokenizer of --model {self.source} does not load ({type(e).__name__}: {e})"
        return self._tokenizer


def _model_config(model: str | None) -> dict[str, Any]:
    """config.json of a local model directory ({} for a hub id or no --model)."""
    if model is None or not os.path.isfile(os.path.join(model, "config.json")):
        return {}
    cfg = check_model_dir(model, "--model", weights=False, tokenizer=False).config  # UTF-8 JSON, a model_type
    return {**(cfg.get("text_config") or {}), **cfg}


# --- input --------------------------------------------------------------------------------------


@dataclass
class Prompt:
    """One validated input line."""

    index: int
    """Position among the non-blank lines (seeds and output order)."""
    where: str
    fields: dict[str, Any]
    prompt_ids: list[int]
    from_text: bool


def read_prompts(path: str, vocab_size: int | None, tokenizer: LazyTokenizer, max_len: int | None) -> list[Prompt]:
    """Every non-blank line, validated and tokenized; ValueError names the file and line.
    `max_len`: the engine's context length (a prompt must leave room for one token)."""
    prompts = []
    for lineno, where, obj in read_jsonl_objects(path):
        if "input_ids" in obj:
            ids, from_text = check_token_ids(obj["input_ids"], where, "input_ids", vocab_size), False
        elif "prompt" in obj:
            text = obj["prompt"]
            if not isinstance(text, str) or not text:
                raise ValueError(f'{where}: "prompt" must be a non-empty string, got {text!r}')
            tok = tokenizer.get()
            if tok is None:
                raise ValueError(f'{where}: "prompt" needs the model\'s tokenizer, but {tokenizer.missing}; '
                                 'give "input_ids" instead')
            ids = list(tok(text)["input_ids"])
            if not ids:
                raise ValueError(f'{where}: "prompt" {text!r} tokenizes to no tokens')
            ids, from_text = check_token_ids(ids, where, "tokenized prompt", vocab_size), True
        else:
            raise ValueError(f'{where}: needs "input_ids" (token ids) or "prompt" (text); has {sorted(obj)}')
        if max_len is not None and len(ids) >= max_len:
            raise ValueError(f"{where}: the prompt has {len(ids)} tokens; the model's context is {max_len} "
                             "(max_position_embeddings), which leaves no room to generate")
        prompts.append(Prompt(len(prompts), where, obj, [int(t) for t in ids], from_text))
    return prompts


def line_seed(seed: int, index: int) -> int:
    """Seed of the request of input line `index` (hashed: seed s, line 1 vs seed s + 1, line 0 differ)."""
    return int.from_bytes(hashlib.blake2b(f"{seed}:line{index}".encode(), digest_size=7).digest(), "little")


# --- output -------------------------------------------------------------------------------------


def output_line(p: Prompt, r: GenerateResult, *, tokenizer: Any, score_input: bool, version: int) -> dict[str, Any]:
    """The output object of one sample (module docstring)."""
    obj = dict(p.fields)
    obj["sample_index"] = r.sample_index
    if score_input:
        obj["prompt_ids"] = list(r.prompt_ids)
        obj["input_ids"] = list(r.prompt_ids) + list(r.output_ids)
    elif p.from_text:
        obj["prompt_ids"] = list(r.prompt_ids)
    obj["output_ids"] = list(r.output_ids)
    if tokenizer is not None:
        obj["output_text"] = tokenizer.decode(r.output_ids, skip_special_tokens=True)
    if r.output_ids or not score_input:  # score refuses an empty rollout_logprobs
        obj["rollout_logprobs"] = list(r.logprobs)
    if r.entropy is not None:
        obj["rollout_entropy" if score_input else "entropy"] = list(r.entropy)
    obj["finish_reason"] = r.finish_reason
    obj["weight_version"] = max(r.versions) if r.versions else version  # the newest that produced a token
    obj["weight_versions"] = list(r.versions)
    return obj


class OrderedWriter:
    """Writes samples as soon as every earlier one (input order, then sample index) is written."""

    def __init__(self, out, prompts: list[Prompt], n: int, **line_kw: Any):
        self.out, self.prompts, self.n, self.line_kw = out, prompts, n, line_kw
        self.pending: dict[tuple[int, int], GenerateResult] = {}
        self.next = (0, 0)
        self.written = 0

    def add(self, index: int, result: GenerateResult) -> None:
        assert 0 <= result.sample_index < self.n, result.sample_index
        self.pending[(index, result.sample_index)] = result
        while self.next in self.pending:
            r = self.pending.pop(self.next)
            self.out.write(json.dumps(output_line(self.prompts[self.next[0]], r, **self.line_kw)) + "\n")
            self.written += 1
            i, s = self.next
            self.next = (i, s + 1) if s + 1 < self.n else (i + 1, 0)


# --- engines ------------------------------------------------------------------------------------


@contextlib.contextmanager
def open_engine(args) -> Iterator[RolloutEngine]:
    """The engine the flags ask for, shut down (and any server we launched stopped) on exit."""
    if args.engine == "embedded":
        config = EmbeddedEngineConfig(model_dir=args.model, dtype=args.dtype or "float32", init="pretrained",
                                      seed=args.seed, max_batch_size=args.max_batch_size or 32)
        with EmbeddedEngine(config) as engine:
            yield engine
        return
    servers = []
    if args.sglang_url:
        urls = tuple(args.sglang_url)
    else:
        log_dir = args.sglang_log_dir or tempfile.mkdtemp(prefix="entr-generate-sglang-")
        server = SGLangServerConfig(
            model_path=args.model, port=args.port or 30000, tp_size=args.tp or 1, dtype=args.dtype or "auto",
            mem_fraction_static=args.mem_fraction, random_seed=args.seed,
            extra_args=tuple(shlex.split(args.sglang_args or "")),
        )
        print(f"launching SGLang (tp={server.tp_size}, port {server.port}), log in {log_dir}",
              file=sys.stderr, flush=True)
        servers = launch_servers([server], log_dir=log_dir, startup_timeout_s=args.startup_timeout)
        urls = tuple(s.url for s in servers)
    try:
        with SGLangEngine(SGLangEngineConfig(urls=urls)) as engine:
            yield engine
    finally:
        terminate_all(servers)


# --- the command --------------------------------------------------------------------------------


def sampling_params(args, vocab_size: int | None) -> SamplingParams:
    """SamplingParams of every request, with errors that name the flag."""
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise ValueError(f"--temperature must be >= 0 (0 = greedy), got {args.temperature}")
    if not 0.0 < args.top_p <= 1.0:
        raise ValueError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.top_k < -1:
        raise ValueError(f"--top-k must be -1 or 0 (off) or >= 1, got {args.top_k}")
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.n < 1:
        raise ValueError(f"--n must be >= 1, got {args.n}")
    for t in args.stop_token_ids:
        if t < 0 or (vocab_size is not None and t >= vocab_size):
            raise ValueError(f"--stop-token-ids: {t} is outside the model's vocabulary [0, {vocab_size})")
    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                          max_new_tokens=args.max_new_tokens, stop_token_ids=tuple(args.stop_token_ids),
                          ignore_eos=args.ignore_eos, n=args.n)


def check_engine_flags(args) -> None:
    """Refuse flags the chosen engine would ignore, and a --model it cannot use."""
    given = [f for f in SGLANG_ONLY if getattr(args, f) is not None]
    if args.engine == "embedded":
        if given:
            raise ValueError(f"--{given[0].replace('_', '-')} applies to --engine sglang only")
        if args.max_batch_size is not None and args.max_batch_size < 1:
            raise ValueError(f"--max-batch-size must be >= 1, got {args.max_batch_size}")
        if args.model is None:
            raise ValueError("--model is required with --engine embedded")
        if not os.path.isfile(os.path.join(args.model, "config.json")):
            raise ValueError(f"--model {args.model!r} is not an HF model directory (no config.json)")
        if not has_weights(args.model):
            raise ValueError(f"--model {args.model!r} has a config.json but no checkpoint (model.safetensors, ...)")
        check_model_dir(args.model, "--model", tokenizer=False)  # the config, every safetensors header
        return
    if args.max_batch_size is not None:
        raise ValueError("--max-batch-size applies to --engine embedded only (SGLang batches by itself)")
    if args.sglang_url:
        launch = [f for f in (*LAUNCH_ONLY, "dtype") if getattr(args, f) is not None]
        if launch:
            raise ValueError(f"--{launch[0].replace('_', '-')} shapes a server this command launches; "
                             "it cannot apply to one given with --sglang-url")
        bad = [u for u in args.sglang_url if not u.startswith(("http://", "https://"))]
        if bad:
            raise ValueError(f"--sglang-url must start with http:// or https://, got {bad[0]!r}")
        return
    if args.model is None:
        raise ValueError("--model is required to launch SGLang (or give --sglang-url)")
    if os.path.isdir(args.model):  # a local directory, not a hub id: SGLang reads its config and weights
        check_model_dir(args.model, "--model", tokenizer=False)
    if args.tp is not None and args.tp < 1:
        raise ValueError(f"--tp must be >= 1, got {args.tp}")
    if args.port is not None and not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    if args.mem_fraction is not None and not 0.0 < args.mem_fraction < 1.0:
        raise ValueError(f"--mem-fraction must be in (0, 1), got {args.mem_fraction}")


def run(args) -> None:
    """Validate everything, generate, write the output atomically."""
    try:
        _run(args)
    except (ValueError, RuntimeError, TimeoutError) as e:
        notes = "".join(f"\n{n}" for n in getattr(e, "__notes__", ()))
        sys.exit(f"entr-megatron generate: error: {e}{notes}")


def _run(args) -> None:
    check_output("--output", args.output, [("--input", args.input), ("--model", args.model)])  # never onto them
    check_engine_flags(args)
    config = _model_config(args.model)
    vocab_size = config.get("vocab_size")
    params = sampling_params(args, vocab_size)
    if args.seed is None:
        args.seed = secrets.randbelow(2**31)
        print(f"seed {args.seed} (pass --seed {args.seed} to reproduce)", file=sys.stderr, flush=True)
    elif args.seed < 0:
        raise ValueError(f"--seed must be >= 0, got {args.seed}")
    check_output_path(args.output)
    tokenizer = LazyTokenizer(args.model)
    max_len = config.get("max_position_embeddings") if args.engine == "embedded" else None
    prompts = read_prompts(args.input, vocab_size, tokenizer, max_len)
    if not prompts:
        raise ValueError(f"{args.input}: no input lines")
    text_tokenizer = None if args.no_output_text else tokenizer.get()
    if text_tokenizer is None and not args.no_output_text:
        print(f"no output_text: {tokenizer.missing}", file=sys.stderr, flush=True)
    if args.emit_score_input and not params.greedy and (params.top_p < 1.0 or params.top_k > 0):
        print("warning: --emit-score-input with top-k/top-p sampling: rollout_logprobs refer to that truncated "
              "distribution, not the full softmax score compares with", file=sys.stderr, flush=True)

    total = len(prompts) * params.n
    print(f"generating {total} samples ({len(prompts)} prompts x n={params.n}, "
          f"{sum(len(p.prompt_ids) for p in prompts)} prompt tokens) with the {args.engine} engine from "
          f"{args.model or ', '.join(args.sglang_url)}", file=sys.stderr, flush=True)
    with open_engine(args) as engine, atomic_output(args.output) as out:
        started = time.monotonic()
        requests = [GenerateRequest(p.prompt_ids, dataclasses.replace(params, seed=line_seed(args.seed, p.index)))
                    for p in prompts]
        writer = OrderedWriter(out, prompts, params.n, tokenizer=text_tokenizer, score_input=args.emit_score_input,
                               version=engine.weight_version)
        # Unique ids from the engine: another client of the same SGLang server cannot collide with them.
        index = {rid: i for i, rid in enumerate(engine.submit(requests))}
        done, tokens, last = 0, 0, started
        while done < total:
            for r in engine.poll(timeout=1.0):
                writer.add(index[r.request_id], r)
                done, tokens = done + 1, tokens + len(r.output_ids)
            now = time.monotonic()
            if now - last >= PROGRESS_EVERY_S and done < total:
                last = now
                print(f"  {done}/{total} samples ({done / total:.0%}), {tokens / (now - started):.0f} tokens/s",
                      file=sys.stderr, flush=True)
        assert writer.written == total and not writer.pending, (writer.written, len(writer.pending))
    elapsed = time.monotonic() - started
    print(f"generated {total} samples ({tokens} tokens) in {elapsed:.1f} s -> {args.output}")

