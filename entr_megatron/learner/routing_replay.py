"""MoE routing replay: megatron-core's `RouterReplay`, fed the routes of each packed micro-batch.

    engine: Sample.routed_experts [P+R-1, moe_layers, k]  --TrainBatch.from_samples-->  TrainBatch.extras
    batch routes [T, moe_layers, k] (token positions; -1: none)
      -> select_sequences / split_for_data_parallel carry them with their sequences
      -> each micro-batch: routes[source_index] (padding: -1), this rank's SP slice, this stage's layers
      -> before the chunk's forward: RouterReplay.set_target_indices + REPLAY_FORWARD
      -> the router runs its own top-k too (kept for routing/disagree_frac), then the replayed
         experts' gate probabilities are gathered from the recomputed scores (differentiable)

Modes (`AlgorithmConfig.routing_replay`): 'r3' replays the engine's routes in every
forward (the old-policy scoring and the training step); 'r2' records the learner's own
routes when `compute_logprobs` scores the old policy (`OLD_POLICY_ROUTES`) and replays
them in the training forwards of the same batch. Tokens without a route (-1: padding,
each sequence's last token, which no log-prob depends on) keep the learner's own choice.

Megatron's `TopKRouter` builds a `RouterReplay` per MoE layer when the config has
`moe_enable_routing_replay`; `install` swaps it for `LayerReplay` (a subclass that
also keeps the router's own top-k in replay mode, and knows its MoE layer) and drops both
from megatron's process-wide list: the layers are addressed through the model they belong
to, never through a global (several models live in one process in tests).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction
from torch import Tensor

from entr_megatron.algorithm.metrics import DEFAULT_ENTROPY_BIN_EDGES, entropy_bin_index, entropy_bin_labels
from entr_megatron.learner.batching import OLD_POLICY_ROUTES, MicroBatch
from entr_megatron.learner.hf_load import unwrap_chunk
from entr_megatron.types import ENGINE_ROUTES, NO_ROUTE, TrainBatch

__all__ = ["LayerReplay", "ReplayStep", "install", "moe_layer_numbers", "replay_mode"]

_MODE = "_entr_routing_replay"
"""Attribute of a GPTModel chunk: the routing replay mode it was installed with."""


def moe_layer_numbers(config) -> list[int]:
    """Megatron layer numbers (1-based, global) of the MoE layers, in order: the route tensors'
    ``moe_layers`` dimension (HF numbers its MoE blocks in the same order)."""
    freq = config.moe_layer_freq
    pattern = [1 if i % freq == 0 else 0 for i in range(config.num_layers)] if isinstance(freq, int) else list(freq)
    return [i + 1 for i, moe in enumerate(pattern) if moe]


class LayerReplay(RouterReplay):
    """One MoE layer's `RouterReplay` that, replaying, still computes the router's own top-k
    (``recorded_topk_idx``, for the disagreement metric) and lets rows without a target
    (`NO_ROUTE`) keep it. In RECORD mode it is megatron's class as is."""

    def __init__(self, moe_index: int, layer_number: int):
        super().__init__()
        _forget(self)
        self.moe_index = moe_index
        """Position of this layer among the model's MoE layers (the routes' dimension 1)."""
        self.layer_number = layer_number
        self.given: Tensor | None = None
        """The target rows as set (before own routes fill the -1 rows), for the metric."""

    def get_replay_topk(self, scores: Tensor, topk: int, num_groups: int | None = None, group_topk: int | None = None,
                        default_compute_topk: Callable | None = None) -> tuple[Tensor, Tensor]:
        if self.router_replay_action != RouterReplayAction.REPLAY_FORWARD:
            return super().get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)
        _, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        self.record_indices(own)
        target = self.target_topk_idx.to(device=own.device, dtype=own.dtype)
        assert target.shape == own.shape, f"layer {self.layer_number}: {tuple(target.shape)} routes, {tuple(own.shape)}"
        self.target_topk_idx = torch.where(target[:, :1] >= 0, target, own)
        return super().get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)


def _forget(replay: RouterReplay) -> None:
    instances = RouterReplay.global_router_replay_instances
    for i, r in enumerate(instances):
        if r is replay:
            del instances[i]
            return


def install(model_chunks, mode: str) -> None:
    """Give every MoE router of ``model_chunks`` (built with ``moe_enable_routing_replay``) a
    `LayerReplay`, and mark the chunks with ``mode`` ('r2' or 'r3')."""
    assert mode in ("r2", "r3"), mode
    config = unwrap_chunk(model_chunks[0]).config
    if not config.moe_enable_routing_replay:
        raise ValueError("routing replay needs the learner built with moe_enable_routing_replay=True "
                         "(build_learner_model_from_hf(..., routing_replay=...))")
    if config.recompute_granularity is not None:
        raise ValueError("routing replay with activation recomputation is not supported (the recomputed "
                         "forward would need megatron's REPLAY_BACKWARD, which is not wired)")
    if config.moe_router_fusion or config.moe_router_load_balancing_type == "sinkhorn":
        raise ValueError("routing replay needs the unfused top-k router (moe_router_fusion=False, no sinkhorn)")
    index = {n: i for i, n in enumerate(moe_layer_numbers(config))}
    for chunk in model_chunks:
        for m in unwrap_chunk(chunk).modules():
            if isinstance(m, TopKRouter) and not isinstance(m.router_replay, LayerReplay):
                _forget(m.router_replay)
                m.router_replay = LayerReplay(index[m.layer_number], m.layer_number)
        setattr(unwrap_chunk(chunk), _MODE, mode)


def replay_mode(model_chunks) -> str:
    """'off', or the mode `install` gave the chunks."""
    return getattr(unwrap_chunk(model_chunks[0]), _MODE, "off")


def _layers(chunk) -> list[LayerReplay]:
    return [m.router_replay for m in chunk.modules() if isinstance(m, TopKRouter)
            and isinstance(m.router_replay, LayerReplay)]


class ReplayStep:
    """Routing replay over one schedule run (`train_step` or `compute_logprobs`).

    `before_forward` / `after_forward` wrap each chunk's forward of a micro-batch: they set
    the replay targets (or RECORD), then read the router's own top-k: into the recorded
    routes (`record`) and, where targets were given, into the disagreement counts.
    """

    def __init__(self, model_chunks, batch: TrainBatch, groups, routes: Tensor | None, record: bool):
        config = unwrap_chunk(model_chunks[0]).config
        self.layer_numbers = moe_layer_numbers(config)
        self.topk = config.moe_router_topk
        self.routes = routes
        if routes is not None:
            want = (batch.tokens_T.numel(), len(self.layer_numbers), self.topk)
            if tuple(routes.shape) != want:
                raise ValueError(f"routes of shape {tuple(routes.shape)} for a batch and model that need {want} "
                                 "[tokens, moe_layers, k]")
            if int(routes.max()) >= config.num_moe_experts:
                raise ValueError(f"routes name expert {int(routes.max())}; the model has {config.num_moe_experts}")
        shape = (batch.tokens_T.numel(), len(self.layer_numbers), self.topk)
        self.recorded = torch.full(shape, NO_ROUTE, dtype=torch.int16) if record else None
        self.sp = config.sequence_parallel and groups.tp_size > 1
        self.tp_rank, self.tp_size = groups.tp_rank, groups.tp_size
        self.layers = {id(c): _layers(c) for c in model_chunks}
        self.disagree = torch.zeros(len(self.layer_numbers), dtype=torch.float64)
        self.counted = torch.zeros(len(self.layer_numbers), dtype=torch.float64)
        # Per entropy bin of the engine's next-token entropy, policy tokens only (a route at token
        # position j shapes the distribution of target j): None without the rollout entropy.
        self.bin_of = None
        if batch.rollout_entropy_T is not None:
            bins = entropy_bin_index(batch.rollout_entropy_T.double())
            self.bin_of = torch.where(batch.loss_mask_T.bool(), bins, -1)
        self.bin_disagree = torch.zeros(len(DEFAULT_ENTROPY_BIN_EDGES) - 1, dtype=torch.float64)
        self.bin_counted = torch.zeros_like(self.bin_disagree)

    @classmethod
    def for_batch(cls, model_chunks, batch: TrainBatch, groups, scoring: bool,
                  mode: str | None = None) -> ReplayStep | None:
        """The replay of a `train_step` (``scoring=False``) or `compute_logprobs` on ``batch``;
        None without routing replay. ``mode``: the algorithm's (None: the installed one); 'off'
        routes without replay (e.g. an SFT phase), another mode must be the installed one."""
        installed = replay_mode(model_chunks)
        if mode == "off":
            return None
        if mode is not None and mode != installed:
            raise ValueError(f"algorithm.routing_replay={mode!r} but the learner was built with {installed!r} "
                             "(build_learner_model_from_hf(..., routing_replay=algorithm.routing_replay))")
        if installed == "off":
            return None
        if installed == "r3":
            if ENGINE_ROUTES not in batch.extras:
                raise ValueError("algorithm.routing_replay='r3' needs the engine's routes in the batch "
                                 "(rollout.record_routes, packed by TrainBatch.from_samples)")
            return cls(model_chunks, batch, groups, batch.extras[ENGINE_ROUTES], record=False)
        if scoring:  # r2: the old policy routes itself; remember its routes
            return cls(model_chunks, batch, groups, None, record=True)
        return cls(model_chunks, batch, groups, batch.extras.get(OLD_POLICY_ROUTES), record=False)

    def _local_sources(self, mb: MicroBatch) -> Tensor:
        """Batch positions of the tokens this rank's routers see (-1: padding)."""
        if not self.sp:
            return mb.source_index
        n = mb.length // self.tp_size
        return mb.source_index[self.tp_rank * n:(self.tp_rank + 1) * n]

    def before_forward(self, model, mb: MicroBatch) -> None:
        src = self._local_sources(mb)
        real = src >= 0
        for layer in self.layers[id(model)]:
            layer.clear_indices()
            if self.routes is None:
                layer.set_router_replay_action(RouterReplayAction.RECORD)
                continue
            target = torch.full((src.numel(), self.topk), NO_ROUTE, dtype=torch.long)
            target[real] = self.routes[src[real], layer.moe_index].long()
            layer.given = target
            layer.set_target_indices(target)
            layer.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def after_forward(self, model, mb: MicroBatch) -> None:
        src = self._local_sources(mb)
        real = src >= 0
        for layer in self.layers[id(model)]:
            own = layer.get_recorded_indices().detach().cpu()
            if self.recorded is not None:
                self.recorded[src[real], layer.moe_index] = own[real].to(torch.int16)
            if layer.given is not None:
                given = layer.given[:, 0] >= 0
                differs = (own.sort(-1).values != layer.given.sort(-1).values).any(-1) & given
                self.disagree[layer.moe_index] += differs.sum()
                self.counted[layer.moe_index] += given.sum()
                if self.bin_of is not None:
                    bins = torch.where(real, self.bin_of[src.clamp(min=0)], -1)
                    policy = given & (bins >= 0)
                    n = self.bin_counted.numel()
                    self.bin_disagree += torch.bincount(bins[policy], weights=differs[policy].double(), minlength=n)
                    self.bin_counted += torch.bincount(bins[policy], minlength=n)
            layer.clear_indices()
            layer.given = None
            layer.clear_router_replay_action()

    def finish(self, batch: TrainBatch) -> None:
        """After scoring ('r2'): the recorded routes go into ``batch.extras[OLD_POLICY_ROUTES]``."""
        if self.recorded is not None:
            batch.extras[OLD_POLICY_ROUTES] = self.recorded

    def metrics(self, groups, device: torch.device) -> dict[str, float]:
        """``routing/disagree_frac``: the share of (token, MoE layer) with a replayed route whose
        own top-k expert set differs from it; ``routing/disagree_frac/layer{i}`` per model layer i
        (0-based); ``routing/entropy_bin/<lo>-<hi>/disagree_frac`` over the (policy token, MoE layer)
        pairs whose engine entropy at that position falls in the bin (algorithm.metrics'
        bins; with the rollout entropy only). Summed over TP (sequence-parallel slices), PP
        (layers) and DP (data). A collective over those groups; {} when nothing was replayed."""
        per_layer = torch.stack([self.disagree, self.counted])
        per_bin = torch.stack([self.bin_disagree, self.bin_counted])
        counts = torch.cat([per_layer, per_bin], dim=1).to(device)
        # TP ranks see disjoint token slices only under sequence parallelism (else the same tokens).
        tp_size = groups.tp_size if self.sp else 1
        for group, size in ((groups.tp, tp_size), (groups.pp, groups.pp_size), (groups.dp, groups.dp_size)):
            if size > 1:
                dist.all_reduce(counts, group=group)
        layers = len(self.layer_numbers)
        disagree, counted = counts.cpu()[:, :layers]
        bin_disagree, bin_counted = counts.cpu()[:, layers:]
        if counted.sum() == 0:
            return {}
        out = {"routing/disagree_frac": float(disagree.sum() / counted.sum())}
        for i, number in enumerate(self.layer_numbers):
            if counted[i] > 0:
                out[f"routing/disagree_frac/layer{number - 1}"] = float(disagree[i] / counted[i])
        if self.bin_of is not None:
            for label, d, c in zip(entropy_bin_labels(DEFAULT_ENTROPY_BIN_EDGES), bin_disagree, bin_counted):
                if c > 0:
                    out[f"routing/entropy_bin/{label}/disagree_frac"] = float(d / c)
        return out
