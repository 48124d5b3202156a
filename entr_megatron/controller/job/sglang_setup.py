"""What the training job decides about its SGLang servers before and around them (the servers
themselves: sglang_servers.py): where they may be launched (`check_launch`), the wire dtype, the
vocabulary size and MoE route layout of the model, and the controller's view of their weight version.

The controller drives the servers through an SGLangEngine for generation only; weight updates run
on learner rank 0, whose SGLangTransport holds a second SGLangEngine over the same servers (built
from the same, picklable SGLangEngineConfig) and performs the whole handshake (pause,
/init_weights_update_group, /update_weights_from_distributed per bucket, the version on the last
one, resume). An SGLangEngine's `weight_version` advances only on updates it performs itself, so
the controller's would stay at its start value: the controller sees it through a
`PushedVersionView`, whose version is the last one a push delivered. When the ranks' `wait_push`
returns, rank 0's SGLangTransport.send has returned, i.e. every server has loaded the last
bucket, which carried the version; that is when the pusher's `on_delivered` confirms it
(wiring.connect_sglang). (Asking the servers instead would cost an HTTP round trip per server at
every submit, and would read a version torn across servers while an update is under way.)

MoE routes (rollout.record_routes, or algorithm.routing_replay 'r3'): the engine asks every
/generate for them in the layout of the model's config.json (`route_layout`); servers launched
here get --enable-return-routed-experts, servers given by URL must have been started with it.
A dense model records nothing (no flag, nothing asked).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from entr_megatron.config.run import RunConfig
from entr_megatron.rollout.engine import (
    EngineGroup,
    EngineHealth,
    GenerateRequest,
    GenerateResult,
    WeightSource,
    WeightUpdateReport,
)
from entr_megatron.rollout.sglang import RouteLayout

__all__ = ["PushedVersionView", "check_launch", "forget_server_versions", "model_vocab_size", "route_layout",
           "sglang_wire_dtype"]


def sglang_wire_dtype(cfg: RunConfig) -> str | None:
    """What the weights travel as: the engine's dtype when it differs from the learner's ('auto':
    the learner's; SGLang casts to its own dtype when loading)."""
    d = cfg.rollout.dtype
    return None if d in ("auto", cfg.model.dtype) else d


def model_vocab_size(model_dir: Path) -> int | None:
    """The HF config's vocab_size (the logits' width: every sampled token id is below it); None if unknown."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    size = config.get("vocab_size", (config.get("text_config") or {}).get("vocab_size"))
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None


def route_layout(model_dir: Path) -> RouteLayout | None:
    """What SGLang reports as a sample's routes for the model in `model_dir` (its config.json, read
    by the model family) and which of its layers we keep; None for a dense model. Raises
    ValueError when the config cannot be read (routes are asked for, so the layout must be known)."""
    from entr_megatron import models

    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"rollout.record_routes: cannot read the model config {path} for the MoE route layout: {e}") from None
    spec = models.model_spec(config)
    if not spec.is_moe:
        return None
    # SGLang reports a column for every decoder layer (num_hidden_layers); ours are the MoE ones.
    # With dense first layers (glm4_moe, deepseek_v3: first_k_dense_replace) those columns are
    # dropped; a model whose every layer is MoE keeps all of them (moe_layers None).
    moe_layers = spec.moe_layers if spec.first_k_dense else None
    return RouteLayout(num_layers=spec.num_layers, top_k=spec.moe_router_topk, num_experts=spec.num_experts,
                       moe_layers=moe_layers)


def check_launch(cfg: RunConfig) -> None:
    """Launching servers here needs the learner and the servers on this one node (local launcher)."""
    r, launcher = cfg.rollout, cfg.launcher
    if r.engine != "sglang" or r.sglang.urls is not None:
        return
    if launcher.kind != "local" or launcher.nnodes > 1 or launcher.engine_nodes > 0:
        raise ValueError(
            f"rollout.sglang.urls=null: `train` launches SGLang servers on its own node only, beside a one-node "
            f"local learner (launcher.kind='local', nnodes=1, engine_nodes=0; got kind={launcher.kind!r}, "
            f"nnodes={launcher.nnodes}, engine_nodes={launcher.engine_nodes}). Start the servers on their nodes "
            "(python -m sglang.launch_server ...) and list them in rollout.sglang.urls")


def forget_server_versions(cfg: RunConfig) -> None:
    """Servers given by URL hold weights we know nothing of: label them version -1, so that the
    learner's weights are pushed (as its version) before the first rollout."""
    from entr_megatron.rollout.sglang import SGLangClient, SGLangError
    from entr_megatron.rollout.sglang.client import api_key_from_env

    s = cfg.rollout.sglang
    key = api_key_from_env(s.api_key_env)
    for url in s.urls or ():
        try:
            client = SGLangClient(url, s.request_timeout_s, api_key=key, retries=s.http_retries,
                                  retry_backoff_s=s.retry_backoff_s)
            client.update_weight_version("-1", abort_all_requests=False)
        except SGLangError as e:
            if e.status != 404:  # a server without versions: nothing to relabel
                raise


class PushedVersionView:
    """The controller's `RolloutEngine` over SGLang servers that learner rank 0 updates: requests,
    aborts and pauses go to `engine`; `weight_version` is the last version a push delivered
    (`confirm_version`), `engine`'s own until the first (see the module docstring). `servers`:
    the run's `SGLangServers` (sglang_servers.py)."""

    def __init__(self, engine: EngineGroup, servers: Any = None):
        self.engine, self.servers = engine, servers
        self._pushed: int | None = None

    def confirm_version(self, version: int) -> None:
        """Every server holds `version` (the pusher's `on_delivered`)."""
        self._pushed = version if self._pushed is None else max(self._pushed, version)

    def reset_version(self, version: int) -> None:
        """The servers were relabelled `version` (new learner ranks push an older version next)."""
        self._pushed = version

    def is_live(self, request_id: str) -> bool:
        return self.engine.is_live(request_id)

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version if self._pushed is None else self._pushed

    def health(self) -> EngineHealth:
        return dataclasses.replace(self.engine.health(), weight_version=self.weight_version)

    def submit(self, requests: Sequence[GenerateRequest]) -> list[str]:
        return self.engine.submit(requests)

    def poll(self, timeout: float | None = 0.0) -> list[GenerateResult]:
        return self.engine.poll(timeout)

    def abort(self, request_ids: Iterable[str]) -> None:
        self.engine.abort(request_ids)

    def pause(self) -> None:
        self.engine.pause()

    def resume(self) -> None:
        self.engine.resume()

    def update_weights(self, weights: WeightSource, version: int) -> WeightUpdateReport:
        return self.engine.update_weights(weights, version)

    def shutdown(self) -> None:
        self.engine.shutdown()
