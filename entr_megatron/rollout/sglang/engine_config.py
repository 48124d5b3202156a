"""`SGLangEngineConfig`: how an `SGLangEngine` (engine.py) reaches and drives a set of SGLang
servers: their URLs or router, timeouts and retries, the pause mode of a weight update, the
weight bucket and its dtype, what answers are checked against (vocabulary, MoE routes).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from entr_megatron.config.rollout import DEFAULT_WEIGHT_BUCKET_MIB, RolloutConfig
from entr_megatron.rollout.sglang.answers import RouteLayout
from entr_megatron.rollout.sglang.protocol import KV_ON_UPDATE

__all__ = ["SGLangEngineConfig", "pushes_in_flight"]


def pushes_in_flight(mode: str) -> bool:
    """Whether controller mode `mode` pushes weights while the engines generate (controller/rl/loop.py:
    fully_async swaps in flight; sync, one_step_off and fixed_lag push between rounds, engines idle)."""
    return mode == "fully_async"


@dataclass(frozen=True)
class SGLangEngineConfig:
    """How to reach and drive a set of SGLang servers."""

    urls: tuple[str, ...]
    """Every server (http://host:port); control calls go to each."""
    router_url: str | None = None
    """sglang-router in front of `urls`: /generate goes there."""
    request_timeout_s: float = 60.0
    """Control calls (abort, pause, info, health)."""
    generate_timeout_s: float = 3600.0
    """One /generate call (a whole non-streamed group of samples)."""
    weight_update_timeout_s: float = 1800.0
    """Group set-up and each bucket of a weight update."""
    retries: int = 3
    """Retries of an idempotent call after a transient failure (client.py); /generate has none."""
    retry_backoff_s: float = 0.5
    """Wait before the first retry; doubled for each next one (at most client.MAX_BACKOFF_S)."""
    api_key_env: str | None = None
    """Environment variable holding the servers' --api-key, sent as `Authorization: Bearer`
    (None: no key). The key itself is read when the engine is built, in every process that
    builds one (learner rank 0 too), and is never part of this config."""
    vocab_size: int | None = None
    """Token ids of an answer must lie in [0, vocab_size); None: only >= 0 is checked."""
    max_concurrent_requests: int = 256
    """/generate calls in flight at once (one per GenerateRequest; the rest wait)."""
    kv_on_update: str = "recompute"
    """See KV_ON_UPDATE: "recompute" (SGLang "retract" pause) or "keep" ("in_place")."""
    pause_for_updates: bool = True
    """Pause the servers around a weight update (`kv_on_update`'s mode) and continue them after.
    False where nothing generates during a push (the controller modes that push between rounds:
    sync, one_step_off, fixed_lag), which saves two HTTP round trips per version; a request that
    does run then makes SGLang's update wait for it (its writer lock), as its own default does."""
    group_name: str = "weight_update_group"
    weight_bucket_bytes: int = DEFAULT_WEIGHT_BUCKET_MIB << 20
    weight_dtype: str | None = None
    """Cast floating tensors to this torch dtype name while packing (e.g. "bfloat16"); None: as given."""
    flattened_buckets: bool = True
    """One broadcast per bucket (load_format "flattened_bucket"); False: one per tensor (old servers)."""
    tp_sizes: tuple[int, ...] | None = None
    """Ranks per server in the weight group; None: ask each server (/server_info tp_size)."""
    initial_version: int = 0
    """Version of the servers' weights before any update; a non-numeric server version is set to it."""
    abort_retry_s: float = 0.5
    """Re-send aborts this often until the request ends (an abort arriving before the server
    registered the rid is ignored by SGLang)."""
    routes: RouteLayout | None = None
    """Record MoE routes (`GenerateResult.routed_experts`) of this layout: every /generate asks
    for them, and an answer without them is refused (the servers need protocol.ROUTES_FLAG).
    None: off (and for dense models)."""

    @classmethod
    def from_config(cls, rollout: RolloutConfig, urls: Sequence[str], *, router_url: str | None = None,
                    tp_sizes: tuple[int, ...] | None = None, weight_dtype: str | None = None,
                    routes: RouteLayout | None = None, mode: str | None = None, **overrides: Any) -> SGLangEngineConfig:
        """The engine over `urls` of the run's validated `rollout` section (kv_on_update, the weight
        bucket size and `rollout.sglang.max_concurrent_requests`, per server); `routes`: the
        model's route layout when routes are recorded (controller/job/sglang_setup.py); `mode`: the
        controller's (`pause_for_updates`; None: pause)."""
        s = rollout.sglang
        fields = dict(urls=tuple(urls), router_url=router_url, tp_sizes=tp_sizes, weight_dtype=weight_dtype, routes=routes,
                      max_concurrent_requests=s.max_concurrent_requests * len(urls),
                      kv_on_update=rollout.kv_on_update or "recompute",
                      pause_for_updates=pushes_in_flight(mode) if mode is not None else True,
                      weight_bucket_bytes=rollout.weight_bucket_bytes,
                      request_timeout_s=s.request_timeout_s, generate_timeout_s=s.generate_timeout_s,
                      weight_update_timeout_s=s.weight_update_timeout_s, retries=s.http_retries,
                      retry_backoff_s=s.retry_backoff_s, api_key_env=s.api_key_env)
        return cls(**{**fields, **overrides})

    def __post_init__(self):
        if not isinstance(self.pause_for_updates, bool):
            raise ValueError(f"SGLangEngineConfig.pause_for_updates must be a bool, got {self.pause_for_updates!r}")
        if not self.urls:
            raise ValueError("SGLangEngineConfig.urls is empty: give at least one server")
        if self.kv_on_update not in KV_ON_UPDATE:
            raise ValueError(f"SGLangEngineConfig.kv_on_update must be one of {sorted(KV_ON_UPDATE)}, got {self.kv_on_update!r}")
        if self.max_concurrent_requests < 1:
            raise ValueError(f"SGLangEngineConfig.max_concurrent_requests must be >= 1, got {self.max_concurrent_requests}")
        if self.weight_bucket_bytes <= 0:
            raise ValueError(f"SGLangEngineConfig.weight_bucket_bytes must be positive, got {self.weight_bucket_bytes}")
        if self.weight_dtype is not None and not isinstance(getattr(torch, self.weight_dtype, None), torch.dtype):
            raise ValueError(f"SGLangEngineConfig.weight_dtype must be a torch dtype name, got {self.weight_dtype!r}")
        if self.tp_sizes is not None and (len(self.tp_sizes) != len(self.urls) or min(self.tp_sizes) < 1):
            raise ValueError(f"SGLangEngineConfig.tp_sizes must give a size >= 1 per url, got {self.tp_sizes}")
        for name in ("request_timeout_s", "generate_timeout_s", "weight_update_timeout_s", "abort_retry_s",
                     "retry_backoff_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value > 0 and math.isfinite(value)):
                raise ValueError(f"SGLangEngineConfig.{name} must be a positive finite number of seconds, got {value!r}")
        if isinstance(self.retries, bool) or not isinstance(self.retries, int) or self.retries < 0:
            raise ValueError(f"SGLangEngineConfig.retries must be an integer >= 0, got {self.retries!r}")
        if self.vocab_size is not None and (isinstance(self.vocab_size, bool) or not isinstance(self.vocab_size, int)
                                            or self.vocab_size < 1):
            raise ValueError(f"SGLangEngineConfig.vocab_size must be None or an integer >= 1, got {self.vocab_size!r}")
        if self.routes is not None and not isinstance(self.routes, RouteLayout):
            raise ValueError(f"SGLangEngineConfig.routes must be None or an answers.RouteLayout, got {self.routes!r}")
