"""Learner checkpoints on gloo ranks: resharding loads, bit-identical resume, atomic saves, clear errors.

Everything runs through the learner itself (``wrap_model_chunks``, ``build_optimizer``,
``train_step`` and ``compute_logprobs`` on ``TrainBatch``es). Two 2-rank launches:

1. resharding: a TP=2 learner (DDP + distributed Adam, one step taken) is saved,
   then loaded into fresh TP=2, TP=1 x DP=2, TP=1 x PP=2 and TP=1 x PP=2 x VPP=2
   learners: every weight equals the TP=2 weights (bit for bit), the log-probs
   of a batch equal TP=2's (bit for bit in the same layout, to fp32 rounding in
   others), and one more step lands where TP=2's own next step did (so Adam's
   moments, its step count and the LR schedule were resharded too); the VPP
   chunks are saved and loaded back at TP=2; the ``dp_reshardable`` optimizer
   format resumes exactly in its layout and is refused in another;
2. resume (TP=2, dropout 0.2, LR warm-up + cosine), with the plain and the
   distributed optimizer: 3 steps uninterrupted versus 1 step, save, everything
   rebuilt from another seed, load, 2 steps: losses and weights bit-identical
   after steps 2 and 3 (and not without the RNG restore); then a save that
   crashes after writing is one error naming the step, its partial files removed,
   ``latest`` and the last checkpoint intact; a killed save's leftovers go (logged)
   at the next load/save, ``keep_last`` prunes; a flipped byte in the newest
   checkpoint is named and the load falls back to the one before (bit-identical
   weights), as it does when ``latest`` names a deleted checkpoint; then the
   errors for a missing / empty / incomplete checkpoint, an unknown step and a
   model that does not match.
"""

from __future__ import annotations

import logging
import math
import os
import random
import re
import shutil
import subprocess

import numpy as np
import pytest
import torch
import torch.distributed as dist

from common import close, model_config
from entr_megatron.utils.spawn import run_gloo

VOCAB, MAX_SEQ = 128, 32


# --- model, optimizer, data (the learner's own build, step and log-prob forward) -------------------

def learner_config(distributed_optimizer):
    from entr_megatron.config.learner import LearnerConfig, OptimConfig

    # LR warm-up and cosine decay: the schedule's position must survive a resume. eps >> |g|
    # keeps Adam ~linear in g, so fp32 noise across layouts stays fp32 noise.
    return LearnerConfig(max_tokens_per_microbatch=24, optim=OptimConfig(
        lr=0.05, lr_warmup_init=0.01, lr_warmup_steps=2, lr_decay_style="cosine", lr_decay_steps=10,
        weight_decay=0.01, adam_eps=0.1, clip_grad=1.0, use_distributed_optimizer=distributed_optimizer))


def build(groups, cfg, distributed_optimizer=True, **model_kwargs):
    """The learner of this layout: DDP-wrapped chunks, Megatron's (distributed) Adam, LR schedule."""
    from types import SimpleNamespace

    from entr_megatron.learner.model import build_model_chunks
    from entr_megatron.learner.optimizer import build_optimizer, wrap_model_chunks

    learner_cfg = learner_config(distributed_optimizer)
    chunks = wrap_model_chunks(build_model_chunks(cfg, VOCAB, MAX_SEQ, groups, **model_kwargs), groups, learner_cfg)
    opt, sched = build_optimizer(chunks, learner_cfg)
    return SimpleNamespace(chunks=chunks, opt=opt, sched=sched, groups=groups, cfg=learner_cfg)


def make_batch(seed, num_seqs=6):
    """Variable-length prompt + response samples with behaviour log-probs (a noisy ~uniform policy)."""
    from entr_megatron.types import Sample, TrainBatch

    g = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(num_seqs):
        p, r = int(torch.randint(1, 5, (1,), generator=g)), int(torch.randint(2, 11, (1,), generator=g))
        samples.append(Sample(
            prompt_ids=torch.randint(0, VOCAB, (p,), generator=g).tolist(),
            response_ids=torch.randint(0, VOCAB, (r,), generator=g).tolist(),
            behaviour_logprobs=(-math.log(VOCAB) + 0.3 * torch.randn(r, generator=g)).tolist(),
            versions=[3] * r,
        ))
    return TrainBatch.from_samples(samples, torch.randn(num_seqs, generator=g))


def train(learner, batch):
    """One ``learner.train_step`` on the global ``batch``; the loss (the same float on every rank)."""
    from entr_megatron.config.algorithm import AlgorithmConfig
    from entr_megatron.learner.batching import split_for_data_parallel
    from entr_megatron.learner.trainer import train_step

    g = learner.groups
    local = split_for_data_parallel(batch, g.dp_size)[g.dp_rank]
    metrics = train_step(learner.chunks, learner.opt, learner.sched, local, g, AlgorithmConfig(), learner.cfg)
    assert metrics["optim/skipped"] == 0.0
    return metrics["loss"]


def all_logprobs(learner, batch):
    """``learner.compute_logprobs`` of the whole global batch, ``[T]``, on every rank."""
    from entr_megatron.learner.batching import split_for_data_parallel
    from entr_megatron.learner.trainer import compute_logprobs

    g = learner.groups
    lp, _ = compute_logprobs(learner.chunks, split_for_data_parallel(batch, g.dp_size)[g.dp_rank], g, learner.cfg)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (g.dp_rank, lp) if lp is not None else None)
    by_dp_rank = dict(x for x in everyone if x is not None)  # TP ranks of a replica agree
    return torch.cat([by_dp_rank[r] for r in range(g.dp_size)])


# --- weights across layouts ------------------------------------------------------------------

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def named_local_params(chunks):
    """``{global name: parameter}``: layer indices made global (pipeline offsets)."""
    from megatron.core.utils import unwrap_model

    out = {}
    for chunk in unwrap_model(chunks):
        for name, p in chunk.named_parameters():
            m = _LAYER.match(name)
            if m:
                name = f"decoder.layers.{chunk.decoder.layers[int(m.group(1))].layer_number - 1}." + name[m.end():]
            out[name] = p
    return out


def gather_full_params(chunks, groups):
    """The full (TP=1, PP=1) tensors of the model, on every rank."""
    mine = {n: (p.detach().clone(), getattr(p, "partition_dim", -1) if getattr(p, "tensor_model_parallel", False)
                else None) for n, p in named_local_params(chunks).items()}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (groups.tp_rank, mine))
    by_name = {}  # name -> {tp rank: (tensor, dim)}; DP replicas are identical
    for tp_rank, params in everyone:
        for name, value in params.items():
            by_name.setdefault(name, {})[tp_rank] = value
    full = {}
    for name, shards in by_name.items():
        t, dim = shards[0]
        if dim is None or groups.tp_size == 1:
            full[name] = t
            continue
        pieces = [shards[r][0] for r in range(groups.tp_size)]
        if name.endswith("linear_fc1.weight"):  # gated: every rank holds [gate; up] of its columns
            halves = [p.chunk(2, dim) for p in pieces]
            gate, up = (torch.cat([h[i] for h in halves], dim) for i in (0, 1))
            full[name] = torch.cat([gate, up], dim)
        else:
            full[name] = torch.cat(pieces, dim)
    return full


def shard(full, p, name, groups):
    """This TP rank's piece of the full tensor ``full`` for local parameter ``p``."""
    if full.shape == p.shape:
        return full
    dim, rank, size = p.partition_dim, groups.tp_rank, groups.tp_size
    if name.endswith("linear_fc1.weight"):
        return torch.cat([half.chunk(size, dim)[rank] for half in full.chunk(2, dim)], dim)
    return full.chunk(size, dim)[rank]


def check_params(learner, full, what, exact):
    """Every local weight equals (``exact``) or is close to its piece of the full tensor in ``full``."""
    local = named_local_params(learner.chunks)
    for name, p in local.items():
        want = shard(full[name], p, name, learner.groups)
        if exact:
            assert torch.equal(p.detach(), want), f"{what}: {name} differs"
        else:
            close(p.detach(), want, f"{what}: {name}")
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, sorted(local))
    missing = set(full) - set().union(*map(set, everyone))
    assert not missing, f"{what}: parameters never compared: {sorted(missing)}"


def log0(msg):
    if dist.get_rank() == 0:
        print(f"  ok {msg}", flush=True)


# --- launch 1: resharding -------------------------------------------------------------------------

def _reshard(rank, world, root):
    from entr_megatron.checkpoint.directory import CheckpointError
    from entr_megatron.checkpoint.io import load_checkpoint, save_checkpoint
    from entr_megatron.parallel.cpu_compat import enable_cpu_compat
    from entr_megatron.parallel.groups import initialize_model_parallel

    enable_cpu_compat()
    batch, eval_batch = make_batch(1), make_batch(2)

    def fresh(tp=1, pp=1, vpp=None, seed=13):
        return build(initialize_model_parallel(tp=tp, pp=pp, vpp=vpp, seed=seed), model_config(tp, pp, vpp=vpp))

    L = fresh(tp=2, seed=11)
    train(L, batch)
    saved_params = gather_full_params(L.chunks, L.groups)
    saved_logprobs = all_logprobs(L, eval_batch)
    save_checkpoint(root, 1, L.chunks, L.opt, L.sched, extra_state={"data_position": 4} if rank == 0 else None)
    train(L, batch)
    next_params = gather_full_params(L.chunks, L.groups)

    # Same layout: everything bit-identical.
    L = fresh(tp=2, seed=12)
    assert load_checkpoint(root, L.chunks, L.opt, L.sched) == (1, {"data_position": 4})
    check_params(L, saved_params, "tp=2 -> tp=2", exact=True)
    assert torch.equal(all_logprobs(L, eval_batch), saved_logprobs)
    log0("tp=2 -> tp=2: weights and log-probs bit-identical")

    for tp, pp, vpp in ((1, 1, None), (1, 2, None), (1, 2, 2)):  # TP=1 x DP=2, TP=1 x PP=2, ... x VPP=2
        where = f"tp=2 -> tp={tp} pp={pp} vpp={vpp}"
        L = fresh(tp, pp, vpp)
        assert load_checkpoint(root, L.chunks, L.opt, L.sched) == (1, {"data_position": 4})
        assert L.sched.num_steps == 1, L.sched.num_steps
        check_params(L, saved_params, where, exact=True)
        close(all_logprobs(L, eval_batch), saved_logprobs, f"{where}: log-probs")
        # Adam's moments and step count were resharded too: the next step lands where TP=2's did.
        train(L, batch)
        check_params(L, next_params, f"{where}: after one more step", exact=False)
        log0(f"{where}: weights bit-identical, log-probs and the next optimizer step match")

    # And back: the two VPP chunks of each rank saved, loaded at TP=2.
    vpp_params, vpp_logprobs = gather_full_params(L.chunks, L.groups), all_logprobs(L, eval_batch)
    save_checkpoint(root, 2, L.chunks, L.opt, L.sched)
    L = fresh(tp=2, seed=14)
    assert load_checkpoint(root, L.chunks, L.opt, L.sched) == (2, None)
    check_params(L, vpp_params, "pp=2 vpp=2 -> tp=2", exact=True)
    close(all_logprobs(L, eval_batch), vpp_logprobs, "pp=2 vpp=2 -> tp=2: log-probs")
    log0("pp=2 vpp=2 -> tp=2: weights bit-identical, log-probs match")

    # dp_reshardable (each DP rank writes its own flat optimizer shard): exact in its layout, refused elsewhere.
    L = fresh(seed=15)  # TP=1 x DP=2
    load_checkpoint(root, L.chunks, L.opt, L.sched, step=1)
    train(L, batch)
    save_checkpoint(root, 3, L.chunks, L.opt, L.sched, distributed_optimizer_format="dp_reshardable")
    train(L, make_batch(3))
    want = gather_full_params(L.chunks, L.groups)
    L = fresh(seed=16)
    assert load_checkpoint(root, L.chunks, L.opt, L.sched) == (3, None)
    train(L, make_batch(3))
    check_params(L, want, "dp_reshardable resume", exact=True)
    L = fresh(tp=2, seed=17)
    with pytest.raises(CheckpointError, match="'dp_reshardable', which loads only where the model parallel sizes"):
        load_checkpoint(root, L.chunks, L.opt, L.sched)
    log0("dp_reshardable: the next step after a load is bit-identical at TP=1 x DP=2; TP=2 is refused")


# --- launch 2: resume, atomicity, errors ---------------------------------------------------------

def _resume(rank, world, root, tiny_fs=""):
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from entr_megatron.checkpoint import io as checkpoint
    from entr_megatron.checkpoint.directory import CheckpointError, CheckpointNotFoundError, latest_step
    from entr_megatron.checkpoint.io import load_checkpoint, save_checkpoint
    from entr_megatron.parallel.cpu_compat import enable_cpu_compat
    from entr_megatron.parallel.groups import initialize_model_parallel

    enable_cpu_compat()
    batches = [make_batch(10 + i) for i in range(3)]
    extra = {"next_batch": 1, "buffer": [("a", 1.5)]}

    def fresh(seed, distributed_optimizer=True, **kwargs):
        cfg = model_config(tp=2, dropout=0.2, **kwargs)  # dropout: the RNG streams matter
        return build(initialize_model_parallel(tp=2, seed=seed), cfg, distributed_optimizer)

    def snapshot(L):
        return {n: p.detach().clone() for n, p in named_local_params(L.chunks).items()}

    for dist_opt in (False, True):  # the distributed one last: the checks below use its run
        where = f"resume (distributed_optimizer={dist_opt}, dropout 0.2)"
        ckpt = root if dist_opt else root + "_plain"
        L = fresh(21, dist_opt)  # uninterrupted
        want_loss, want_params = [], []
        for b in batches:
            want_loss.append(train(L, b))
            want_params.append(snapshot(L))

        L = fresh(21, dist_opt)  # one step, save, rebuild everything from another seed, load, two more
        assert train(L, batches[0]) == want_loss[0]
        save_checkpoint(ckpt, 1, L.chunks, L.opt, L.sched, extra_state=extra)
        host_draws = (random.random(), np.random.rand())  # python and numpy streams, saved per rank
        L = fresh(99, dist_opt)
        random.seed(0), np.random.seed(0)
        assert load_checkpoint(ckpt, L.chunks, L.opt, L.sched) == (1, extra)
        assert (random.random(), np.random.rand()) == host_draws
        for i in (1, 2):
            loss = train(L, batches[i])
            assert loss == want_loss[i], f"{where}: step {i + 1}: loss {loss!r} != {want_loss[i]!r}"
            got = snapshot(L)
            for name, t in want_params[i].items():
                assert torch.equal(got[name], t), f"{where}: step {i + 1}: {name} differs from the uninterrupted run"
        log0(f"{where}: losses and weights of steps 2 and 3 bit-identical to the uninterrupted run")

    # Control: the RNG restore is what makes it exact (dropout draws from both generators).
    L = fresh(99)
    load_checkpoint(root, L.chunks, L.opt, L.sched)
    torch.manual_seed(98)  # other streams for the default and the model-parallel generators
    model_parallel_cuda_manual_seed(98, force_reset_rng=True)
    assert train(L, batches[1]) != want_loss[1]
    log0("control: without the saved RNG states step 2 differs")

    # Megatron cannot move optimizer state between its distributed and plain optimizers.
    L = fresh(99, distributed_optimizer=False)
    with pytest.raises(CheckpointError, match="distributed optimizer.*use_distributed_optimizer=True"):
        load_checkpoint(root, L.chunks, L.opt, L.sched)
    log0("a distributed-optimizer checkpoint refuses a plain optimizer, with a clear error")

    # A save that crashes after writing everything but before publishing it.
    real_write = checkpoint._write

    def write_then_crash(*args, **kwargs):
        real_write(*args, **kwargs)
        raise OSError("simulated crash mid-save")

    L = fresh(98)
    checkpoint._write = write_then_crash
    rank0_says = "; its partial files were removed, the checkpoint of step 1 is intact" if rank == 0 else ""
    with pytest.raises(CheckpointError, match=f"step 2 .*failed.*OSError: simulated crash mid-save{rank0_says}"):
        save_checkpoint(root, 2, L.chunks, L.opt, L.sched, extra_state={"next_batch": 2})
    checkpoint._write = real_write
    dist.barrier()
    assert latest_step(root) == 1
    if rank == 0:  # it removed the partial save
        assert sorted(os.listdir(root)) == ["iter_0000001", "latest"], os.listdir(root)
    dist.barrier()
    if rank == 0:  # the debris of a save killed outright (no chance to clean up)
        os.makedirs(os.path.join(root, ".tmp_iter_0000002"))
    dist.barrier()
    assert load_checkpoint(root, L.chunks, L.opt, L.sched) == (1, extra)
    got = named_local_params(L.chunks)
    assert all(torch.equal(got[n].detach(), t) for n, t in want_params[0].items()), "weights of step 1 after the crash"
    assert sorted(os.listdir(root)) == ["iter_0000001", "latest"], "the load removes the leftovers"
    log0("crash mid-save: one-line error, partial files removed, step 1 loads; a killed save's leftovers are "
         "removed by the next load")

    # The leftovers of a crashed save are also removed (and logged) by the next save; keep_last prunes.
    dist.barrier()  # everyone has looked before rank 0 makes new leftovers
    if rank == 0:
        os.makedirs(os.path.join(root, ".tmp_iter_0000002"))
    dist.barrier()
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("entr_megatron.checkpoint.directory").addHandler(handler)
    save_checkpoint(root, 2, L.chunks, L.opt, L.sched)
    save_checkpoint(root, 3, L.chunks, L.opt, L.sched, keep_last=2)
    if rank == 0:
        assert any(".tmp_iter_0000002" in r.getMessage() for r in records), [r.getMessage() for r in records]
    assert latest_step(root) == 3
    assert sorted(os.listdir(root)) == ["iter_0000002", "iter_0000003", "latest"], os.listdir(root)
    assert load_checkpoint(root, L.chunks, L.opt, L.sched, step=2)[0] == 2
    log0("stale temporaries cleaned and logged by the next save; keep_last=2 keeps steps 2 and 3")

    # Damaged bytes in the newest checkpoint: named, and the load falls back to step 2.
    want = {n: t.detach().clone() for n, t in named_local_params(L.chunks).items()}  # step 2's weights
    dist.barrier()
    if rank == 0:
        shard = os.path.join(root, "iter_0000003", "__0_0.distcp")
        with open(shard, "r+b") as f:
            f.seek(os.path.getsize(shard) // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))
    dist.barrier()
    with pytest.raises(CheckpointError, match=r"iter_0000003 is damaged: __0_0.distcp: SHA-256 differs"):
        load_checkpoint(root, L.chunks, L.opt, L.sched, step=3)
    records.clear()
    logging.getLogger("entr_megatron.checkpoint.io").addHandler(handler)
    L2 = fresh(77)
    assert load_checkpoint(root, L2.chunks, L2.opt, L2.sched)[0] == 2
    got = named_local_params(L2.chunks)
    assert all(torch.equal(got[n].detach(), t) for n, t in want.items()), "the fallback loads step 2's weights"
    if rank == 0:
        assert any("skipping" in r.getMessage() and "iter_0000003" in r.getMessage() for r in records)
    log0("a flipped byte in step 3 is named; the load falls back to step 2, bit-identical")
    dist.barrier()
    if rank == 0:
        shutil.rmtree(os.path.join(root, "iter_0000003"))
        os.remove(os.path.join(root, "latest"))
        with open(os.path.join(root, "latest"), "w") as f:
            f.write("3\n")
    dist.barrier()

    # Errors.
    missing = os.path.join(root, "nowhere")
    with pytest.raises(CheckpointNotFoundError, match=re.escape(missing) + ".*does not exist"):
        load_checkpoint(missing, L.chunks)
    empty = os.path.join(root + "_empty")
    if rank == 0:
        os.makedirs(empty)
    dist.barrier()
    with pytest.raises(CheckpointNotFoundError, match=re.escape(empty) + ": no 'latest' file.*empty directory"):
        load_checkpoint(empty, L.chunks)
    with pytest.raises(CheckpointNotFoundError, match=r"step 7.*complete steps there: \[2\]"):
        load_checkpoint(root, L.chunks, step=7)
    dist.barrier()
    if rank == 0:
        shutil.copytree(os.path.join(root, "iter_0000002"), os.path.join(root, "iter_0000004"))
        os.remove(os.path.join(root, "iter_0000004", "metadata.json"))
    dist.barrier()
    with pytest.raises(CheckpointError, match="incomplete checkpoint .*iter_0000004.*metadata.json missing"):
        load_checkpoint(root, L.chunks, step=4)
    # Megatron stacks a block's layers: another layer count is another global shape.
    small = fresh(5, num_layers=3)
    shape_error = r"global shapes differ: .*decoder\.layers\..* \(checkpoint \[4, .*model \[3, "
    with pytest.raises(CheckpointError, match=shape_error):
        load_checkpoint(root, small.chunks)
    tied = build(initialize_model_parallel(tp=2, seed=5), model_config(tp=2), tie_embeddings=True)
    with pytest.raises(CheckpointError, match=r"the checkpoint has keys the model lacks: output_layer\.weight"):
        load_checkpoint(root, tied.chunks)
    # `latest` names step 3, deleted above: the newest good one (2) loads, with the shared embedding
    assert load_checkpoint(root, tied.chunks, strict=False)[0] == 2
    log0("errors: missing, empty, unknown step, incomplete, mismatched model")

    if tiny_fs:  # a file system too small for a checkpoint: the save says so and leaves nothing behind
        with pytest.raises(CheckpointError, match="no space left on device .ENOSPC.*partial files were removed"
                           if rank == 0 else "step 9 .* failed"):
            big = fresh(6)
            save_checkpoint(tiny_fs, 9, big.chunks, big.opt, big.sched)
        dist.barrier()
        assert not [n for n in os.listdir(tiny_fs) if n.startswith(".tmp_iter")], os.listdir(tiny_fs)
        log0("a full disk: ENOSPC in one line, no partial files left")


def test_checkpoint_reshards_tp2_to_tp1_and_pp2(tmp_path):
    """Save at TP=2; load at TP=2, TP=1 x DP=2, TP=1 x PP=2, PP=2 x VPP=2 and back (module docstring, 1)."""
    run_gloo(_reshard, 2, str(tmp_path / "ckpt"), timeout_s=400)


def test_resume_is_bit_identical_and_saves_are_atomic(tmp_path):
    """Resume bit-identical, crash mid-save, stale leftovers, keep_last, damage, errors, a full disk
    (a 256 KiB tmpfs, where one can be mounted) (module docstring, 2)."""
    small = tmp_path / "small"
    small.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(small)],
                             capture_output=True).returncode == 0
    try:
        run_gloo(_resume, 2, str(tmp_path / "ckpt"), str(small) if mounted else "", timeout_s=400)
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(small)], check=False)


# --- the directory protocol, in process ------------------------------------------------------------

def _fake_checkpoint(path):
    from entr_megatron.checkpoint.directory import COMPLETE_MARKERS
    from entr_megatron.checkpoint.manifest import data_files, digest_files, write_manifest

    path.mkdir(parents=True, exist_ok=True)
    for name in COMPLETE_MARKERS:
        (path / name).write_text("x")
    write_manifest(path, 0, digest_files(path, data_files(path)))


def test_commit_replaces_a_step_and_interrupted_replacements_are_undone(tmp_path):
    from entr_megatron.checkpoint.directory import clean_stale, commit, latest_step, list_steps, prepare_tmp_dir

    for step in (1, 2):
        _fake_checkpoint(prepare_tmp_dir(tmp_path, step))
        commit(tmp_path, step)
    assert (list_steps(tmp_path), latest_step(tmp_path)) == ([1, 2], 2)
    # A save of step 1 again that died between moving the old one aside and publishing the new one:
    os.replace(tmp_path / "iter_0000001", tmp_path / ".tmp_old_iter_0000001")
    _fake_checkpoint(tmp_path / ".tmp_iter_0000001")
    assert clean_stale(tmp_path) == [".tmp_iter_0000001"]
    assert sorted(os.listdir(tmp_path)) == ["iter_0000001", "iter_0000002", "latest"]
    # Saving a step again replaces it; keep_last prunes by step number, never the step just saved.
    _fake_checkpoint(prepare_tmp_dir(tmp_path, 2))
    (tmp_path / ".tmp_iter_0000002" / "new").write_text("x")
    commit(tmp_path, 2)
    assert (tmp_path / "iter_0000002" / "new").exists() and latest_step(tmp_path) == 2
    _fake_checkpoint(prepare_tmp_dir(tmp_path, 3))
    commit(tmp_path, 3, keep_last=2)
    assert sorted(os.listdir(tmp_path)) == ["iter_0000002", "iter_0000003", "latest"]
    _fake_checkpoint(prepare_tmp_dir(tmp_path, 1))  # a rollback: the higher steps are neither counted nor deleted
    commit(tmp_path, 1, keep_last=1)
    assert sorted(os.listdir(tmp_path)) == ["iter_0000001", "iter_0000002", "iter_0000003", "latest"]
    assert latest_step(tmp_path) == 1
    _fake_checkpoint(prepare_tmp_dir(tmp_path, 0))
    commit(tmp_path, 0, keep_last=2)
    _fake_checkpoint(prepare_tmp_dir(tmp_path, 2))  # back past the damaged or abandoned 3: 0 goes, 1 stays
    commit(tmp_path, 2, keep_last=2)
    assert sorted(os.listdir(tmp_path)) == ["iter_0000001", "iter_0000002", "iter_0000003", "latest"]


def test_latest_and_incomplete_checkpoints_are_reported(tmp_path):
    from entr_megatron.checkpoint.directory import (
        CheckpointError,
        commit,
        latest_step,
        resolve_checkpoint_dir,
    )

    assert latest_step(tmp_path) is None
    (tmp_path / "latest").write_text("oops")
    with pytest.raises(CheckpointError, match="latest: expected a step number, found 'oops'"):
        latest_step(tmp_path)
    (tmp_path / ".tmp_iter_0000005").mkdir()
    with pytest.raises(CheckpointError, match="refusing to publish .*common.pt, .metadata, metadata.json, "
                                              "manifest.json missing"):
        commit(tmp_path, 5)
    (tmp_path / "latest").write_text("5\n")
    (tmp_path / "iter_0000005").mkdir()
    with pytest.raises(CheckpointError, match="incomplete checkpoint .*iter_0000005: common.pt"):
        resolve_checkpoint_dir(tmp_path)
