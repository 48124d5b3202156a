"""Megatron GPTModel under TP / SP / PP / VPP / EP layouts against a TP=1 PP=1 reference, on gloo ranks.

Launching ranks is the expensive part, so each launch runs many layouts:
destroy and re-initialise model parallel between them. In every layout:

1. the reference: the model at TP=1 PP=1 EP=1 computes logits, the token-mean
   NLL (from the vocab-parallel op) and all gradients on the whole batch;
2. the layout under test is built (its own random init), the reference weights
   are sharded into it (TP rows/columns, gated fc1 halves, PP layer offsets, EP
   expert offsets), each data-parallel rank takes its slice of the batch and runs
   Megatron's ``get_forward_backward_func()`` over micro-batches;
3. gradients are reduced the way ``finalize_model_grads`` would (DP / expert-DP
   sums, SP norms and q/k norms over TP, tied embeddings over the embedding
   group); logits are gathered over TP; then logits, loss and every gradient
   shard are compared with the reference's (and the union over ranks of the
   compared parameters must be the reference's full parameter set).
"""

from __future__ import annotations

import re
import time

import pytest
import torch
import torch.distributed as dist

from common import REL_TOL, close
from common import model_config as _tiny_model_config
from entr_megatron.utils.spawn import run_gloo

VOCAB, SEQ, BATCH = 128, 16, 4
SEED = 1234


# --- model and data -------------------------------------------------------------------

def model_config(*args, **kwargs):
    """The shared tiny model; its MoE layers also have a shared expert (48 wide)."""
    return _tiny_model_config(*args, shared_expert_size=48, **kwargs)


def make_batch():
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    targets = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return ids, targets, torch.arange(SEQ).expand(BATCH, SEQ)


# --- the reference -----------------------------------------------------------------------

def reference(moe=False, tied=False, num_layers=4):
    """Logits, loss, parameters and gradients of the TP=1 PP=1 EP=1 model on the whole batch."""
    from entr_megatron.learner.model import build_gpt_model, logits_to_logprobs_entropy
    from entr_megatron.parallel.groups import initialize_model_parallel

    groups = initialize_model_parallel(1, 1, seed=SEED)
    model = build_gpt_model(model_config(moe=moe, num_layers=num_layers), VOCAB, SEQ, groups=groups,
                            tie_embeddings=tied)
    ids, targets, pos = make_batch()
    logits = model(ids, pos, None)
    lp, _ = logits_to_logprobs_entropy(logits, targets, None)
    loss = -lp.mean()
    loss.backward()
    return dict(
        logits=logits.detach(), loss=loss.detach(),
        params={n: p.detach().clone() for n, p in model.named_parameters()},
        grads={n: p.grad.clone() for n, p in model.named_parameters()},
    )


# --- resharding ---------------------------------------------------------------------------

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.experts\.local_experts\.(\d+)\.")


def global_name(chunk, name, groups, cfg, tied):
    """The reference (TP=1 PP=1 EP=1) name of ``name`` in a model chunk of this layout."""
    m = _LAYER.match(name)
    if m:
        layer = chunk.decoder.layers[int(m.group(1))]
        name = f"decoder.layers.{layer.layer_number - 1}." + name[m.end():]
    m = _EXPERT.search(name)
    if m:
        local_experts = cfg.num_moe_experts // groups.ep_size
        name = name[:m.start()] + f".experts.local_experts.{int(m.group(1)) + groups.ep_rank * local_experts}." + name[m.end():]
    if tied and name == "output_layer.weight":
        name = "embedding.word_embeddings.weight"
    return name


def shard(full, param, name, groups, cfg):
    """This rank's piece of the full tensor ``full`` for local parameter ``param``."""
    if full.shape == param.shape:
        return full
    rank, size = (groups.expert_tp_rank, groups.expert_tp_size) if ".experts." in name else (groups.tp_rank, groups.tp_size)
    dim = param.partition_dim
    if name.endswith("linear_fc1.weight") and cfg.gated_linear_unit:
        # Every rank holds [gate; up] of its own columns: split the two halves separately.
        return torch.cat([half.chunk(size, dim)[rank] for half in full.chunk(2, dim)], dim)
    return full.chunk(size, dim)[rank]


def load_reference(chunks, ref, groups, cfg, tied):
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            with torch.no_grad():
                p.copy_(shard(ref["params"][global_name(chunk, name, groups, cfg, tied)], p, name, groups, cfg))


def reduce_grads(chunks, groups, cfg, tied):
    """The gradient reductions of DDP + finalize_model_grads, done by hand on ``.grad``."""
    embedding = []
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            g = p.grad
            if (cfg.sequence_parallel and getattr(p, "sequence_parallel", False)) or re.search(r"\.[qk]_layernorm\.", name):
                dist.all_reduce(g, group=groups.tp)  # partial sums per TP rank
            dp_group, dp_size = (groups.expert_dp, dist.get_world_size(groups.expert_dp)) if ".experts." in name else (groups.dp, groups.dp_size)
            if dp_size > 1:
                dist.all_reduce(g, group=dp_group)
            if tied and groups.pp_size > 1 and name in ("embedding.word_embeddings.weight", "output_layer.weight"):
                embedding.append(g)
    for g in embedding:  # after all other collectives: the two stages reach it at different points
        dist.all_reduce(g, group=groups.embedding)


def compare_grads(chunks, ref, groups, cfg, tied, where):
    seen = set()
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            gname = global_name(chunk, name, groups, cfg, tied)
            close(p.grad, shard(ref["grads"][gname], p, name, groups, cfg), f"{where}: grad {gname}")
            seen.add(gname)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, sorted(seen))
    missing = set(ref["grads"]) - set().union(*map(set, everyone))
    assert not missing, f"{where}: gradients never compared: {sorted(missing)}"


# --- one layout -------------------------------------------------------------------------------

def local_microbatches(groups):
    """This data-parallel rank's rows of the batch, one micro-batch per row."""
    ids, targets, pos = make_batch()
    rows = range(groups.dp_rank * BATCH // groups.dp_size, (groups.dp_rank + 1) * BATCH // groups.dp_size)
    return [dict(ids=ids[i:i + 1], targets=targets[i:i + 1], pos=pos[i:i + 1], row=i) for i in rows]


def make_forward_step(groups, divide_by, seen_logits):
    """Megatron forward_step_func: the summed NLL of a micro-batch divided by ``divide_by``."""
    from entr_megatron.learner.model import logits_to_logprobs_entropy

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        out = model(mb["ids"], mb["pos"], None)

        def loss_func(logits_shard):
            lp, _ = logits_to_logprobs_entropy(logits_shard, mb["targets"], groups.tp)
            full = [torch.empty_like(logits_shard) for _ in range(groups.tp_size)]
            dist.all_gather(full, logits_shard.detach().contiguous(), group=groups.tp)
            seen_logits.append((mb["row"], torch.cat(full, dim=-1)))
            nll = -lp.sum()
            # calculate_per_token_loss=True: Megatron does not divide by the number of micro-batches.
            return nll / divide_by, torch.tensor(lp.numel(), dtype=torch.int), {"nll": nll.detach()}

        return out, loss_func

    return forward_step


def forward_backward(chunks, groups, micro, forward_step):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    iters = [iter(micro) for _ in chunks] if len(chunks) > 1 else iter(micro)
    fwd_bwd = get_forward_backward_func(pp_size=groups.pp_size, vp_size=groups.vpp_size)
    return fwd_bwd(
        forward_step_func=forward_step, data_iterator=iters, model=chunks, num_microbatches=len(micro),
        seq_length=SEQ, micro_batch_size=1, forward_only=False,
    )


def run_layout(ref, tp=1, pp=1, vpp=None, ep=1, sp=False, moe=False, tied=False, dispatcher="alltoall", num_layers=4):
    from entr_megatron.learner.model import build_model_chunks
    from entr_megatron.parallel.groups import initialize_model_parallel

    where = f"tp={tp} pp={pp} vpp={vpp} ep={ep} sp={sp} moe={moe} tied={tied} {dispatcher}"
    t0 = time.perf_counter()
    groups = initialize_model_parallel(tp, pp, ep=ep, vpp=vpp, seed=SEED + 1)  # weights come from ref
    cfg = model_config(tp, pp, ep, vpp, sp, moe, num_layers, dispatcher=dispatcher)
    chunks = build_model_chunks(cfg, VOCAB, SEQ, groups, tie_embeddings=tied)
    load_reference(chunks, ref, groups, cfg, tied)
    n_global = BATCH * SEQ
    seen_logits = []
    results = forward_backward(chunks, groups, local_microbatches(groups), make_forward_step(groups, n_global, seen_logits))
    if groups.is_last_stage():
        for row, logits in seen_logits:
            close(logits[0], ref["logits"][row], f"{where}: logits of row {row}")
        nll = torch.stack([r["nll"] for r in results]).sum()
        if groups.dp_size > 1:
            dist.all_reduce(nll, group=groups.dp)
        close(nll / n_global, ref["loss"], f"{where}: loss")
    reduce_grads(chunks, groups, cfg, tied)
    compare_grads(chunks, ref, groups, cfg, tied, where)
    if dist.get_rank() == 0:
        print(f"  ok {where} ({time.perf_counter() - t0:.1f} s)", flush=True)


def check_optimizer_step(ref, tp=1, pp=1, distributed_optimizer=True):
    """DDP + Megatron's (distributed) Adam with clipping: the first step moves every weight by
    ``-lr * g / (|g| + eps)`` with ``g`` the clipped reference gradient (bias-corrected moments of one step).

    Exercises the compat redirects of DDP buffers, finalize_model_grads, clip_grads
    and the optimizers; the gradient token-mean is Megatron's own here
    (``calculate_per_token_loss``: finalize divides by the global token count).
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from entr_megatron.learner.model import build_model_chunks
    from entr_megatron.parallel.groups import initialize_model_parallel

    where = f"optimizer step tp={tp} pp={pp} distributed_optimizer={distributed_optimizer}"
    groups = initialize_model_parallel(tp, pp, seed=SEED + 2)
    cfg = model_config(tp, pp)
    chunks = build_model_chunks(cfg, VOCAB, SEQ, groups)
    load_reference(chunks, ref, groups, cfg, tied=False)
    ddp_cfg = DistributedDataParallelConfig(use_distributed_optimizer=distributed_optimizer, grad_reduce_in_fp32=True)
    chunks = [DistributedDataParallel(cfg, ddp_cfg, c, pg_collection=groups.pg_collection) for c in chunks]
    cfg.finalize_model_grads_func = finalize_model_grads
    # eps >> |g| keeps Adam's first step ~linear in g: with a tiny eps it is ~lr*sign(g), which turns
    # fp32 noise in near-zero gradients into full-size steps.
    lr, max_norm, eps = 0.1, 0.01, 0.1
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=lr, adam_eps=eps, weight_decay=0.0, clip_grad=max_norm,
                        use_distributed_optimizer=distributed_optimizer, params_dtype=torch.float32),
        chunks,
    )
    forward_backward(chunks, groups, local_microbatches(groups), make_forward_step(groups, 1, []))
    ok, grad_norm, _ = opt.step()
    cfg.finalize_model_grads_func = None
    ref_norm = torch.sqrt(sum((g.double() ** 2).sum() for g in ref["grads"].values())).item()
    assert ok and abs(grad_norm - ref_norm) <= REL_TOL * ref_norm, f"{where}: grad norm {grad_norm} vs {ref_norm}"
    coeff = min(1.0, max_norm / (ref_norm + 1e-6))
    assert coeff < 1.0  # the clipping path runs
    for ddp in chunks:
        chunk = ddp.module
        for name, p in chunk.named_parameters():
            gname = global_name(chunk, name, groups, cfg, False)
            g = coeff * ref["grads"][gname].double()
            want = (ref["params"][gname].double() - lr * g / (g.abs() + eps)).float()
            close(p.detach(), shard(want, p, name, groups, cfg), f"{where}: updated {gname}")
    if dist.get_rank() == 0:
        print(f"  ok {where}", flush=True)


def check_packed_matches_separate(tp, sp):
    """thd-packed sequences give each sequence's own logits, log-probs, entropy and the summed gradients."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from entr_megatron.learner.model import build_gpt_model, logits_to_logprobs_entropy
    from entr_megatron.parallel.groups import initialize_model_parallel

    groups = initialize_model_parallel(tp, 1, seed=SEED)
    model = build_gpt_model(model_config(tp, sp=sp, num_layers=2), VOCAB, SEQ, groups=groups)
    lens = [5, 9, 2, 8]  # total 24: divisible by tp for SP
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (1, sum(lens)), generator=g)
    targets = torch.randint(0, VOCAB, (1, sum(lens)), generator=g)
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lens),
                             max_seqlen_kv=max(lens))
    logits = model(ids, pos, None, packed_seq_params=packed)
    lp, ent = logits_to_logprobs_entropy(logits, targets, groups.tp)
    (lp.sum() + 0.1 * ent.sum()).backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = None
    for i, n in enumerate(lens):
        s = slice(int(cu[i]), int(cu[i + 1]))
        if sp and n % tp:
            continue  # SP needs the sequence divisible by tp; those rows are covered by the packed run
        one = model(ids[:, s], torch.arange(n)[None], None)
        lp1, ent1 = logits_to_logprobs_entropy(one, targets[:, s], groups.tp)
        close(one, logits[:, s], f"packed tp={tp} sp={sp}: logits of sequence {i}")
        close(lp1, lp[:, s], f"packed tp={tp} sp={sp}: logprobs of sequence {i}")
        close(ent1, ent[:, s], f"packed tp={tp} sp={sp}: entropy of sequence {i}")
        (lp1.sum() + 0.1 * ent1.sum()).backward()
    if not sp:
        for name, p in model.named_parameters():
            close(p.grad, packed_grads[name], f"packed tp={tp}: grad {name}")


# --- launches ---------------------------------------------------------------------------------------

def _two_ranks(rank, world):
    from entr_megatron.parallel.cpu_compat import enable_cpu_compat

    enable_cpu_compat()
    dense = reference()
    run_layout(dense, tp=2)
    run_layout(dense, tp=2, sp=True)
    run_layout(dense, pp=2)
    run_layout(dense, pp=2, vpp=2)  # interleaved: batch_p2p_comm must be off on gloo
    check_optimizer_step(dense, tp=1, distributed_optimizer=True)  # DP=2: optimizer state sharded
    check_optimizer_step(dense, pp=2, distributed_optimizer=False)
    tied = reference(tied=True)
    run_layout(tied, tp=2, tied=True)
    run_layout(tied, pp=2, tied=True)
    moe = reference(moe=True, num_layers=2)
    run_layout(moe, ep=2, moe=True, num_layers=2)
    run_layout(moe, ep=2, moe=True, dispatcher="allgather", num_layers=2)
    run_layout(moe, pp=2, moe=True, num_layers=2)
    check_packed_matches_separate(tp=1, sp=False)
    check_packed_matches_separate(tp=2, sp=False)
    check_packed_matches_separate(tp=2, sp=True)


def _four_ranks(rank, world):
    from entr_megatron.parallel.cpu_compat import enable_cpu_compat

    enable_cpu_compat()
    dense = reference()
    run_layout(dense, tp=2, pp=2)
    run_layout(dense, tp=2, pp=2, sp=True)
    check_optimizer_step(dense, tp=2, distributed_optimizer=True)  # TP=2 x DP=2
    moe = reference(moe=True, num_layers=2)
    run_layout(moe, tp=2, ep=2, sp=True, moe=True, dispatcher="allgather", num_layers=2)
    run_layout(moe, pp=2, ep=2, moe=True, num_layers=2)


def test_layouts_on_two_ranks_match_single_rank_reference():
    run_gloo(_two_ranks, 2, timeout_s=400)


def test_layouts_on_four_ranks_match_single_rank_reference():
    run_gloo(_four_ranks, 4, timeout_s=400)


def test_logits_layouts_give_the_same_logprobs():
    """[b, s, V] (GPTModel's output) and [s, b, V] (the output layer's) are both handled, without copies."""
    from entr_megatron.learner.model import logits_to_logprobs_entropy

    logits_bsv = torch.randn(3, 5, 32)
    targets = torch.randint(0, 32, (3, 5))
    lp, ent = logits_to_logprobs_entropy(logits_bsv, targets, None)
    lp2, ent2 = logits_to_logprobs_entropy(logits_bsv.transpose(0, 1).contiguous(), targets, None, layout="sbv")
    assert lp2.shape == (3, 5)
    torch.testing.assert_close(lp2, lp, rtol=0, atol=1e-6)
    torch.testing.assert_close(ent2, ent, rtol=0, atol=1e-6)
    want = torch.log_softmax(logits_bsv.double(), -1).gather(-1, targets[..., None])[..., 0]
    torch.testing.assert_close(lp.double(), want, rtol=0, atol=1e-5)


def test_transformer_engine_spec_is_refused_without_it():
    from entr_megatron.learner.spec import get_layer_spec, te_available

    if te_available():
        pytest.skip("TransformerEngine and a GPU are present")
    with pytest.raises(ValueError, match="use_te=True"):
        get_layer_spec(model_config(), use_te=True)
