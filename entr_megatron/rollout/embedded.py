"""The embedded engine: an HF transformers causal LM generating in its own process.

    with EmbeddedEngine(EmbeddedEngineConfig(model_dir="path/with/config.json", dtype="bfloat16")) as engine:
        ids = engine.submit([GenerateRequest(prompt_ids, SamplingParams(temperature=1.0, n=4))])
        results = engine.poll(timeout=10.0)
        report = engine.update_weights(learner_hf_state_dict, version=1)   # while it generates

The CPU stand-in for SGLang servers (laptops, CI, the default run), with the same
contract: exact behaviour log-probs and entropies of the sampled distribution,
per-token weight versions, in-flight weight updates. The process runs
`embedded_worker.run_worker`; this client talks to it over three
torch.multiprocessing queues (commands, weight buckets, events: the records of
`embedded_protocol`) and a dispatcher thread that routes the events, so `poll`,
`update_weights` and the rest may be called from different threads.
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
from typing import Any

import torch
import torch.multiprocessing as mp

from entr_megatron.rollout.embedded_protocol import (
    EVENTS,
    KV_ON_UPDATE,
    Abort,
    BeginUpdate,
    Bucket,
    CallFailed,
    CancelUpdate,
    EmbeddedEngineConfig,
    EndUpdate,
    Fatal,
    GetHealth,
    Pause,
    ProtocolError,
    Ready,
    Reply,
    Results,
    Resume,
    RunReceiver,
    Shutdown,
    Submit,
)
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
from entr_megatron.rollout.weights import TensorSpec, pack_buckets
from entr_megatron.utils.spawn import sigint_held

__all__ = ["KV_ON_UPDATE", "EmbeddedEngine", "EmbeddedEngineConfig"]


class _PendingCall:
    """A call waiting for the engine's answer; `done` without an answer: the engine failed."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.answer: Reply | CallFailed | None = None


class EmbeddedEngine:
    """`RolloutEngine` on an HF model in a spawned process (see the module docstring)."""

    def __init__(self, config: EmbeddedEngineConfig, *, wait: bool = True):
        """Starts the engine process; with `wait` (the default) also waits until its model is
        loaded, else `wait_ready` does (other processes can start meanwhile)."""
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
        self._pending: dict[int, _PendingCall] = {}
        self._calls = itertools.count()
        self._update_lock = threading.Lock()
        self._live: dict[str, int] = {}  # request id -> samples not yet returned
        self._error: str | None = None
        self._closed = False
        self._version = config.initial_version
        self._any_version = False  # forget_version: the next update may go back
        self._ready = threading.Event()
        self._info: Ready | None = None
        self._on_event = EVENTS.dispatcher({
            Results: self._on_results, Reply: self._on_answer, CallFailed: self._on_answer,
            Ready: self._on_ready, Fatal: self._on_fatal,
        })
        with sigint_held():  # a Ctrl-C while it imports stays quiet: run_worker ignores it
            self._proc.start()
        self._dispatcher = threading.Thread(target=self._dispatch, name="engine-dispatch", daemon=True)
        self._dispatcher.start()
        if wait:
            self.wait_ready()

    def wait_ready(self) -> EmbeddedEngine:
        """Blocks until the engine loaded its model; raises EngineError (the engine shut down)
        when it failed to or took longer than `startup_timeout_s`."""
        if not self._ready.wait(self.config.startup_timeout_s) or self._error is not None:
            why = self._error or f"not ready after {self.config.startup_timeout_s:.0f} s"
            self.shutdown()
            raise EngineError(f"embedded engine for {self.config.model_dir} failed to start: {why}")
        return self

    # --- properties ----------------------------------------------------------------------

    @property
    def weight_version(self) -> int:
        return self._version

    @property
    def weight_specs(self) -> dict[str, TensorSpec]:
        """Names (model.state_dict(), tied ones included), shapes and dtypes the engine holds."""
        return dict(self._info.specs)

    @property
    def vocab_size(self) -> int:
        return self._info.vocab_size

    @property
    def max_model_len(self) -> int | None:
        return self._info.max_model_len

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
        self._cmd_q.put(Submit(tuple(requests)))
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
        self._cmd_q.put(Abort(tuple(request_ids)))

    def pause(self) -> None:
        """Stop decoding; returns once the engine is between steps and will not start another."""
        self._call(Pause)

    def resume(self) -> None:
        self._call(Resume)

    def health(self, timeout_s: float | None = None) -> EngineHealth:
        """The engine's state; not alive when it failed, exited or did not answer within
        `timeout_s` (None: `rpc_timeout_s`)."""
        if self._error is not None or self._closed or not self._proc.is_alive():
            return EngineHealth(alive=False, weight_version=self._version, error=self._error)
        try:
            return self._call(GetHealth, timeout_s)
        except EngineError as e:
            return EngineHealth(alive=False, weight_version=self._version, error=str(e))

    def kill(self) -> None:
        """SIGKILL the process (one that stopped answering); its callers then fail as if it died."""
        if self._proc.is_alive():
            self._proc.kill()

    # --- weights -------------------------------------------------------------------------

    def update_weights(self, weights: WeightSource, version: int) -> WeightUpdateReport:
        """Send a complete set of HF-named tensors (or run a `WeightReceiver` in the engine) as
        `version`; returns once the engine samples from it. Decoding continues during the
        transfer and stops only for the swap. Raises ValueError (names, shapes, missing
        tensors) with the model untouched."""
        with self._update_lock:
            self._check_alive()
            if version <= self._version and not self._any_version:
                raise ValueError(f"weight version must increase: engine is at {self._version}, got {version}")
            if isinstance(weights, Mapping):
                self._check_names(weights)
            t_call = time.time()
            call_id, pending = self._new_call()
            if isinstance(weights, WeightReceiver):
                self._put_weights(RunReceiver(call_id, version, t_call, weights))
            else:
                self._send_buckets(call_id, version, t_call, weights)
            report = self._wait(call_id, pending, self.config.update_timeout_s)
            report.total_s = time.time() - t_call
            self._any_version = False
            return report

    def cancel_weight_update(self) -> None:
        """The update in progress will not complete (e.g. another engine of its broadcast group
        died mid-version): its `update_weights` raises soon, and the engine keeps the weights it
        holds. A receiver that cannot hang ignores it; nothing in progress: no effect. Never raises."""
        if self._proc.is_alive():
            self._cmd_q.put(CancelUpdate())

    def forget_version(self) -> None:
        """The learner restarted from an older checkpoint: the next update may carry a version at or
        below the one held (it replaces the weights all the same); later ones must increase again."""
        self._any_version = True

    def _send_buckets(self, call_id: int, version: int, t_call: float, weights: WeightSource) -> None:
        items = weights.items() if isinstance(weights, Mapping) else weights
        dtypes = {n: s.dtype for n, s in self._info.specs.items()}
        self._put_weights(BeginUpdate(call_id, version, t_call))
        sender_error = None
        try:
            for bucket in pack_buckets(items, self.config.weight_bucket_bytes, dtypes=dtypes, share_memory=True):
                self._put_weights(Bucket(call_id, bucket))
        except BaseException as e:
            sender_error = repr(e)
            raise
        finally:
            if self._error is None:
                self._put_weights(EndUpdate(call_id, sender_error))

    def _put_weights(self, msg: RunReceiver | BeginUpdate | Bucket | EndUpdate) -> None:
        """Put on the bounded weight queue, giving up if the engine dies meanwhile."""
        while True:
            self._check_alive()
            try:
                self._weight_q.put(msg, timeout=1.0)
                return
            except queue.Full:
                continue

    def _check_names(self, weights: Mapping[str, torch.Tensor]) -> None:
        specs = self._info.specs
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
            self._cmd_q.put(Shutdown())
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

    def _new_call(self) -> tuple[int, _PendingCall]:
        call_id = next(self._calls)
        pending = _PendingCall()
        with self._cond:
            self._pending[call_id] = pending
        return call_id, pending

    def _call(self, message: type[Pause | Resume | GetHealth], timeout_s: float | None = None) -> Any:
        """Send `message(call_id)` and return the value the engine answers within `timeout_s`
        (None: `rpc_timeout_s`)."""
        self._check_alive()
        call_id, pending = self._new_call()
        self._cmd_q.put(message(call_id))
        return self._wait(call_id, pending, self.config.rpc_timeout_s if timeout_s is None else timeout_s)

    def _wait(self, call_id: int, pending: _PendingCall, timeout: float) -> Any:
        if not pending.done.wait(timeout):
            with self._cond:
                self._pending.pop(call_id, None)
            raise EngineError(f"embedded engine did not answer call {call_id} within {timeout:.0f} s")
        answer = pending.answer
        if isinstance(answer, Reply):
            return answer.value
        if answer is None:  # woken by _wake_all: the engine failed or was shut down
            raise EngineError(f"embedded engine failed:\n{self._error}")
        if "Traceback" not in answer.error:
            raise ValueError(answer.error)  # a rejected request (e.g. an incomplete weight update)
        raise EngineError(f"embedded engine call failed:\n{answer.error}")

    def _wake_all(self) -> None:
        for pending in self._pending.values():
            pending.done.set()
        self._pending.clear()
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
            with self._cond:
                try:
                    self._on_event(msg)
                except ProtocolError as e:
                    self._on_fatal(Fatal(str(e)))

    # --- event handlers (the dispatcher thread, under self._cond) ------------------------

    def _on_results(self, msg: Results) -> None:
        for r in msg.results:
            left = self._live.get(r.request_id, 1) - 1
            if left > 0:
                self._live[r.request_id] = left
            else:
                self._live.pop(r.request_id, None)
        self._results.extend(msg.results)
        self._cond.notify_all()

    def _on_answer(self, msg: Reply | CallFailed) -> None:
        # Also from calls that timed out here: the engine's version is what it says.
        value = msg.value if isinstance(msg, Reply) else None
        if isinstance(value, WeightUpdateReport):
            self._version = value.version
        elif isinstance(value, EngineHealth):
            self._version = value.weight_version
        pending = self._pending.pop(msg.call_id, None)
        if pending is not None:
            pending.answer = msg
            pending.done.set()

    def _on_ready(self, msg: Ready) -> None:
        self._info = msg
        self._version = msg.version
        self._ready.set()

    def _on_fatal(self, msg: Fatal) -> None:
        self._error = msg.error
        self._ready.set()
        self._wake_all()
