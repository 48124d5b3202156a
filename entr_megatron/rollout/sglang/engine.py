"""`SGLangEngine`: the `RolloutEngine` over running SGLang servers (generation; weights by a transfer).

    engine = SGLangEngine(SGLangEngineConfig(urls=("http://10.0.0.2:30000", "http://10.0.0.3:30000")))
    engine.submit([GenerateRequest(prompt_ids, SamplingParams(temperature=1.0, n=8))])
    results = engine.poll(timeout=1.0)
    report = engine.update_weights(hf_state_dict, version=engine.weight_version + 1)  # needs a transfer

Control calls (abort, pause, resume) go to every server; `/generate` goes to the
sglang-router when one is configured, else to the server with the fewest of our
requests in flight. Each request is one non-streamed `/generate` call of its n
samples (`protocol.generate_payload`), run in a thread pool; `poll` hands back the
parsed answers and raises a failed call's `SGLangError`. An answer is checked before
it is used (`answers.parse_generate_output`: token ids inside the vocabulary when
`vocab_size` is known, finite log-probs, per-token lists of one length, and with `routes`
the MoE routes of each sample, `GenerateResult.routed_experts`); a bad one
fails its request with an error naming the server, the request, the field and the
value. A request whose call failed (5xx, no answer in time, a cut-off body, garbage) is
sent again with fresh rids, its failed rids aborted, at most `retries` times with backoff
(`generate_call.py`); a 4xx answer is not (the request itself is wrong). The idempotent control
calls are retried by the client (`client.py`).

Weights: `update_weights` pauses every server (`kv_on_update`), lets the attached
`WeightTransfer` move the tensors, then resumes them and labels later tokens with the
new version. The transfer (SGLang's broadcast group and its per-bucket handshake) is
weight_sync's `SGLangWeightUpdate`, which attaches itself with `set_weight_transfer`.

Its settings: `SGLangEngineConfig` (engine_config.py, importable from here too).
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import random
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from entr_megatron.rollout.engine import (
    EngineError,
    EngineHealth,
    GenerateRequest,
    GenerateResult,
    WeightReceiver,
    WeightSource,
    WeightUpdateReport,
)
from entr_megatron.rollout.sglang.answers import ParsedSample
from entr_megatron.rollout.sglang.client import MAX_BACKOFF_S, SGLangClient, SGLangError, api_key_from_env, wait_all
from entr_megatron.rollout.sglang.engine_config import SGLangEngineConfig
from entr_megatron.rollout.sglang.generate_call import attempt_rids, call_generate, retryable
from entr_megatron.rollout.sglang.protocol import KV_ON_UPDATE, sample_rids

__all__ = ["SGLangEngine", "SGLangEngineConfig", "WeightTransfer"]


@runtime_checkable
class WeightTransfer(Protocol):
    """Moves one weight version onto the servers while `update_weights` holds them paused
    (weight_sync's `SGLangWeightUpdate`)."""

    def transfer(self, weights: WeightSource, version: int) -> tuple[int, int]:
        """Send every tensor of `weights` as `version`; returns (tensors, bytes) sent. May set
        `sent_buckets` (buckets sent to the servers by the last call; unset: assume some were)."""
        ...


@dataclass
class _Live:
    request: GenerateRequest
    rids: list[str]
    server: int | None  # index into the servers; None: the router
    aborted: bool = False


class SGLangEngine:
    """`RolloutEngine` over running SGLang servers (see the module docstring)."""

    def __init__(self, config: SGLangEngineConfig):
        self.config = config
        key = api_key_from_env(config.api_key_env, "SGLangEngineConfig.api_key_env")
        client = dict(api_key=key, retries=config.retries, retry_backoff_s=config.retry_backoff_s)
        self.servers = [SGLangClient(u, config.request_timeout_s, **client) for u in config.urls]
        self.router = None if config.router_url is None else SGLangClient(config.router_url, config.request_timeout_s, **client)
        self._pool = cf.ThreadPoolExecutor(config.max_concurrent_requests, thread_name_prefix="sglang-generate")
        self._control = cf.ThreadPoolExecutor(2 * len(self.servers) + 4, thread_name_prefix="sglang-control")
        self._cond = threading.Condition()
        self._results: collections.deque[GenerateResult] = collections.deque()
        self._errors: list[BaseException] = []
        self._live: dict[str, _Live] = {}
        self._update_lock = threading.Lock()
        self._paused = False
        self._held = False  # paused by a weight update that failed after loading part of a version
        self._closed = False
        self._weight_transfer: WeightTransfer | None = None
        self._last_update: WeightUpdateReport | None = None
        self._aborter: threading.Thread | None = None
        self.generate_retries = 0
        """Attempts of /generate sent again after a failure (generate_call.py)."""
        self._version = self._sync_versions()

    def _sync_versions(self) -> int:
        """Read the servers' versions; label non-numeric ones (SGLang's "default") `initial_version`."""
        versions = set()
        for s in self.servers:
            v = s.weight_version()
            if not v.lstrip("-").isdigit():
                try:
                    s.update_weight_version(str(self.config.initial_version), abort_all_requests=False)
                except SGLangError as e:
                    if e.status != 404:  # an old server without versions: parse_generate_output maps them
                        raise
                v = str(self.config.initial_version)
            versions.add(int(v))
        if len(versions) != 1:
            raise EngineError(f"SGLang servers disagree on the weight version: {sorted(versions)} ({self.config.urls})")
        return versions.pop()

    # --- RolloutEngine -------------------------------------------------------------------

    @property
    def weight_version(self) -> int:
        return self._version

    def submit(self, requests: Sequence[GenerateRequest]) -> list[str]:
        """Queue requests (one /generate call each, n samples in it); returns their ids."""
        self._check_open()
        ids: list[str] = []
        for r in requests:
            p = r.params
            if p.return_raw_logprobs and not (p.greedy or p.temperature == 1.0):
                raise ValueError(
                    "SamplingParams.return_raw_logprobs needs temperature 1 or 0 with SGLang: it reports "
                    f"log-probs after temperature scaling (request {r.request_id}, temperature {p.temperature})"
                )
            if r.request_id is None:
                r.request_id = uuid.uuid4().hex
            if r.request_id in self._live or r.request_id in ids:
                raise ValueError(f"request id {r.request_id!r} is already in flight")
            ids.append(r.request_id)
        with self._cond:
            for r in requests:
                live = _Live(r, sample_rids(r.request_id, r.params.n), self._pick_server())
                self._live[r.request_id] = live
                self._pool.submit(self._run, live)
        return ids

    def poll(self, timeout: float | None = 0.0) -> list[GenerateResult]:
        """Finished samples (a request's n samples arrive together); waits up to `timeout` s for
        the first. A failed /generate call raises here, with the server's answer as a note."""
        with self._cond:
            self._cond.wait_for(lambda: self._results or self._errors, timeout)
            if self._errors:
                raise self._errors.pop(0)
            out = list(self._results)
            self._results.clear()
            return out

    def abort(self, request_ids: Iterable[str]) -> None:
        """End requests: each comes back with finish_reason "abort" and its tokens so far."""
        self._check_open()
        targets = []
        with self._cond:
            for rid in request_ids:
                live = self._live.get(rid)
                if live is not None and not live.aborted:
                    live.aborted = True
                    targets.append(live)
            if targets and self._aborter is None:
                self._aborter = threading.Thread(target=self._abort_loop, name="sglang-abort", daemon=True)
                self._aborter.start()
        self._send_aborts(targets)

    def pause(self) -> None:
        """Stop decoding on every server (SGLang pause mode from `kv_on_update`); requests stay."""
        self._check_open()
        mode = KV_ON_UPDATE[self.config.kv_on_update]
        wait_all([self._control.submit(s.pause_generation, mode) for s in self.servers], self.config.request_timeout_s, "pause")
        self._paused = True

    def resume(self) -> None:
        """Decode again on every server."""
        self._check_open()
        wait_all([self._control.submit(s.continue_generation) for s in self.servers], self.config.request_timeout_s, "resume")
        self._paused = False

    def health(self) -> EngineHealth:
        """Every server answers /model_info; never raises."""
        with self._cond:
            running = sum(len(live.rids) for live in self._live.values())
        base = dict(weight_version=self._version, paused=self._paused, num_running=running, last_update=self._last_update)
        if self._closed:
            return EngineHealth(alive=False, error="the engine was shut down", **base)
        errors = []
        for s in self.servers:
            try:
                s.model_info(timeout=min(self.config.request_timeout_s, 10.0))
            except SGLangError as e:
                errors.append("\n".join([str(e), *getattr(e, "__notes__", [])]))
        return EngineHealth(alive=not errors, error="\n".join(errors) or None, **base)

    def update_weights(self, weights: WeightSource, version: int) -> WeightUpdateReport:
        """Send a complete set of HF-named tensors to every server as `version` through the
        attached `WeightTransfer` (`set_weight_transfer`). Generation is paused for the
        whole transfer (the report's swap_s; not with `pause_for_updates` False, where nothing
        generates during a push); requests stay and their later tokens carry `version`. On failure the servers are resumed and the error raised; the servers may
        then hold a partial update (SGLang loads each bucket as it arrives): send it again.
        A transfer that failed after sending a bucket leaves the servers paused (`_hold`): SGLang
        loads each bucket as it arrives, so they hold part of the new version, and no token is
        generated from such weights; the next complete update resumes them. One that failed before
        (its session refused) resumes them on the old version."""
        if isinstance(weights, WeightReceiver):
            raise TypeError("SGLang servers receive weights over their broadcast group, not through a WeightReceiver")
        transfer = self._weight_transfer
        if transfer is None:
            raise ValueError("SGLangEngine.update_weights needs a weight transfer: weight_sync's "
                             "SGLangWeightUpdate(engine) with init_weights_update_group(...) and set_weight_sender(...) first")
        with self._update_lock:
            self._check_open()
            if version <= self._version:
                raise ValueError(f"weight version must increase: engine is at {self._version}, got {version}")
            t0 = time.time()
            # the caller's own pause is the caller's to end; without pause_for_updates nothing generates now
            resume = (not self._paused and self.config.pause_for_updates) or self._held
            started = False
            try:
                if not self._paused and self.config.pause_for_updates:  # resumed below even after a partial pause
                    self.pause()
                t_paused = time.time()
                with self._cond:
                    running = sum(len(live.rids) for live in self._live.values())
                started = True
                num_tensors, num_bytes = transfer.transfer(weights, version)
            except BaseException as e:
                if started and getattr(transfer, "sent_buckets", 1):
                    self._hold(version, e)
                elif resume:
                    try:
                        self.resume()
                    except EngineError as resume_error:
                        e.add_note(f"resuming the servers failed too: {resume_error}")
                raise
            t_loaded = time.time()
            self._held = False
            if resume:
                self.resume()
            t_end = time.time()
            self._version = version
            self._last_update = WeightUpdateReport(
                version=version, num_tensors=num_tensors, num_bytes=num_bytes, transfer_s=t_loaded - t0,
                swap_s=t_end - t_paused, wait_s=t_paused - t0, total_s=t_end - t0,
                decode_steps_during_transfer=0, running_at_swap=running,
            )
            return self._last_update

    def _hold(self, version: int, error: BaseException) -> None:
        """A failed update sent part of `version`: the servers stay paused, relabelled -1 (their
        weights are no version), until a complete update resumes them (best effort, noted on `error`)."""
        self._held = True
        try:
            if not self._paused:  # pause_for_updates False: they were running
                self.pause()
            wait_all([self._control.submit(s.update_weight_version, "-1", abort_all_requests=False)
                      for s in self.servers], self.config.request_timeout_s, "update_weight_version")
        except (EngineError, RuntimeError) as e:
            error.add_note(f"pausing the servers or relabelling their weight version -1 failed too: {e}")
        error.add_note(f"the servers hold part of weight version {version} (SGLang loads each bucket as it arrives): "
                       "they stay paused, labelled version -1, until a complete version is pushed")

    def shutdown(self) -> None:
        """Abort our requests still on the servers (best effort) and stop the threads; idempotent.
        The servers keep running (the launcher owns them); servers held paused by a failed update
        are resumed, labelled version -1 (given by URL, they would wait for nobody)."""
        if self._closed:
            return
        if self._held:
            try:
                self.resume()
            except EngineError:
                pass
        with self._cond:
            live = list(self._live.values())
            for entry in live:
                entry.aborted = True
        try:
            self._send_aborts(live, timeout=5.0)
        except EngineError:
            pass
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._control.shutdown(wait=False, cancel_futures=True)
        with self._cond:
            self._cond.notify_all()

    def __enter__(self) -> SGLangEngine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # --- the servers' side of weight updates ---------------------------------------------

    def tp_sizes(self) -> tuple[int, ...]:
        """Ranks each server holds in a weight group (its tensor-parallel size)."""
        if self.config.tp_sizes is not None:
            return self.config.tp_sizes
        return tuple(int(s.server_info().get("tp_size", 1)) for s in self.servers)

    def set_weight_transfer(self, transfer: WeightTransfer | None) -> None:
        """What `update_weights` sends through (None: nothing; updates are refused)."""
        if transfer is not None and not isinstance(transfer, WeightTransfer):
            raise TypeError(f"weight transfer must have transfer(weights, version), got {type(transfer).__name__}")
        self._weight_transfer = transfer

    # --- plumbing ------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise EngineError("the SGLang engine was shut down")

    def _pick_server(self) -> int | None:
        if self.router is not None:
            return None
        load = collections.Counter(live.server for live in self._live.values())
        return min(range(len(self.servers)), key=lambda i: load[i])

    def _run(self, live: _Live) -> None:
        """One request: its /generate call, sent again after a failure that may pass (in a pool thread;
        generate_call.py: which failures, fresh rids each time, the failed attempt's rids aborted)."""
        r = live.request
        seed = random.getrandbits(62)  # always seeded: a deterministic-inference server gives unseeded samples 42
        try:
            attempts, delay = 1 + self.config.retries, self.config.retry_backoff_s
            for attempt in range(attempts):
                if live.aborted:  # never reached a server (or aborted between two attempts)
                    parsed = [ParsedSample(output_ids=[], logprobs=[], entropy=None, finish_reason="abort", versions=[],
                                           raw_logprobs=[] if r.params.return_raw_logprobs else None, routed_experts=None)
                              for _ in live.rids]
                    break
                live.rids = attempt_rids(r.request_id, len(live.rids), attempt)
                client = self.router if live.server is None else self.servers[live.server]
                try:
                    parsed = call_generate(client, r, live.rids, seed, self.config)
                    break
                except SGLangError as e:
                    if not retryable(e):
                        raise
                    self._retire(live)
                    if attempt + 1 == attempts:
                        how = "not retried (retries=0)" if attempts == 1 else \
                            f"gave up after {attempts} attempts ({attempts - 1} retries, each with fresh rids)"
                        raise type(e)(f"{e}; {how}", url=e.url, status=e.status, body=e.body,
                                      transient=e.transient) from e
                    with self._cond:
                        self.generate_retries += 1
                    time.sleep(min(delay, MAX_BACKOFF_S))
                    delay *= 2
            results = [
                GenerateResult(request_id=r.request_id, sample_index=i, prompt_ids=list(r.prompt_ids),
                               group_id=r.group_id, metadata=dict(r.metadata), **p)
                for i, p in enumerate(parsed)
            ]
            with self._cond:
                self._results.extend(results)
        except BaseException as e:  # surfaced by poll()
            if isinstance(e, SGLangError):
                e.add_note(f"request {r.request_id} ({len(live.rids)} samples)")
            with self._cond:
                self._errors.append(e)
        finally:
            with self._cond:
                self._live.pop(r.request_id, None)
                self._cond.notify_all()

    def _retire(self, live: _Live) -> None:
        """Abort a failed attempt's rids (best effort: the server may still run them, e.g. after a timeout)."""
        try:
            self._send_aborts([live], timeout=5.0)
        except (EngineError, RuntimeError):
            pass

    def _send_aborts(self, targets: Sequence[_Live], timeout: float | None = None) -> None:
        calls = []
        for live in targets:
            # Behind a router we do not know which server has the request: ask all.
            servers = self.servers if live.server is None else [self.servers[live.server]]
            calls += [self._control.submit(s.abort_request, rid, timeout=timeout) for s in servers for rid in live.rids]
        if calls:
            wait_all(calls, timeout or self.config.request_timeout_s, "abort")

    def _abort_loop(self) -> None:
        while not self._closed:
            time.sleep(self.config.abort_retry_s)
            with self._cond:
                targets = [live for live in self._live.values() if live.aborted]
            try:
                self._send_aborts(targets)
            except (EngineError, RuntimeError):  # the next round retries; poll reports dead servers
                pass
