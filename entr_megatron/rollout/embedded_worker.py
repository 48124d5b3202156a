"""The embedded engine's process: a decode loop and a weight-receiving thread.

    client (EmbeddedEngine)                       worker process
    ───────────────────────                       ─────────────────────────────────────────
    cmd_q ── Submit / Abort / Pause / Resume ───> decode loop: drain cmd_q, swap staged
             GetHealth / CancelUpdate / Shutdown  weights, one BatchDecoder.step(), repeat
    weight_q ── BeginUpdate, Bucket…, EndUpdate > receiver thread: fill the WeightStage,
             (or RunReceiver)                     then post Staged to cmd_q
    out_q <── Ready / Results / Reply / ──────── both
              CallFailed / Fatal

The messages are the records of `embedded_protocol`. The decode loop only handles
messages between two steps, so a swap (triggered by Staged) always falls between
steps and never half-way through one. The receiver starts a new version only after
the previous one was swapped in (the stage is a single second copy of the weights).
"""

from __future__ import annotations

import queue
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

from entr_megatron.rollout.decoder import BatchDecoder
from entr_megatron.rollout.embedded_protocol import (
    COMMANDS,
    WEIGHTS,
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
    Ready,
    Reply,
    Results,
    Resume,
    RunReceiver,
    Shutdown,
    Staged,
    Submit,
)
from entr_megatron.rollout.engine import EngineHealth, WeightReceiver, WeightUpdateReport
from entr_megatron.rollout.hf_model import eos_token_ids, load_causal_lm
from entr_megatron.rollout.quantize import install_rounding
from entr_megatron.rollout.weights import WeightStage
from entr_megatron.utils.faults import maybe_fault
from entr_megatron.utils.spawn import die_with_parent, exit_now, ignore_sigint, name_process

__all__ = ["run_worker"]

_IDLE_WAKEUP_S = 1.0
"""An idle worker wakes this often to notice that its parent died."""


class _Receiver(threading.Thread):
    """Fills the stage from weight_q while the decode loop keeps running."""

    def __init__(self, stage: WeightStage, decoder: BatchDecoder, weight_q: Any, cmd_q: Any, out_q: Any):
        super().__init__(name="weight-receiver", daemon=True)
        self.stage, self.decoder = stage, decoder
        self.weight_q, self.cmd_q, self.out_q = weight_q, cmd_q, out_q
        self.swapped = threading.Event()
        self.swapped.set()
        self.current: WeightReceiver | None = None
        """The receiver whose `receive` runs now (`cancel` reaches it)."""

    def run(self) -> None:
        while True:
            msg = WEIGHTS.decode(self.weight_q.get())
            if isinstance(msg, RunReceiver):
                self._receive(msg.call_id, msg.version, msg.t_call, msg.receiver)
            elif isinstance(msg, BeginUpdate):
                self._receive(msg.call_id, msg.version, msg.t_call, None)
            # else a Bucket or EndUpdate of an update whose begin failed: already answered

    def cancel(self) -> None:
        """The version being received will not arrive: its receiver gives up (CancelUpdate)."""
        receiver = self.current
        if receiver is not None:
            receiver.cancel()

    def _receive(self, call_id: int, version: int, t_call: float, receiver: WeightReceiver | None) -> None:
        self.swapped.wait()
        self.swapped.clear()
        steps_at_begin = self.decoder.steps
        error: str | None = None
        try:
            self.stage.begin(version)
        except Exception:
            error = traceback.format_exc()
        if receiver is not None:
            if error is None:
                self.current = receiver
                try:
                    error = _try(lambda: receiver.receive(self.stage))
                finally:
                    self.current = None
        else:
            while True:  # read to this update's end even after an error, to keep the queue aligned
                msg = WEIGHTS.decode(self.weight_q.get())
                assert isinstance(msg, (Bucket, EndUpdate)) and msg.call_id == call_id, (
                    f"weight message {msg!r:.200} inside update {call_id}"
                )
                if isinstance(msg, EndUpdate):
                    if msg.sender_error is not None and error is None:
                        error = f"the sender failed: {msg.sender_error}"
                    break
                if error is None:
                    error = _try(lambda: self.stage.load_bucket(msg.bucket))
        if error is None:
            error = _try(self.stage.finish)
        if error is not None:
            self.stage.discard()
            self.swapped.set()
            self.out_q.put(CallFailed(call_id, error))
        else:
            self.cmd_q.put(Staged(call_id, t_call, steps_at_begin))


def _try(fn) -> str | None:
    """None, or the message of the exception `fn()` raised (ValueErrors: just the message)."""
    try:
        fn()
    except ValueError as e:
        return str(e)
    except Exception:
        return traceback.format_exc()
    return None


class _Worker:
    def __init__(self, config: EmbeddedEngineConfig, cmd_q: Any, weight_q: Any, out_q: Any):
        self.config, self.cmd_q, self.out_q = config, cmd_q, out_q
        model = load_causal_lm(
            config.model_dir, dtype=config.dtype, init=config.init, seed=config.seed,
            attn_implementation=config.attn_implementation,
        ).to(config.device)
        self.device = torch.device(config.device)
        self.rounding = install_rounding(model, config.quantize, config.quantize_scale, config.quantize_activations)
        self.decoder = BatchDecoder(
            model, max_batch_size=config.max_batch_size, max_model_len=config.max_model_len,
            max_prefill_tokens=config.max_prefill_tokens, eos_token_ids=eos_token_ids(model),
            version=config.initial_version, seed=config.seed, record_routes=config.record_routes,
        )
        self.stage = WeightStage(model)
        self.receiver = _Receiver(self.stage, self.decoder, weight_q, cmd_q, out_q)
        self.paused = False
        self.stopping = False
        self.cache_frees = 0
        self.last_update: WeightUpdateReport | None = None
        self.ready = Ready(
            specs=self.stage.specs, version=config.initial_version, vocab_size=self.decoder.lm.vocab_size,
            max_model_len=self.decoder.max_model_len, eos_token_ids=tuple(sorted(self.decoder.eos_token_ids)),
        )
        self._handle = COMMANDS.dispatcher({
            Submit: self._on_submit,
            Abort: self._on_abort,
            CancelUpdate: lambda msg: self.receiver.cancel(),
            Staged: self._swap,
            Pause: lambda msg: self._answer(msg.call_id, self._pause),
            Resume: lambda msg: self._answer(msg.call_id, self._resume),
            GetHealth: lambda msg: self._answer(msg.call_id, self._health),
            Shutdown: self._on_shutdown,
        })

    def run(self) -> None:
        self.receiver.start()
        self.out_q.put(self.ready)
        while True:
            idle = self.paused or not self.decoder.has_work()
            for msg in self._drain(block=idle):
                self._handle(msg)
                if self.stopping:
                    return
            if not self.paused and self.decoder.has_work():
                finished = self.decoder.step()
                if finished:
                    self.out_q.put(Results(tuple(finished)))
                if not self.decoder.has_work():
                    self._went_idle()

    def _went_idle(self) -> None:
        """Nothing left to decode: on a GPU, hand the memory of the KV cache and activations back
        (rollout.embedded.free_cache_engine) for the learner's step; the next batch allocates it again."""
        if self.device.type == "cuda" and self.config.free_cache_engine:
            torch.cuda.empty_cache()
            self.cache_frees += 1

    def _drain(self, block: bool) -> list[object]:
        msgs: list[object] = []
        if block:
            try:
                msgs.append(self.cmd_q.get(timeout=_IDLE_WAKEUP_S))
            except queue.Empty:
                parent = mp.parent_process()
                if parent is not None and not parent.is_alive():
                    return [Shutdown()]
        while True:
            try:
                msgs.append(self.cmd_q.get_nowait())
            except queue.Empty:
                return msgs

    # --- command handlers ----------------------------------------------------------------

    def _on_submit(self, msg: Submit) -> None:
        maybe_fault("engine", self.decoder.version, "generate")  # tests only (utils/faults.py)
        for request in msg.requests:
            self.decoder.add(request)

    def _on_abort(self, msg: Abort) -> None:
        results = self.decoder.abort(msg.request_ids)
        if results:
            self.out_q.put(Results(tuple(results)))

    def _on_shutdown(self, msg: Shutdown) -> None:
        self.stopping = True

    def _answer(self, call_id: int, fn: Callable[[], Any]) -> None:
        try:
            self.out_q.put(Reply(call_id, fn()))
        except Exception:
            self.out_q.put(CallFailed(call_id, traceback.format_exc()))

    def _swap(self, msg: Staged) -> None:
        """Install the staged weights now (we are between two steps)."""
        t0 = time.time()
        wait_s = t0 - self.stage.staged_at
        self.decoder.version = self.stage.swap_into()
        self.rounding.refresh()  # the new version arrives unrounded (FP8 rollout: rounded before any forward)
        if self.config.kv_on_update == "recompute":
            self.decoder.recompute_cache()
        t1 = time.time()
        report = WeightUpdateReport(
            version=self.decoder.version, num_tensors=self.stage.num_tensors, num_bytes=self.stage.num_bytes,
            transfer_s=self.stage.staged_at - msg.t_call, swap_s=t1 - t0, wait_s=wait_s, total_s=t1 - msg.t_call,
            decode_steps_during_transfer=self.decoder.steps - msg.steps_at_begin,
            running_at_swap=self.decoder.num_running,
        )
        self.last_update = report
        self.receiver.swapped.set()
        self.out_q.put(Reply(msg.call_id, report))

    # --- calls (answered with a Reply) ---------------------------------------------------

    def _pause(self) -> None:
        self.paused = True

    def _resume(self) -> None:
        self.paused = False

    def _health(self) -> EngineHealth:
        d = self.decoder
        return EngineHealth(
            alive=True, weight_version=d.version, paused=self.paused, num_running=d.num_running,
            num_waiting=d.num_waiting, steps=d.steps, generated_tokens=d.generated_tokens,
            last_update=self.last_update, cache_frees=self.cache_frees,
        )


PROCESS_NAME = "entr-engine"
"""The engine process's name in ps, top and psutil (Linux /proc/<pid>/comm: 15 bytes at most),
so that an operator (or a fault test) tells it from the learner ranks."""


def run_worker(config: EmbeddedEngineConfig, cmd_q: Any, weight_q: Any, out_q: Any) -> None:
    """Entry point of the engine process (spawned by `EmbeddedEngine`)."""
    # Ctrl-C in a terminal reaches the whole process group: the owner decides (e.g. the
    # training job drains, checkpoints, then shuts the engine down); it dies with its owner,
    # also when the owner is killed outright.
    die_with_parent()
    name_process(PROCESS_NAME)
    ignore_sigint()  # started with SIGINT held (`sigint_held`)
    try:
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        _Worker(config, cmd_q, weight_q, out_q).run()
    except BaseException:
        out_q.put(Fatal(traceback.format_exc()))
        raise
    exit_now(0)  # its finalizers flush out_q: the last answers reach the owner
