"""One SGLang server's HTTP API (`SGLangClient`), its errors, and calls to several servers at once.

Standard library only, proxies bypassed. Every call has a timeout; a failed call raises
`SGLangError` (`SGLangTimeout` when no answer came) carrying the server's answer as a note.
The endpoints and bodies are those of `protocol.py`. Nothing here imports sglang.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import socket
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

from entr_megatron.rollout.engine import EngineError
from entr_megatron.rollout.sglang.protocol import init_group_payload, update_weights_payload

__all__ = ["SGLangClient", "SGLangError", "SGLangTimeout", "wait_all"]


class SGLangError(EngineError):
    """An SGLang server answered with an error or not at all; its answer is in the notes."""

    def __init__(self, message: str, *, url: str, status: int | None = None, body: str | None = None):
        super().__init__(message)
        self.url, self.status, self.body = url, status, body
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


def wait_all(futures: Sequence[cf.Future], timeout: float, what: str) -> list[Any]:
    """Results of all futures (calls to several servers); the first failure (or a timeout) raises."""
    done, pending = cf.wait(futures, timeout=timeout, return_when=cf.FIRST_EXCEPTION)
    for f in futures:
        if f in done and f.exception() is not None:
            raise f.exception()
    if pending:
        raise EngineError(f"{what}: {len(pending)} of {len(futures)} calls unfinished after {timeout:.0f} s")
    return [f.result() for f in futures]


class SGLangClient:
    """One SGLang server's HTTP API. `timeout_s` bounds each socket operation of a call."""

    def __init__(self, url: str, timeout_s: float = 60.0):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"SGLangClient url must start with http:// or https://, got {url!r}")
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s

    def __repr__(self) -> str:
        return f"SGLangClient({self.url!r})"

    def call(self, method: str, path: str, payload: Any = None, *, timeout: float | None = None) -> Any:
        """One request; returns the decoded JSON (or text, or None for an empty body)."""
        url = self.url + path
        data = None if payload is None else json.dumps(payload).encode()
        headers = {"Content-Type": "application/json"} if data is not None else {}
        req = urllib.request.Request(url, data=data, method=method, headers=headers)
        timeout = self.timeout_s if timeout is None else timeout
        try:
            with _OPENER.open(req, timeout=timeout) as resp:
                body = _decode(resp.read())
        except urllib.error.HTTPError as e:
            text = e.read().decode("utf-8", errors="replace")
            raise SGLangError(f"{method} {url} failed: HTTP {e.code} {e.reason}", url=url, status=e.code, body=text) from None
        except (TimeoutError, socket.timeout) as e:
            raise SGLangTimeout(f"{method} {url}: no answer within {timeout:g} s", url=url) from e
        except urllib.error.URLError as e:
            if isinstance(e.reason, (TimeoutError, socket.timeout)):
                raise SGLangTimeout(f"{method} {url}: no answer within {timeout:g} s", url=url) from e
            raise SGLangError(f"{method} {url}: cannot reach the server ({e.reason})", url=url) from e
        except (ConnectionError, OSError) as e:  # reset mid-answer, etc.
            raise SGLangError(f"{method} {url}: connection failed ({e!r})", url=url) from e
        if isinstance(body, dict) and body.get("success") is False:
            raise SGLangError(f"{method} {url} failed", url=url, status=200, body=json.dumps(body))
        return body

    def _get_first(self, paths: Sequence[str], timeout: float | None = None) -> Any:
        """GET the first path the server has (0.5.23 renamed /get_model_info to /model_info)."""
        for path in paths[:-1]:
            try:
                return self.call("GET", path, timeout=timeout)
            except SGLangError as e:
                if e.status != 404:
                    raise
        return self.call("GET", paths[-1], timeout=timeout)

    # --- state ---------------------------------------------------------------------------

    def is_healthy(self, timeout: float = 30.0, path: str = "/health") -> bool:
        """GET /health (or /health_generate) answers 200; never raises."""
        try:
            self.call("GET", path, timeout=timeout)
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
        out = self.call("POST", "/generate", dict(payload), timeout=timeout)
        if isinstance(out, dict):
            out = [out]
        if not isinstance(out, list) or not all(isinstance(o, dict) and "meta_info" in o for o in out):
            raise SGLangError("POST /generate: unexpected answer", url=self.url + "/generate", body=str(out)[:2000])
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
        return self.call("POST", "/flush_cache", timeout=timeout) or ""

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

    def destroy_weights_update_group(self, group_name: str = "weight_update_group", timeout: float | None = None) -> dict:
        """Leave the broadcast group."""
        return self.call("POST", "/destroy_weights_update_group", {"group_name": group_name}, timeout=timeout)

    def update_weight_version(self, new_version: str, abort_all_requests: bool = False, timeout: float | None = None) -> dict:
        """Relabel the weights (SGLang's own default aborts every request; ours does not)."""
        body = {"new_version": str(new_version), "abort_all_requests": abort_all_requests}
        return self.call("POST", "/update_weight_version", body, timeout=timeout)
