"""The embedded engine: an HF transformers causal LM generating in its own process.

    with EmbeddedEngine(EmbeddedEngineConfig(model_dir="path/with/config.json", dtype="bfloat16")) as engine:
        ids = engine.submit([GenerateRequest(prompt_ids, SamplingParams(temperature=1.0, n=4))])
        results = engine.poll(timeout=10.0)
        report = engine.update_weights(learner_hf_state_dict, version=1)   # while it generates

The CPU stand-in for SGLang servers (laptops, CI, the default run), with the same
contract: exact behaviour log-probs and entropies of the sampled distribution,
per-token weight versions, in-flight weight updates. The process runs
`embedded_worker.run_worker`; this client talks to it over three
torch.multiprocessing queues (commands, weight buckets, answers) and a
dispatcher thread that routes answers, so `poll`, `update_weights` and the rest
may be called from different threads.
"""

from __future__ import annotations

import collections
import itertools
import os
import queue
import threading
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.multiprocessing as mp

from entr_megatron.rollout.embedded_worker import run_worker
from entr_megatron.rollout.engine import (
    EngineError,
    EngineHealth,
    GenerateRequest,
    GenerateResult,
    WeightReceiver,
    WeightSource,
    WeightUpdateReport,
)
from entr_megatron.rollout.hf_model import DTYPES, INITS
from entr_megatron.rollout.weights import TensorSpec, pack_buckets

__all__ = ["KV_ON_UPDATE", "EmbeddedEngine", "EmbeddedEngineConfig"]

KV_ON_UPDATE = ("keep", "recompute")
ATTN_IMPLEMENTATIONS = ("sdpa", "eager")


@dataclass(frozen=True)
class EmbeddedEngineConfig:
    """Settings of one embedded engine."""

    model_dir: str
    """Directory with the HF config.json (and, unless init="random", the checkpoint)."""
    dtype: str = "float32"
    """"float32" or "bfloat16": the engine's numerics (bf16 makes train-inference mismatch real)."""
    init: str = "auto"
    """"pretrained" (load the checkpoint), "random" (from the config, seeded by `seed`), "auto"
    (load if a checkpoint is there)."""
    seed: int = 0
    """Random init, and the seeds of requests that bring none."""
    attn_implementation: str = "sdpa"
    max_batch_size: int = 32
    """Samples decoded together; more wait."""
    max_model_len: int | None = None
    """Prompt + response limit (finish_reason "length"); default: the config's max_position_embeddings."""
    max_prefill_tokens: int = 8192
    """Padded prompt tokens admitted in one prefill (at least one request is always admitted)."""
    kv_on_update: str = "keep"
    """After a weight swap: "keep" the KV cache computed by the previous weights (in-flight update,
    no stall) or "recompute" it with the new weights (the swap then blocks for one prefill)."""
    num_threads: int | None = None
    """torch intra-op threads of the engine process (None: torch's default)."""
    weight_bucket_bytes: int = 64 << 20
    """Bytes per shared-memory bucket when weights go through the engine's own queue."""
    weight_queue_depth: int = 2
    """Buckets in flight (bounds the sender's extra memory)."""
    initial_version: int = 0
    startup_timeout_s: float = 300.0
    rpc_timeout_s: float = 60.0
    update_timeout_s: float = 600.0

    def __post_init__(self):
        def one_of(name: str, allowed: tuple) -> None:
            if getattr(self, name) not in allowed:
                raise ValueError(f"EmbeddedEngineConfig.{name} must be one of {allowed}, got {getattr(self, name)!r}")

        one_of("dtype", tuple(DTYPES))
        one_of("init", INITS)
        one_of("kv_on_update", KV_ON_UPDATE)
        one_of("attn_implementation", ATTN_IMPLEMENTATIONS)
        for name in ("max_batch_size", "max_prefill_tokens", "weight_bucket_bytes", "weight_queue_depth"):
            if getattr(self, name) < 1:
                raise ValueError(f"EmbeddedEngineConfig.{name} must be >= 1, got {getattr(self, name)!r}")
        for name in ("max_model_len", "num_threads"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"EmbeddedEngineConfig.{name} must be None or >= 1, got {getattr(self, name)!r}")


class EmbeddedEngine:
    """`RolloutEngine` on an HF model in a spawned process (see the module docstring)."""

    def __init__(self, config: EmbeddedEngineConfig):
        if not os.path.exists(os.path.join(config.model_dir, "config.json")):
            raise ValueError(f"EmbeddedEngineConfig.model_dir {config.model_dir!r} has no config.json")
        self.config = config
        ctx = mp.get_context("spawn")
        self._cmd_q = ctx.Queue()
        self._weight_q = ctx.Queue(maxsize=config.weight_queue_depth)
        self._out_q = ctx.Queue()
        self._proc = ctx.Process(
            target=run_worker, args=(config, self._cmd_q, self._weight_q, self._out_q),
            name="entr-embedded-engine", daemon=True,
        )
        self._results: collections.deque[GenerateResult] = collections.deque()
        self._cond = threading.Condition()
        self._replies: dict[int, list] = {}  # call id -> [event, ok, payload]
        self._calls = itertools.count()
        self._update_lock = threading.Lock()
        self._live: dict[str, int] = {}  # request id -> samples not yet returned
        self._error: str | None = None
        self._closed = False
        self._version = config.initial_version
        self._ready = threading.Event()
        self._info: dict[str, Any] = {}
        self._proc.start()
        self._dispatcher = threading.Thread(target=self._dispatch, name="engine-dispatch", daemon=True)
        self._dispatcher.start()
        if not self._ready.wait(config.startup_timeout_s) or self._error is not None:
            why = self._error or f"not ready after {config.startup_timeout_s:.0f} s"
            self.shutdown()
            raise EngineError(f"embedded engine for {config.model_dir} failed to start: {why}")

    # --- properties ----------------------------------------------------------------------

    @property
    def weight_version(self) -> int:
        return self._version

    @property
    def weight_specs(self) -> dict[str, TensorSpec]:
        """Names (model.state_dict(), tied ones included), shapes and dtypes the engine holds."""
        return dict(self._info["specs"])

    @property
    def vocab_size(self) -> int:
        return self._info["vocab_size"]

    @property
    def max_model_len(self) -> int | None:
        return self._info["max_model_len"]

    # --- requests ------------------------------------------------------------------------

    def submit(self, requests: Sequence[GenerateRequest]) -> list[str]:
        """Queue requests (non-blocking); their request ids (new ones for those without)."""
        self._check_alive()
        ids = []
        for r in requests:
            if r.request_id is None:
                r.request_id = uuid.uuid4().hex
            if r.request_id in self._live or r.request_id in ids:
                raise ValueError(f"request id {r.request_id!r} is already in flight")
            if max(r.prompt_ids) >= self.vocab_size:
                raise ValueError(
                    f"request {r.request_id}: token id {max(r.prompt_ids)} >= vocab size {self.vocab_size}"
                )
            if self.max_model_len is not None and len(r.prompt_ids) >= self.max_model_len:
                raise ValueError(
                    f"request {r.request_id}: prompt of {len(r.prompt_ids)} tokens "
                    f">= max_model_len {self.max_model_len}"
                )
            ids.append(r.request_id)
        with self._cond:
            for r in requests:
                self._live[r.request_id] = r.params.n
        self._cmd_q.put(("submit", list(requests)))
        return ids

    def poll(self, timeout: float | None = 0.0) -> list[GenerateResult]:
        """Finished samples; waits up to `timeout` s (None: forever) for the first one."""
        with self._cond:
            self._cond.wait_for(lambda: self._results or self._error is not None, timeout)
            if not self._results and self._error is not None:
                raise EngineError(f"embedded engine failed:\n{self._error}")
            out = list(self._results)
            self._results.clear()
            return out

    def abort(self, request_ids: Iterable[str]) -> None:
        """End requests; their samples come back from `poll` with finish_reason "abort"."""
        self._check_alive()
        self._cmd_q.put(("abort", list(request_ids)))

    def pause(self) -> None:
        """Stop decoding; returns once the engine is between steps and will not start another."""
        self._call("pause")

    def resume(self) -> None:
        self._call("resume")

    def health(self) -> EngineHealth:
        if self._error is not None or self._closed or not self._proc.is_alive():
            return EngineHealth(alive=False, weight_version=self._version, error=self._error)
        try:
            return self._call("health")
        except EngineError as e:
            return EngineHealth(alive=False, weight_version=self._version, error=str(e))

    # --- weights -------------------------------------------------------------------------

    def update_weights(self, weights: WeightSource, version: int) -> WeightUpdateReport:
        """Send a complete set of HF-named tensors (or run a `WeightReceiver` in the engine) as
        `version`; returns once the engine samples from it. Decoding continues during the
        transfer and stops only for the swap. Raises ValueError (names, shapes, missing
        tensors) with the model untouched."""
        with self._update_lock:
            self._check_alive()
            if version <= self._version:
                raise ValueError(f"weight version must increase: engine is at {self._version}, got {version}")
            if isinstance(weights, Mapping):
                self._check_names(weights)
            t_call = time.time()
            call_id, reply = self._new_call()
            if isinstance(weights, WeightReceiver):
                self._put_weights(("receiver", call_id, version, t_call, weights))
            else:
                self._send_buckets(call_id, version, t_call, weights)
            report = self._wait(call_id, reply, self.config.update_timeout_s)
            report.total_s = time.time() - t_call
            return report

    def _send_buckets(self, call_id: int, version: int, t_call: float, weights: WeightSource) -> None:
        items = weights.items() if isinstance(weights, Mapping) else weights
        dtypes = {n: s.dtype for n, s in self._info["specs"].items()}
        self._put_weights(("begin", call_id, version, t_call))
        sender_error = None
        try:
            for bucket in pack_buckets(items, self.config.weight_bucket_bytes, dtypes=dtypes, share_memory=True):
                self._put_weights(("bucket", call_id, bucket))
        except BaseException as e:
            sender_error = repr(e)
            raise
        finally:
            if self._error is None:
                self._put_weights(("end", call_id, sender_error))

    def _put_weights(self, msg: tuple) -> None:
        """Put on the bounded weight queue, giving up if the engine dies meanwhile."""
        while True:
            self._check_alive()
            try:
                self._weight_q.put(msg, timeout=1.0)
                return
            except queue.Full:
                continue

    def _check_names(self, weights: Mapping[str, torch.Tensor]) -> None:
        specs = self._info["specs"]
        unknown = sorted(set(weights) - set(specs))
        if unknown:
            raise ValueError(f"weight update: unknown tensors {unknown[:3]} (expected model.state_dict() names)")
        for name, t in weights.items():
            if tuple(t.shape) != specs[name].shape:
                raise ValueError(
                    f"weight update: {name!r} has shape {tuple(t.shape)}, the engine's model has {specs[name].shape}"
                )

    # --- life cycle ----------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop the process (gracefully, then by force) and the dispatcher; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._proc.is_alive():
            self._cmd_q.put(("shutdown",))
            self._proc.join(timeout=30)
            if self._proc.is_alive():
                self._proc.terminate()
                self._proc.join(timeout=10)
        self._dispatcher.join(timeout=5)
        for q in (self._cmd_q, self._weight_q, self._out_q):
            q.cancel_join_thread()
            q.close()
        with self._cond:
            self._error = self._error or "the engine was shut down"
            self._wake_all()

    def __enter__(self) -> EmbeddedEngine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # --- plumbing ------------------------------------------------------------------------

    def _check_alive(self) -> None:
        if self._error is not None:
            raise EngineError(f"embedded engine is not running:\n{self._error}")

    def _new_call(self) -> tuple[int, list]:
        call_id = next(self._calls)
        reply = [threading.Event(), False, None]
        with self._cond:
            self._replies[call_id] = reply
        return call_id, reply

    def _call(self, name: str, *args: Any) -> Any:
        self._check_alive()
        call_id, reply = self._new_call()
        self._cmd_q.put(("call", call_id, name, args))
        return self._wait(call_id, reply, self.config.rpc_timeout_s)

    def _wait(self, call_id: int, reply: list, timeout: float) -> Any:
        if not reply[0].wait(timeout):
            with self._cond:
                self._replies.pop(call_id, None)
            raise EngineError(f"embedded engine did not answer call {call_id} within {timeout:.0f} s")
        event, ok, payload = reply
        if ok:
            return payload
        if self._error is not None and payload is None:
            raise EngineError(f"embedded engine failed:\n{self._error}")
        if isinstance(payload, str) and "Traceback" not in payload:
            raise ValueError(payload)  # a rejected request (e.g. an incomplete weight update)
        raise EngineError(f"embedded engine call failed:\n{payload}")

    def _wake_all(self) -> None:
        for reply in self._replies.values():
            reply[0].set()
        self._replies.clear()
        self._cond.notify_all()

    def _dispatch(self) -> None:
        """Route the worker's messages until it exits."""
        while True:
            try:
                msg = self._out_q.get(timeout=0.2)
            except queue.Empty:
                if not self._proc.is_alive():
                    with self._cond:
                        if self._error is None:
                            self._error = f"the engine process exited (exit code {self._proc.exitcode})"
                        self._ready.set()
                        self._wake_all()
                    return
                continue
            except (EOFError, OSError):
                return
            kind = msg[0]
            with self._cond:
                if kind == "results":
                    for r in msg[1]:
                        left = self._live.get(r.request_id, 1) - 1
                        if left > 0:
                            self._live[r.request_id] = left
                        else:
                            self._live.pop(r.request_id, None)
                    self._results.extend(msg[1])
                    self._cond.notify_all()
                elif kind == "reply":
                    _, call_id, ok, payload = msg
                    # Also from calls that timed out here: the engine's version is what it says.
                    if isinstance(payload, WeightUpdateReport):
                        self._version = payload.version
                    elif isinstance(payload, EngineHealth):
                        self._version = payload.weight_version
                    reply = self._replies.pop(call_id, None)
                    if reply is not None:
                        reply[1], reply[2] = ok, payload
                        reply[0].set()
                elif kind == "ready":
                    self._info = msg[1]
                    self._version = msg[1]["version"]
                    self._ready.set()
                elif kind == "fatal":
                    self._error = msg[1]
                    self._ready.set()
                    self._wake_all()
