"""One learner training step under TP / PP / VPP / EP / DP layouts against an independent single-rank reference.

The reference (per model and algorithm config) is the same model at TP=PP=EP=DP=1,
run WITHOUT any of the code under test: each sequence goes through the model on
its own (no packing, no Megatron schedule, no DDP), log-probs and entropy come
from ``torch.log_softmax`` over the full vocabulary, the padded response tensors
are built by a plain loop, ``compute_policy_loss`` sees the whole global batch at
once (its local counts ARE the global counts), and the Adam step is the closed
form of a first AdamW step: ``p (1 - lr wd) - lr g / (|g| + eps)`` with ``g`` the
clipped gradient (no weight decay on 1-D parameters, as Megatron's param groups).

Each layout is built as the learner builds a model it loads weights into (Megatron's
initialisation off), copies the reference's full weights into its shards
(``entr_megatron.models.sharding``), gives every data-parallel rank its share of
the same global batch, runs ``learner.train_step`` and compares: the loss, the
gradient norm, exact-reduction metrics, every gradient (TP shards gathered into
full tensors) and every updated weight. Launches are expensive, so each runs
many layouts, destroying and re-initialising model parallel between them.
"""

from __future__ import annotations

import math
import re
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from common import INTERPRETER, close, model_config
from entr_megatron.utils.spawn import run_gloo

VOCAB, MAX_SEQ = 128, 32
SEED = 1234
TEMPERATURE = 0.9  # the rollouts' sampling temperature the learner takes log-probs at
# Adam's first step is lr * g / (|g| + eps): an eps above the gradient scale keeps it ~linear in g,
# so fp32 noise in near-zero gradients is not blown up to full-size steps (~lr * sign(g)).
OPTIM = dict(lr=0.5, adam_eps=0.1, weight_decay=0.1, clip_grad=0.2)


# --- model and data -------------------------------------------------------------------------------

def make_global_batch(num_seqs=7, nan_advantage=False):
    """Variable-length prompt + response samples: tool tokens (loss mask off) inside responses,
    one empty response, behaviour log-probs a noisy ~uniform policy, rollout entropy, versions."""
    from entr_megatron.types import Sample, TrainBatch

    g = torch.Generator().manual_seed(11)
    samples = []
    for i in range(num_seqs):
        p = int(torch.randint(1, 5, (1,), generator=g))
        r = 0 if i == 2 else int(torch.randint(2, 11, (1,), generator=g))
        samples.append(Sample(
            prompt_ids=torch.randint(0, VOCAB, (p,), generator=g).tolist(),
            response_ids=torch.randint(0, VOCAB, (r,), generator=g).tolist(),
            # The tiny random model is near uniform (log 1/128 = -4.85): deviations of ~0.3
            # put some tokens on each side of ENTR's threshold and PPO's clip range.
            behaviour_logprobs=(-math.log(VOCAB) + 0.3 * torch.randn(r, generator=g)).tolist(),
            versions=[3 + (k > r // 2) for k in range(r)],
            rollout_entropy=(4.8 + 0.05 * torch.randn(r, generator=g)).tolist(),
            loss_mask=(torch.rand(r, generator=g) > 0.2).tolist(),
        ))
    advantages = torch.randn(num_seqs, generator=g)
    if nan_advantage:
        advantages[0] = float("nan")
    return TrainBatch.from_samples(samples, advantages)


def algo_config(**overrides):
    from entr_megatron.config.algorithm import AlgorithmConfig

    # tau small enough that ENTR masks some tokens of this near-uniform model.
    return AlgorithmConfig(**{"correction": "entr", "tau": 0.02, **overrides})


def learner_config(max_tokens=24, distributed_optimizer=False, mini_batches=1, epochs=1, fused_backend="auto"):
    from entr_megatron.config.learner import LearnerConfig, OptimConfig

    return LearnerConfig(max_tokens_per_microbatch=max_tokens, mini_batches=mini_batches,
                         epochs=epochs, optim=OptimConfig(**OPTIM, use_distributed_optimizer=distributed_optimizer),
                         fused_output_backend=fused_backend)


# --- the independent single-rank reference ----------------------------------------------------------

def reference(batch, algo_cfg, learner_cfg, moe=False, num_layers=4, exact_collision=True, temperature=TEMPERATURE):
    """Loss, metrics, logprobs, weights, gradients, grad norm and AdamW-updated weights at TP=PP=EP=DP=1."""
    from entr_megatron.algorithm import compute_policy_loss
    from entr_megatron.learner.model import build_gpt_model
    from entr_megatron.parallel.groups import initialize_model_parallel

    groups = initialize_model_parallel(1, 1, seed=SEED)
    model = build_gpt_model(model_config(moe=moe, num_layers=num_layers), VOCAB, MAX_SEQ, groups=groups)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    rows, all_logprobs = [], []
    for i in range(batch.num_seqs):
        s = slice(int(batch.cu_seqlens[i]), int(batch.cu_seqlens[i + 1]))
        tokens = batch.tokens_T[s]
        logits = model(tokens[None], torch.arange(tokens.numel())[None], None)[0]
        logp = torch.log_softmax(logits.float() / temperature, dim=-1)[:-1]
        lp = logp.gather(-1, tokens[1:, None])[:, 0]  # position j predicts token j + 1
        ent = -(logp.exp() * logp).sum(-1)
        coll = 1 - logp.exp().square().sum(-1)  # 1 - sum p^2, entr_calibrated's exact scale
        all_logprobs.append(torch.cat([lp.detach(), lp.new_zeros(1)]))
        mask = batch.loss_mask_T[s][:-1]
        hits = mask.nonzero().flatten()
        span = slice(int(hits[0]), int(hits[-1]) + 1) if hits.numel() else slice(0, 0)
        rows.append(dict(lp=lp[span], ent=ent[span].detach(), mask=mask[span], blp=batch.behaviour_logprobs_T[s][span],
                         rent=batch.rollout_entropy_T[s][span], coll=coll[span].detach()))
    width = max(r["mask"].numel() for r in rows)

    def pad(key, fill=0.0):
        return torch.stack([F.pad(r[key], (0, width - r[key].numel()), value=fill) for r in rows])

    lp_BT, mask_BT = pad("lp"), pad("mask", False)
    entropy_BT = pad("ent") if algo_cfg.entropy_source == "learner" else pad("rent")
    # pi_old is the current policy: no update before the step.
    collision = pad("coll") if exact_collision and algo_cfg.correction == "entr_calibrated" else None
    loss, metrics = compute_policy_loss(lp_BT, entropy_BT, pad("blp"), batch.advantages_B, mask_BT, algo_cfg,
                                        collision_BT=collision)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values())).item()
    o = learner_cfg.optim
    coeff = min(1.0, o.clip_grad / (norm + 1e-6))
    clipped = {n: coeff * g.double() for n, g in grads.items()}
    updated = {
        n: (params[n].double() * (1 - o.lr * (0.0 if params[n].dim() == 1 else o.weight_decay))
            - o.lr * g / (g.abs() + o.adam_eps)).float()
        for n, g in clipped.items()
    }
    return dict(loss=loss.item(), metrics={k: float(v) for k, v in metrics.items()}, params=params,
                clipped=clipped, norm=norm, coeff=coeff, updated=updated, logprobs=torch.cat(all_logprobs))


# --- resharding the reference into a layout and gathering back ---------------------------------------------

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def global_name(chunk, name, groups, cfg):
    """The reference (TP=PP=EP=1) name of local parameter ``name`` of a model chunk."""
    from entr_megatron.models import expert_global_name, is_expert_param, offset_layer

    m = _LAYER.match(name)
    if m:
        local = int(m.group(1))
        name = offset_layer(name, chunk.decoder.layers[local].layer_number - 1 - local)
    if is_expert_param(name):
        name = expert_global_name(name, groups.ep_rank, cfg.num_moe_experts, groups.ep_size)
    return name


def tp_coords(gname, groups):
    from entr_megatron.models import is_expert_param

    if is_expert_param(gname):
        return groups.expert_tp, groups.expert_tp_rank, groups.expert_tp_size
    return groups.tp, groups.tp_rank, groups.tp_size


def load_reference(chunks, ref, groups, cfg):
    from entr_megatron.models import shard

    for chunk in chunks:
        for name, p in chunk.named_parameters():
            gname = global_name(chunk, name, groups, cfg)
            _, rank, size = tp_coords(gname, groups)
            with torch.no_grad():
                p.copy_(shard(gname, ref["params"][gname], rank, size))


def gather_full(gname, local, groups):
    """The full tensor of a parameter (or its gradient) from this rank's TP shard."""
    from entr_megatron.models import TpSplit, tp_split, unshard

    if tp_split(gname) is TpSplit.REPLICATED:
        return local
    group, _, size = tp_coords(gname, groups)
    if size == 1:
        return local
    shards = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(shards, local.contiguous(), group=group)
    return unshard(gname, shards)


def compare_weights_and_grads(ddp_chunks, ref, groups, cfg, where, grads=True):
    seen = set()
    for ddp in ddp_chunks:
        chunk = ddp.module
        for name, p in chunk.named_parameters():
            gname = global_name(chunk, name, groups, cfg)
            if grads:
                close(gather_full(gname, p.main_grad, groups), ref["clipped"][gname], f"{where}: clipped grad {gname}")
            p0 = ref["params"][gname]
            step = gather_full(gname, p.detach(), groups) - p0
            # Updated weights are fp32: allow their rounding (2 ulp of the largest weight) on top.
            ulps = 2 * torch.finfo(torch.float32).eps * p0.abs().max().item()
            close(step, ref["updated"][gname] - p0, f"{where}: update of {gname}", atol=ulps)
            seen.add(gname)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, sorted(seen))
    missing = set(ref["params"]) - set().union(*map(set, everyone))
    assert not missing, f"{where}: parameters never compared: {sorted(missing)}"


# --- one layout --------------------------------------------------------------------------------------------

EXACT_METRICS = ("mismatch/", "mask/fraction", "is/ess", "entropy_bin/", "entr/mask_fraction", "entr/score_mean")


def build_layout(ref, tp=1, pp=1, vpp=None, ep=1, sp=False, moe=False, num_layers=4, learner_cfg=None, fused=False,
                 dispatcher="alltoall"):
    from entr_megatron.learner.fused_output import enable_fused_output, is_fused
    from entr_megatron.learner.model import build_model_chunks
    from entr_megatron.learner.optimizer import build_optimizer, wrap_model_chunks
    from entr_megatron.parallel.groups import initialize_model_parallel

    groups = initialize_model_parallel(tp, pp, ep=ep, vpp=vpp, seed=SEED + 1)
    cfg = model_config(tp, pp, ep, vpp, sp, moe, num_layers, dispatcher=dispatcher)
    # Weights come from ref: not initialised, as the learner builds a model it loads (learner.build);
    # Megatron then leaves the TP-split weights unmarked (learner.model.set_tensor_parallel_attributes).
    cfg.perform_initialization = False
    chunks = build_model_chunks(cfg, VOCAB, MAX_SEQ, groups)
    load_reference(chunks, ref, groups, cfg)
    if fused:  # learner.fused_output: hidden states out, the output layer's matmul inside the op
        enable_fused_output(chunks)
        assert is_fused(chunks[-1]) == (groups.pp_rank == groups.pp_size - 1)  # the last stage's last chunk
    ddp = wrap_model_chunks(chunks, groups, learner_cfg)
    optimizer, scheduler = build_optimizer(ddp, learner_cfg)
    return groups, cfg, ddp, optimizer, scheduler


def run_layout(ref, batch, algo_cfg, learner_cfg, tp=1, pp=1, vpp=None, ep=1, sp=False, moe=False, num_layers=4,
               temperature=TEMPERATURE,
               check_logprobs=False, fused=False, dispatcher="alltoall"):
    from entr_megatron.learner.batching import split_for_data_parallel
    from entr_megatron.learner.trainer import compute_logprobs, train_step

    t0 = time.perf_counter()
    groups, cfg, ddp, optimizer, scheduler = build_layout(ref, tp, pp, vpp, ep, sp, moe, num_layers, learner_cfg,
                                                          fused, dispatcher)
    fused_as = f"fused={fused}" + (f" ({learner_cfg.fused_output_backend})" if fused else "")
    where = (f"tp={tp} pp={pp} vpp={vpp} ep={ep} dp={groups.dp_size} sp={sp} moe={moe} {fused_as} "
             f"{dispatcher if moe else ''} "
             f"{algo_cfg.loss_agg_mode} {algo_cfg.correction} H={algo_cfg.entropy_source} "
             f"budget={learner_cfg.max_tokens_per_microbatch} distopt={learner_cfg.optim.use_distributed_optimizer}")
    shares = split_for_data_parallel(batch, groups.dp_size)
    local = shares[groups.dp_rank]
    if check_logprobs:  # the log-prob-only forward scores every target position
        logprobs, _ = compute_logprobs(ddp, local, groups, learner_cfg, temperature=temperature)
        if groups.is_last_stage():
            start = sum(s.tokens_T.numel() for s in shares[:groups.dp_rank])
            want = ref["logprobs"][start:start + local.tokens_T.numel()]
            close(logprobs, want, f"{where}: compute_logprobs")
    before = [p.detach().clone() for c in ddp for p in c.parameters()]
    hook_saw = []  # before_update (a weight push still reading them) runs after backward, before any change

    def before_update():
        hook_saw.append(all(torch.equal(p.detach(), p0) for p, p0 in zip((p for c in ddp for p in c.parameters()), before))
                        and any(p.main_grad.abs().sum() > 0 for c in ddp for p in c.parameters() if p.requires_grad
                                and getattr(p, "main_grad", None) is not None and p.main_grad.numel() > 0))

    metrics = train_step(ddp, optimizer, scheduler, local, groups, algo_cfg, learner_cfg, temperature=temperature,
                         before_update=before_update)
    assert hook_saw == [True], f"{where}: before_update saw changed weights or no gradients: {hook_saw}"
    assert any(not torch.equal(p.detach(), p0) for p, p0 in zip((p for c in ddp for p in c.parameters()), before))
    assert metrics["optim/skipped"] == 0.0, f"{where}: step skipped"
    close(metrics["loss"], ref["loss"], f"{where}: loss")
    close(metrics["optim/grad_norm"], ref["norm"], f"{where}: grad norm")
    assert ref["coeff"] < 1.0, "the clipping path must run"
    for key, want in ref["metrics"].items():
        if key.startswith(EXACT_METRICS):
            # Means of +-deviations nearly cancel: judge them on the scale of 1, not of their value.
            close(metrics[key], want, f"{where}: metric {key}", floor=1.0)
    # Weights and clipped gradients; the distributed optimizer keeps only a DP shard of reduced grads.
    compare_weights_and_grads(ddp, ref, groups, cfg, where, grads=not learner_cfg.optim.use_distributed_optimizer)
    if dist.get_rank() == 0:
        print(f"  ok {where}: {int(metrics['batch/microbatches'])} micro-batches "
              f"({time.perf_counter() - t0:.1f} s)", flush=True)
    return metrics


def mini_batch_reference(batch, algo_cfg, learner_cfg):
    """Every optimizer step of a rollout batch on one rank, without the code under test: the
    mini-batches are sequences [0, 4) and [4, 7) (7 sequences, 2 mini-batches), pi_old is each
    mini-batch's log-probs under the initial weights, each step is compute_policy_loss on the
    whole mini-batch, clip_grad_norm_ and torch's AdamW (Megatron's Adam on CPU, the same
    param groups). Returns the per-step losses and metrics and the final weights."""
    from entr_megatron.algorithm import compute_policy_loss
    from entr_megatron.learner.batching import select_sequences
    from entr_megatron.learner.model import build_gpt_model
    from entr_megatron.parallel.groups import initialize_model_parallel

    assert batch.num_seqs == 7 and learner_cfg.mini_batches == 2
    groups = initialize_model_parallel(1, 1, seed=SEED)
    model = build_gpt_model(model_config(), VOCAB, MAX_SEQ, groups=groups)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    o = learner_cfg.optim
    decay = [p for p in model.parameters() if p.dim() > 1]
    no_decay = [p for p in model.parameters() if p.dim() == 1]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps)

    def padded(mini):
        rows = []
        for i in range(mini.num_seqs):
            s = slice(int(mini.cu_seqlens[i]), int(mini.cu_seqlens[i + 1]))
            tokens = mini.tokens_T[s]
            logits = model(tokens[None], torch.arange(tokens.numel())[None], None)[0]
            logp = torch.log_softmax(logits.float() / TEMPERATURE, dim=-1)[:-1]
            lp = logp.gather(-1, tokens[1:, None])[:, 0]
            ent = -(logp.exp() * logp).sum(-1)
            mask = mini.loss_mask_T[s][:-1]
            hits = mask.nonzero().flatten()
            span = slice(int(hits[0]), int(hits[-1]) + 1) if hits.numel() else slice(0, 0)
            rows.append(dict(lp=lp[span], ent=ent[span].detach(), mask=mask[span],
                             blp=mini.behaviour_logprobs_T[s][span], ver=mini.versions_T[s][:-1][span]))
        width = max(r["mask"].numel() for r in rows)
        return {k: torch.stack([F.pad(r[k], (0, width - r[k].numel()), value=False if k == "mask" else 0.0)
                                for r in rows]) for k in rows[0]}

    minis = [select_sequences(batch, list(range(0, 4))), select_sequences(batch, list(range(4, 7)))]
    initial_masks = []
    with torch.no_grad():
        old = [padded(m)["lp"].detach() for m in minis]
        for m in minis:  # what each mini-batch's mask would be under the initial weights
            t = padded(m)
            _, metrics = compute_policy_loss(t["lp"], t["ent"], t["blp"], m.advantages_B, t["mask"], algo_cfg,
                                             versions_BT=t["ver"], policy_version=batch.policy_version)
            initial_masks.append(float(metrics["mask/fraction"]))
    steps = []
    for _ in range(learner_cfg.epochs):
        for k, mini in enumerate(minis):
            t = padded(mini)
            loss, metrics = compute_policy_loss(t["lp"], t["ent"], t["blp"], mini.advantages_B, t["mask"], algo_cfg,
                                                old_logprobs_BT=old[k] if algo_cfg.uses_old_logprobs else None,
                                                versions_BT=t["ver"], policy_version=batch.policy_version)
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), o.clip_grad)
            optimizer.step()
            steps.append(dict(loss=loss.item(), metrics={n: float(v) for n, v in metrics.items()}))
    final = {n: p.detach().clone() for n, p in model.named_parameters()}
    return dict(params=params, steps=steps, final=final, initial_masks=initial_masks)


def check_mini_batches(batch, algo_cfg, learner_cfg, tp=1, fused=False):
    """``train_rollout_batch`` with 2 mini-batches (x epochs) against ``mini_batch_reference``: each
    step's loss and mask (the second computed against the weights the first step moved), and the
    final weights."""
    from entr_megatron.learner.trainer import train_rollout_batch

    ref = mini_batch_reference(batch, algo_cfg, learner_cfg)
    groups, cfg, ddp, optimizer, scheduler = build_layout(ref, tp=tp, learner_cfg=learner_cfg, fused=fused)
    where = (f"mini-batches tp={tp} dp={groups.dp_size} fused={fused} {algo_cfg.correction} {algo_cfg.policy_loss} "
             f"epochs={learner_cfg.epochs}")
    t0 = time.perf_counter()
    steps = train_rollout_batch(ddp, optimizer, scheduler, batch, groups, algo_cfg, learner_cfg,
                                temperature=TEMPERATURE)
    wall = time.perf_counter() - t0
    assert len(steps) == len(ref["steps"]) == 2 * learner_cfg.epochs
    parts = ("prepare", "forward_backward", "optimizer", "metrics")
    timed = steps[0]["timing/learner_old_logprobs_s"] + sum(s[f"timing/learner_{p}_s"] for s in steps for p in parts)
    assert all(s[f"timing/learner_{p}_s"] >= 0 for s in steps for p in parts)
    assert steps[0]["timing/learner_old_logprobs_s"] > 0 if algo_cfg.uses_old_logprobs else True
    assert 0.5 * wall < timed <= wall, (timed, wall)  # the parts are disjoint and cover most of the call
    assert [s["optim/minibatch"] for s in steps] == [0.0, 1.0] * learner_cfg.epochs
    masked = [step["metrics"]["mask/fraction"] for step in ref["steps"]]
    for key in (f"{algo_cfg.policy_loss}/mask_fraction",):  # a policy loss's own trust region (DPPO)
        if key in ref["steps"][0]["metrics"]:
            masked = [step["metrics"][key] for step in ref["steps"]]
            for got, want in zip(steps, ref["steps"]):
                close(got[key], want["metrics"][key], f"{where}: {key}", floor=1.0, tol=1e-4)
    if algo_cfg.correction == "entr":
        # The case discriminates: mini-batch 2's mask under the weights step 1 left differs from
        # the one the initial weights would give, and the learner must match the former.
        assert masked[1] != ref["initial_masks"][1], (masked, ref["initial_masks"])
    for i, (got, want) in enumerate(zip(steps, ref["steps"])):
        close(got["loss"], want["loss"], f"{where}: step {i} loss", tol=1e-4)
        for key in ("mask/fraction", "mismatch/k3", "is/ess"):
            close(got[key], want["metrics"][key], f"{where}: step {i} {key}", floor=1.0, tol=1e-4)
    for ddp_chunk in ddp:
        chunk = ddp_chunk.module
        for name, p in chunk.named_parameters():
            gname = global_name(chunk, name, groups, cfg)
            got = gather_full(gname, p.detach(), groups)
            want = ref["final"][gname]
            ulps = 4 * torch.finfo(torch.float32).eps * ref["params"][gname].abs().max().item()  # fp32 weights
            close(got - ref["params"][gname], want - ref["params"][gname], f"{where}: update of {gname}", tol=1e-4,
                  atol=ulps)
    if dist.get_rank() == 0:
        print(f"  ok {where}: losses {[round(s['loss'], 5) for s in steps]}, masked {masked}", flush=True)


def check_nonfinite_step_is_skipped(ref, learner_cfg, tp=1):
    """A NaN advantage makes the gradient norm NaN: no weight moves, the LR schedule does not
    advance, the step is reported skipped; the next finite step is applied normally."""
    from entr_megatron.learner.batching import split_for_data_parallel
    from entr_megatron.learner.trainer import train_step

    groups, cfg, ddp, optimizer, scheduler = build_layout(ref, tp=tp, learner_cfg=learner_cfg)
    algo_cfg = algo_config()
    before = [p.detach().clone() for c in ddp for p in c.parameters()]
    bad = split_for_data_parallel(make_global_batch(nan_advantage=True), groups.dp_size)[groups.dp_rank]
    called = []
    metrics = train_step(ddp, optimizer, scheduler, bad, groups, algo_cfg, learner_cfg, temperature=TEMPERATURE,
                         before_update=lambda: called.append(1))
    assert called == [], "a skipped step changes no weight: nothing to wait for"
    assert metrics["optim/skipped"] == 1.0 and not math.isfinite(metrics["optim/grad_norm"]), metrics
    assert scheduler.num_steps == 0
    for p, p0 in zip((p for c in ddp for p in c.parameters()), before):
        assert torch.equal(p.detach(), p0), "a skipped step changed a weight"
    good = split_for_data_parallel(make_global_batch(), groups.dp_size)[groups.dp_rank]
    metrics = train_step(ddp, optimizer, scheduler, good, groups, algo_cfg, learner_cfg, temperature=TEMPERATURE)
    assert metrics["optim/skipped"] == 0.0 and scheduler.num_steps == 1
    close(metrics["loss"], ref["loss"], "step after a skipped one: loss")  # grads were reset
    compare_weights_and_grads(ddp, ref, groups, cfg, "step after a skipped one")
    if dist.get_rank() == 0:
        print(f"  ok non-finite grad norm skipped (tp={tp} dp={groups.dp_size})", flush=True)


def check_lr_schedule(ref):
    """Megatron's scheduler as configured: linear warmup from lr_warmup_init, cosine to min_lr, then
    min_lr; decoupled weight decay on matrices only."""
    from entr_megatron.config.learner import LearnerConfig, OptimConfig

    optim = OptimConfig(lr=1e-3, min_lr=1e-5, lr_warmup_init=1e-4, lr_warmup_steps=2, lr_decay_style="cosine",
                        lr_decay_steps=6, weight_decay=0.1)
    _, _, ddp, optimizer, scheduler = build_layout(ref, learner_cfg=LearnerConfig(optim=optim))
    got = []
    for _ in range(8):
        got.append(optimizer.param_groups[0]["lr"])
        scheduler.step(increment=1)
    cosine = [1e-5 + (1e-3 - 1e-5) * 0.5 * (math.cos(math.pi * (k - 2) / 4) + 1) for k in (3, 4, 5)]
    close(torch.tensor(got), torch.tensor([1e-4, 5.5e-4, 1e-3, *cosine, 1e-5, 1e-5]), "lr schedule")
    decays = {id(p): g["weight_decay"] for g in optimizer.param_groups for p in g["params"]}
    for p in (p for c in ddp for p in c.parameters()):
        assert decays[id(p)] == (0.0 if p.dim() == 1 else 0.1)
    if dist.get_rank() == 0:
        print("  ok lr schedule and weight-decay groups", flush=True)


# --- launches ----------------------------------------------------------------------------------------------

def _two_ranks(rank, world):
    from entr_megatron.parallel.cpu_compat import enable_cpu_compat

    enable_cpu_compat()
    batch = make_global_batch()
    algo, small = algo_config(), learner_config(max_tokens=24)
    dense = reference(batch, algo, small)
    run_layout(dense, batch, algo, small, tp=2, sp=True, check_logprobs=True)
    run_layout(dense, batch, algo, small, pp=2, check_logprobs=True)
    run_layout(dense, batch, algo, small, pp=2, vpp=2)
    run_layout(dense, batch, algo, small, tp=2, sp=True, check_logprobs=True, fused=True)
    run_layout(dense, batch, algo, small, pp=2, vpp=2, check_logprobs=True, fused=True)
    if INTERPRETER:  # triton >= 3.9, TRITON_INTERPRET=1 from tests/conftest.py without CUDA
        # The fused op's Triton kernels, run by Triton's CPU interpreter.
        triton_cfg = learner_config(max_tokens=24, fused_backend="triton")
        run_layout(dense, batch, algo, triton_cfg, tp=2, sp=True, check_logprobs=True, fused=True)
    # DP=2; the micro-batch count must not change the loss: one per rank, then several.
    one = run_layout(dense, batch, algo, learner_config(max_tokens=10_000))
    many = run_layout(dense, batch, algo, learner_config(max_tokens=10))  # 3 on one rank, 2 + padding on the other
    assert one["batch/microbatches"] == 1 and many["batch/microbatches"] >= 3
    close(many["loss"], one["loss"], "loss with 1 vs many micro-batches")
    for mode, source in (("seq-mean-token-mean", "rollout"), ("seq-mean-token-sum-norm", "learner")):
        cfg = algo_config(loss_agg_mode=mode, entropy_source=source, loss_norm_tokens=16)
        ref_mode = reference(batch, cfg, small)
        run_layout(ref_mode, batch, cfg, learner_config(max_tokens=12))
        # The token-local loss fused into the output layer (its gradients in the forward pass), per-sequence scales.
        run_layout(ref_mode, batch, cfg, learner_config(max_tokens=12), tp=2, sp=True, fused=True)
    distopt = learner_config(max_tokens=12, distributed_optimizer=True)
    run_layout(dense, batch, algo, distopt)
    # entr_calibrated gets the exact 1 - sum p^2 from the vocab-parallel op (one micro-batch: its
    # per-micro-batch sigma2_hat is the reference's whole-batch one).
    # A low temperature sharpens the near-uniform random model, so 1 - sum p^2 and its bound
    # 1 - exp(-H) differ.
    calibrated = algo_config(correction="entr_calibrated", calibrated_z=1.0)
    whole = learner_config(max_tokens=10_000)
    exact = reference(batch, calibrated, whole, temperature=0.05)
    got = run_layout(exact, batch, calibrated, whole, tp=2, temperature=0.05)
    bound = reference(batch, calibrated, whole, exact_collision=False, temperature=0.05)  # G from 1 - exp(-H)
    want, loose = exact["metrics"]["entr_calibrated/sigma2_hat"], bound["metrics"]["entr_calibrated/sigma2_hat"]
    assert math.isclose(got["entr_calibrated/sigma2_hat"], want, rel_tol=1e-4), (got, want)
    assert not math.isclose(want, loose, rel_tol=1e-2), "the case must tell the exact G from the bound"
    decoupled = algo_config(correction="decoupled")  # pi_prox: the current policy, in the same pass
    run_layout(reference(batch, decoupled, small), batch, decoupled, small, pp=2)
    # Several optimizer steps per rollout batch: DP=2 (each mini-batch split over the ranks), then TP=2
    # with a correction on pi_old (recomputed for the second mini-batch before the first step).
    check_mini_batches(batch, algo_config(), learner_config(max_tokens=12, mini_batches=2))
    check_mini_batches(batch, algo_config(correction="icepop"), learner_config(mini_batches=2, epochs=2), tp=2)
    check_mini_batches(batch, algo_config(correction="tis"), learner_config(mini_batches=2), tp=2, fused=True)
    moe = reference(batch, algo, small, moe=True, num_layers=2)
    # Two micro-batches per rank of different lengths: the all-to-alls run in lockstep all the same.
    run_layout(moe, batch, algo, learner_config(max_tokens=12), ep=2, moe=True, num_layers=2)
    # EP=1 at TP=2 (expert-TP 1): each TP rank runs every expert on its half of the tokens, and the
    # expert gradients must be summed over the TP ranks (the expert-DP group); allgather: the CPU learner's.
    run_layout(moe, batch, algo, small, tp=2, sp=True, moe=True, num_layers=2, dispatcher="allgather")
    run_layout(moe, batch, algo, small, tp=2, ep=2, sp=True, moe=True, num_layers=2)
    check_nonfinite_step_is_skipped(dense, small, tp=2)
    check_lr_schedule(dense)


def _four_ranks(rank, world):
    from entr_megatron.parallel.cpu_compat import enable_cpu_compat

    enable_cpu_compat()
    batch = make_global_batch()
    algo, small = algo_config(), learner_config(max_tokens=24)
    dense = reference(batch, algo, small)
    run_layout(dense, batch, algo, small, tp=2, pp=2)
    run_layout(dense, batch, algo, learner_config(max_tokens=12), tp=2, sp=True)  # TP=2 x DP=2
    run_layout(dense, batch, algo, small, tp=2, pp=2, fused=True)
    run_layout(dense, batch, algo, learner_config(max_tokens=12), tp=2, sp=True, fused=True)


# The 2026 methods (docs/ENTR.md): the paper forms (policy losses against mu, correction none) and
# the corrections as published; each at TP=2 with two mini-batches (pi_old recomputed where used).
# Thresholds scaled to this near-uniform model (p ~ 1/128, |delta| ~ 0.3) so every mask drops some tokens.
METHODS_2026 = [dict(policy_loss="dppo_tv", correction="none", eps_clip_low=0.002, eps_clip_high=0.002),
                dict(policy_loss="dppo_kl", correction="none", eps_clip_low=2e-4, eps_clip_high=2e-4),
                dict(policy_loss="sapo", correction="none"), dict(policy_loss="vespo", correction="none"),
                dict(correction="opsm", opsm_threshold=0.02), dict(correction="trm", trm_threshold=0.2),
                dict(correction="a3po")]


def _two_ranks_2026_methods(rank, world):
    import dataclasses

    from entr_megatron.parallel.cpu_compat import enable_cpu_compat

    enable_cpu_compat()
    batch = dataclasses.replace(make_global_batch(), policy_version=6)  # tokens of versions 3, 4: a3po's alpha 2/3, 1/2
    for overrides in METHODS_2026:
        check_mini_batches(batch, algo_config(**overrides), learner_config(mini_batches=2), tp=2)


def test_2026_methods_at_tp2_with_two_mini_batches_match_single_rank_reference():
    run_gloo(_two_ranks_2026_methods, 2, timeout_s=400)


def test_train_step_layouts_on_two_ranks_match_single_rank_reference():
    run_gloo(_two_ranks, 2, timeout_s=400)


def test_train_step_layouts_on_four_ranks_match_single_rank_reference():
    run_gloo(_four_ranks, 4, timeout_s=400)


def test_learner_config_errors_name_the_field_and_the_allowed_values():
    import pytest

    from entr_megatron.config.learner import LearnerConfig, OptimConfig

    cases = [
        (dict(max_tokens_per_microbatch=0), r"max_tokens_per_microbatch=0 .* integer >= 1"),
        (dict(epochs=0), r"epochs=0 .* integer >= 1"),
        (dict(mini_batches=0), r"mini_batches=0 .* integer >= 1"),
        (dict(optim={"lr_decay_style": "cosine"}), r"optim.lr_decay_steps=None .* lr_decay_style='cosine'"),
        (dict(optim={"lr": 1e-3, "min_lr": 1e-2}), r"optim.min_lr=0.01 .* \[0, 0.001\]"),
        (dict(optim={"lr_decay_style": "step"}), r"optim.lr_decay_style='step' .* constant, linear, cosine"),
        (dict(optim={"adam_beta2": 1.0}), r"optim.adam_beta2=1.0 .* \[0, 1\)"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            LearnerConfig(**kwargs)
    cfg = LearnerConfig(optim={"lr": 2e-6, "lr_warmup_steps": 3})  # a YAML mapping becomes an OptimConfig
    assert cfg.optim == OptimConfig(lr=2e-6, lr_warmup_steps=3) and cfg.optim.schedule_decay_steps == 4
