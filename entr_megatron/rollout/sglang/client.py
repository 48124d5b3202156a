"""One SGLang server's HTTP API (`SGLangClient`), its errors, and calls to several servers at once.

Standard library only, proxies bypassed. Every call has a timeout; a failed call raises
`SGLangError` (`SGLangTimeout` when no answer came) carrying the server's answer as a note.
Idempotent calls (GET /health, /model_info, /server_info, POST /flush_cache) are retried
`retries` times after a transient failure (no connection, no answer in time, an answer cut
off, HTTP 502/503/504), waiting `retry_backoff_s`, then twice as long each time (at most
`MAX_BACKOFF_S`); the rest (/generate, pauses, weight updates) are sent once, and their
error says so. With an API key every request carries `Authorization: Bearer <key>`
(SGLang's `--api-key` check; /health and /metrics need none); the key is in no repr and
no message. The endpoints and bodies are those of `protocol.py`. Nothing here imports sglang.
"""

from __future__ import annotations

import concurrent.futures as cf
import http.client
import json
import math
import os
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

from entr_megatron.rollout.engine import EngineError
from entr_megatron.rollout.sglang.protocol import (
    init_group_payload,
    update_weights_from_tensor_payload,
    update_weights_payload,
)

__all__ = ["MAX_BACKOFF_S", "TRANSIENT_STATUSES", "SGLangClient", "SGLangError", "SGLangTimeout", "api_key_from_env",
           "wait_all"]

TRANSIENT_STATUSES = frozenset({502, 503, 504})
"""HTTP statuses an idempotent call is retried on (a proxy or a server not ready yet); 4xx and 500 are answers."""
MAX_BACKOFF_S = 30.0
"""Longest wait between two attempts of an idempotent call."""


class SGLangError(EngineError):
    """An SGLang server answered with an error or not at all; its answer is in the notes.
    `transient`: no (usable) answer came, or HTTP 502/503/504: the same call may succeed later."""

    def __init__(self, message: str, *, url: str, status: int | None = None, body: str | None = None,
                 transient: bool = False):
        super().__init__(message)
        self.url, self.status, self.body, self.transient = url, status, body, transient
        if body:
            self.add_note(f"server answer: {body}")


class SGLangTimeout(SGLangError, TimeoutError):
    """No answer within the call's timeout."""


_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))
"""Talks to the servers directly, whatever http_proxy says."""


def _decode(raw: bytes) -> Any:
    text = raw.decode("utf-8", errors="replace")
    if not text:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return text


def _check_key(key: str, where: str) -> str:
    if not isinstance(key, str) or not key or any(c.isspace() or not c.isprintable() for c in key):
        # Never the key itself: only what is wrong with it.
        raise ValueError(f"{where}: the SGLang API key must be a non-empty string without whitespace or control characters")
    return key


def api_key_from_env(name: str | None, what: str = "rollout.sglang.api_key_env") -> str | None:
    """The API key held by environment variable `name` (None: no key). Raises naming the variable,
    never its value, when it is unset or empty."""
    if name is None:
        return None
    key = os.environ.get(name)
    if not key:
        raise ValueError(f"{what}={name!r}: environment variable {name} is not set or empty in this process; "
                         "it must hold the SGLang API key (export it before starting, never put the key in the config)")
    return _check_key(key, f"{what}={name!r}")


def wait_all(futures: Sequence[cf.Future], timeout: float, what: str) -> list[Any]:
    """Results of all futures (calls to several servers); the first failure (or a timeout) raises."""
    done, pending = cf.wait(futures, timeout=timeout, return_when=cf.FIRST_EXCEPTION)
    for f in futures:
        if f in done and f.exception() is not None:
            raise f.exception()
    if pending:
        raise EngineError(f"{what}: {len(pending)} of {len(futures)} calls unfinished after {timeout:.0f} s")
    return [f.result() for f in futures]


def _positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value > 0 and math.isfinite(value)):
        raise ValueError(f"SGLangClient {name} must be a positive finite number of seconds, got {value!r}")


class SGLangClient:
    """One SGLang server's HTTP API. `timeout_s` bounds each socket operation of a call;
    `retries` (with `retry_backoff_s`) applies to idempotent calls only (module docstring);
    `api_key`: sent as `Authorization: Bearer <key>`."""

    def __init__(self, url: str, timeout_s: float = 60.0, *, api_key: str | None = None, retries: int = 0,
                 retry_backoff_s: float = 0.5):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"SGLangClient url must start with http:// or https://, got {url!r}")
        _positive("timeout_s", timeout_s)
        _positive("retry_backoff_s", retry_backoff_s)
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise ValueError(f"SGLangClient retries must be an integer >= 0, got {retries!r}")
        self.url = url.rstrip("/")
        self.timeout_s, self.retries, self.retry_backoff_s = timeout_s, retries, retry_backoff_s
        self._auth = {} if api_key is None else {"Authorization": f"Bearer {_check_key(api_key, 'SGLangClient')}"}

    def __repr__(self) -> str:
        return f"SGLangClient({self.url!r})"

    def __reduce__(self):  # the key stays in this process: a pickled client must be given it again
        raise TypeError("an SGLangClient is not picklable (it may hold an API key); pass its url and build one")

    def call(self, method: str, path: str, payload: Any = None, *, timeout: float | None = None,
             idempotent: bool = False, retries: int | None = None, caller_retries: bool = False) -> Any:
        """One request; returns the decoded JSON (or text, or None for an empty body). An `idempotent`
        one is retried after a transient failure (`retries`; None: the client's). `caller_retries`:
        the caller decides on sending it again (/generate: the engine, with fresh rids), so the
        error does not say "not retried"."""
        url = self.url + path
        data = None if payload is None else json.dumps(payload).encode()
        headers = {**self._auth, **({"Content-Type": "application/json"} if data is not None else {})}
        timeout = self.timeout_s if timeout is None else timeout
        attempts = 1 + (self.retries if retries is None else retries) if idempotent else 1
        delay = self.retry_backoff_s
        for attempt in range(1, attempts + 1):
            try:
                return self._once(method, url, data, headers, timeout)
            except SGLangError as e:
                if not e.transient:
                    raise
                if attempt < attempts:
                    time.sleep(min(delay, MAX_BACKOFF_S))
                    delay *= 2
                    continue
                if not idempotent and caller_retries:
                    raise
                if not idempotent:
                    how = f"not retried ({method} {path} is not idempotent)"
                elif attempts == 1:
                    how = "not retried (retries=0)"
                else:
                    how = f"gave up after {attempts} attempts ({attempts - 1} retries)"
                raise type(e)(f"{e}; {how}", url=e.url, status=e.status, body=e.body, transient=True) from e.__cause__

    def _once(self, method: str, url: str, data: bytes | None, headers: dict[str, str], timeout: float) -> Any:
        req = urllib.request.Request(url, data=data, method=method, headers=headers)
        try:
            with _OPENER.open(req, timeout=timeout) as resp:
                body = _decode(resp.read())
        except urllib.error.HTTPError as e:
            text = e.read().decode("utf-8", errors="replace")
            hint = " (the server wants an API key: set rollout.sglang.api_key_env)" if e.code == 401 and not self._auth \
                else " (the server refused our API key)" if e.code in (401, 403) else ""
            raise SGLangError(f"{method} {url} failed: HTTP {e.code} {e.reason}{hint}", url=url, status=e.code, body=text,
                              transient=e.code in TRANSIENT_STATUSES) from None
        except (TimeoutError, socket.timeout) as e:
            raise SGLangTimeout(f"{method} {url}: no answer within {timeout:g} s", url=url, transient=True) from e
        except urllib.error.URLError as e:
            if isinstance(e.reason, (TimeoutError, socket.timeout)):
                raise SGLangTimeout(f"{method} {url}: no answer within {timeout:g} s", url=url, transient=True) from e
            raise SGLangError(f"{method} {url}: cannot reach the server ({e.reason})", url=url, transient=True) from e
        except http.client.IncompleteRead as e:
            raise SGLangError(f"{method} {url}: the answer was cut off after {len(e.partial)} bytes "
                              f"({e.expected} more were announced)", url=url, transient=True) from None
        except (ConnectionError, OSError) as e:  # reset or closed mid-answer, etc.
            raise SGLangError(f"{method} {url}: connection failed ({e!r})", url=url, transient=True) from e
        except http.client.HTTPException as e:  # a malformed status line or headers
            raise SGLangError(f"{method} {url}: malformed HTTP answer ({type(e).__name__}: {e})", url=url,
                              transient=True) from e
        if isinstance(body, dict) and body.get("success") is False:
            raise SGLangError(f"{method} {url} failed", url=url, status=200, body=json.dumps(body))
        return body

    def _object(self, path: str, body: Any) -> dict:
        if not isinstance(body, dict):
            raise SGLangError(f"GET {self.url}{path}: the answer is not a JSON object", url=self.url + path,
                              body=str(body)[:2000])
        return body

    def _get_first(self, paths: Sequence[str], timeout: float | None = None) -> dict:
        """GET the first path the server has (0.5.23 renamed /get_model_info to /model_info): a JSON object."""
        for path in paths[:-1]:
            try:
                return self._object(path, self.call("GET", path, timeout=timeout, idempotent=True))
            except SGLangError as e:
                if e.status != 404:
                    raise
        return self._object(paths[-1], self.call("GET", paths[-1], timeout=timeout, idempotent=True))

    # --- state ---------------------------------------------------------------------------

    def is_healthy(self, timeout: float = 30.0, path: str = "/health", retries: int | None = None) -> bool:
        """GET /health (or /health_generate) answers 200 (after up to `retries` retries; None: the
        client's); never raises."""
        try:
            self.call("GET", path, timeout=timeout, idempotent=True, retries=retries)
            return True
        except SGLangError:
            return False

    def model_info(self, timeout: float | None = None) -> dict:
        """GET /model_info (/get_model_info on older servers)."""
        return self._get_first(("/model_info", "/get_model_info"), timeout)

    def server_info(self, timeout: float | None = None) -> dict:
        """GET /server_info (/get_server_info on older servers): the server args, tp_size among them."""
        return self._get_first(("/server_info", "/get_server_info"), timeout)

    def weight_version(self, timeout: float | None = None) -> str:
        """The server's weight version string (model_info's "weight_version"; "default" if absent)."""
        return str(self.model_info(timeout).get("weight_version", "default"))

    # --- generation ----------------------------------------------------------------------

    def generate(self, payload: Mapping[str, Any], timeout: float | None = None) -> list[dict]:
        """POST /generate (non-streaming); always a list of answers, in rid order."""
        out = self.call("POST", "/generate", dict(payload), timeout=timeout, caller_retries=True)
        url = self.url + "/generate"
        if isinstance(out, dict):
            out = [out]
        if not isinstance(out, list):
            what = "not JSON" if isinstance(out, str) else "empty" if out is None else f"a JSON {type(out).__name__}"
            raise SGLangError(f"POST {url}: the answer is {what}, not an object or a list of them", url=url, body=str(out)[:2000])
        for i, o in enumerate(out):
            if not isinstance(o, dict) or not isinstance(o.get("meta_info"), dict):
                got = "missing" if isinstance(o, dict) and "meta_info" not in o else \
                    f"{type(o.get('meta_info')).__name__}" if isinstance(o, dict) else f"a {type(o).__name__} answer"
                raise SGLangError(f"POST {url}: answer {i} of {len(out)} has no meta_info object ({got})", url=url,
                                  body=str(out)[:2000])
        return out

    def abort_request(self, rid: str = "", abort_all: bool = False, timeout: float | None = None) -> None:
        """End one request (its exact rid) or, with abort_all, every request on the server."""
        if not rid and not abort_all:
            raise ValueError("abort_request needs a rid or abort_all=True")
        self.call("POST", "/abort_request", {"rid": rid, "abort_all": abort_all}, timeout=timeout)

    def pause_generation(self, mode: str, timeout: float | None = None) -> None:
        """mode "in_place" (keep KV), "retract" (requests back to the queue) or "abort" (end them all)."""
        if mode not in ("in_place", "retract", "abort"):
            raise ValueError(f"pause mode must be 'in_place', 'retract' or 'abort', got {mode!r}")
        self.call("POST", "/pause_generation", {"mode": mode}, timeout=timeout)

    def continue_generation(self, timeout: float | None = None) -> None:
        """POST /continue_generation: decode again after a pause."""
        self.call("POST", "/continue_generation", {}, timeout=timeout)

    def flush_cache(self, timeout: float | None = None) -> str:
        """Drop the prefix cache; fails (400) while requests run."""
        return self.call("POST", "/flush_cache", timeout=timeout, idempotent=True) or ""

    # --- weights -------------------------------------------------------------------------

    def init_weights_update_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int,
        group_name: str = "weight_update_group", backend: str = "nccl", timeout: float | None = None,
    ) -> dict:
        """Join the learner's broadcast group as ranks rank_offset .. rank_offset + tp_size - 1.
        Blocks until every rank has joined."""
        payload = init_group_payload(master_address, master_port, rank_offset, world_size, group_name, backend)
        return self.call("POST", "/init_weights_update_group", payload, timeout=timeout)

    def begin_weight_update(self, selector: str = "all", timeout: float | None = None) -> bool:
        """Open a weight-update session (0.5.23 refuses updates outside one); False for an older server."""
        try:
            self.call("POST", "/begin_weight_update", {"selector": selector}, timeout=timeout)
            return True
        except SGLangError as e:
            if e.status == 404:
                return False
            raise

    def end_weight_update(self, timeout: float | None = None) -> dict:
        """Close the weight-update session."""
        return self.call("POST", "/end_weight_update", {}, timeout=timeout)

    def update_weights_from_distributed(
        self, names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]], *,
        group_name: str = "weight_update_group", flush_cache: bool = False, weight_version: str | None = None,
        load_format: str | None = "flattened_bucket", abort_all_requests: bool = False, timeout: float | None = None,
    ) -> dict:
        """Receive tensors broadcast from rank 0 of the group (one flat bucket when load_format is
        "flattened_bucket", else one broadcast per tensor, in order) and load them."""
        payload = update_weights_payload(
            names, dtypes, shapes, group_name=group_name, flush_cache=flush_cache, weight_version=weight_version,
            load_format=load_format, abort_all_requests=abort_all_requests,
        )
        return self.call("POST", "/update_weights_from_distributed", payload, timeout=timeout)

    def update_weights_from_tensor(
        self, serialized_named_tensors: Sequence[str], *, flush_cache: bool = False, weight_version: str | None = None,
        load_format: str | None = None, abort_all_requests: bool = False, timeout: float | None = None,
    ) -> dict:
        """Load tensors that lie in this host's shared memory (one payload per TP rank:
        tensor_payload.serialize_named_tensors); the server copies them before it answers."""
        payload = update_weights_from_tensor_payload(
            serialized_named_tensors, flush_cache=flush_cache, weight_version=weight_version,
            load_format=load_format, abort_all_requests=abort_all_requests,
        )
        return self.call("POST", "/update_weights_from_tensor", payload, timeout=timeout)

    def destroy_weights_update_group(self, group_name: str = "weight_update_group", timeout: float | None = None) -> dict:
        """Leave the broadcast group."""
        return self.call("POST", "/destroy_weights_update_group", {"group_name": group_name}, timeout=timeout)

    def update_weight_version(self, new_version: str, abort_all_requests: bool = False, timeout: float | None = None) -> dict:
        """Relabel the weights (SGLang's own default aborts every request; ours does not)."""
        body = {"new_version": str(new_version), "abort_all_requests": abort_all_requests}
        return self.call("POST", "/update_weight_version", body, timeout=timeout)
