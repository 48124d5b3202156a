"""The ranks of `entr-megatron convert`: build the learner model, stream tensors in or out.

    run_ranks(job)        # spawns tp*pp ranks (gloo on CPU); returns rank 0's / the writers' records

hf-to-megatron: each rank builds its chunks without initialising them, reads the HF tensors of
its own parameters one at a time (`hf_load.load_hf_weights`), checks the Megatron config against
the model's, and saves step 0 of a dist checkpoint root (`checkpoint.io.save_checkpoint`); for
--verify it then builds the model again and loads it back from that checkpoint, so what is
checked is what was written. megatron-to-hf: load the checkpoint (any layout: dist checkpoints
reshard), and stream `hf_export.iter_hf_weights` into safetensors shards, one writer per
pipeline stage, each shard written as soon as it is full.

This module joins `learner` and `checkpoint`, which do not import each other (the layers of
ARCHITECTURE.md), so it lives with the command.
"""

from __future__ import annotations

import gc
import math
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from entr_megatron import models

__all__ = ["DTYPES", "RankJob", "full_logprobs", "run_ranks", "world_size"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
PROGRESS_EVERY_S = 5.0
# An exception's last line in a rank's traceback: "ValueError: ..." / "entr_megatron...CheckpointError: ...".
_ERROR_LINE = re.compile(r"^(?:[\w.]+\.)?\w*(?:Error|Exception): ", re.M)


@dataclass(frozen=True)
class RankJob:
    """What each spawned rank needs (pickled to the ranks)."""

    direction: str  # "hf-to-megatron", "megatron-to-hf" or "verify" (load a checkpoint, score only)
    hf_config: dict
    ckpt_root: str  # hf-to-megatron: the (staged) output root; megatron-to-hf: the source root
    tp: int = 1
    pp: int = 1
    ep: int = 1
    dtype: str = "fp32"
    hf_dir: str | None = None  # hf-to-megatron: the source
    step: int | None = None  # megatron-to-hf: the step to load (None: latest)
    out_dir: str | None = None  # megatron-to-hf: the (staged) HF output directory
    max_shard_bytes: int = 5 * 10**9
    allow_unmapped: tuple[str, ...] = ()
    verify_sequences: list[list[int]] = field(default_factory=list)
    results_dir: str = ""


class _Progress:
    """Bytes and tensors on stderr (rank 0): tqdm when it is installed, else a line every few seconds."""

    def __init__(self, what: str, enabled: bool):
        self.what, self.enabled, self.bytes, self.tensors = what, enabled, 0, 0
        self.started = self.last = time.monotonic()
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(desc=what, unit="B", unit_scale=True, file=sys.stderr, mininterval=1.0)
            except ImportError:
                pass

    def __call__(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        self.bytes += nbytes
        self.tensors += 1
        if self.bar is not None:
            self.bar.update(nbytes)
            self.bar.set_postfix(tensors=self.tensors, refresh=False)
        elif self.enabled and time.monotonic() - self.last >= PROGRESS_EVERY_S:
            self.last = time.monotonic()
            print(f"  {self.what}: {self.tensors} tensors, {self.bytes / 1e9:.2f} GB", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.enabled:
            rate = self.bytes / max(time.monotonic() - self.started, 1e-9) / 1e9
            print(f"  {self.what}: {self.tensors} tensors, {self.bytes / 1e9:.3f} GB ({rate:.2f} GB/s) on rank 0",
                  file=sys.stderr, flush=True)


def _build(job: RankJob, groups):
    """This rank's chunks, uninitialised (every weight is about to be overwritten), and the spec."""
    from entr_megatron.learner.build import build_learner_model_from_hf

    return build_learner_model_from_hf(job.hf_config, groups, load_weights=False, dtype=DTYPES[job.dtype],
                                       config_overrides={"perform_initialization": False})


def check_megatron_config(chunks, spec: models.ModelSpec) -> None:
    """Every TransformerConfig field the HF config decides must be what the built model has."""
    config = chunks[0].config
    for key, want in models.transformer_config_kwargs(spec).items():
        if key == "activation_func":
            want = models.ACTIVATIONS[want]
        got = getattr(config, key)
        if got != want:
            raise ValueError(f"config mismatch: TransformerConfig.{key} is {got!r}, the HF config implies {want!r}")


@torch.no_grad()
def full_logprobs(chunks, spec: models.ModelSpec, groups, sequences) -> list[torch.Tensor] | None:
    """Next-token log-probs [L, V] (float64 log_softmax, true vocabulary) of equal-length sequences,
    one micro-batch each through Megatron's forward-only schedule; on the last stage (else None).
    The vocab-sharded logits are gathered over TP: meant for a few short verify sequences."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    length = len(sequences[0])
    assert all(len(s) == length for s in sequences) and length % groups.tp_size == 0, length
    data = iter([(torch.tensor([list(s)]), torch.arange(length)[None]) for s in sequences])

    def forward_step(data_iterator, model):
        ids, positions = next(data_iterator)
        output = model(ids, positions, None)

        def loss_func(logits_BLv):
            parts = [torch.empty_like(logits_BLv) for _ in range(groups.tp_size)]
            dist.all_gather(parts, logits_BLv.contiguous(), group=groups.tp)
            logits_LV = torch.cat(parts, -1)[0, :, : spec.vocab_size].double()
            return logits_BLv.new_zeros(()), {"lp": torch.log_softmax(logits_LV, -1)}

        return output, loss_func

    for chunk in chunks:
        chunk.eval()
    fwd_bwd = get_forward_backward_func(pp_size=groups.pp_size, vp_size=groups.vpp_size)
    stored = fwd_bwd(forward_step_func=forward_step, data_iterator=data, model=chunks,
                     num_microbatches=len(sequences), seq_length=length, micro_batch_size=1, forward_only=True)
    return [out["lp"] for out in stored] if groups.is_last_stage() else None


def _save_verify(job: RankJob, chunks, spec, groups) -> None:
    """The last stage's TP/DP rank 0 writes the verify log-probs for the parent."""
    lp = full_logprobs(chunks, spec, groups, job.verify_sequences)
    if lp is not None and groups.tp_rank == 0 and groups.dp_rank == 0 and groups.cp_rank == 0:
        torch.save(lp, Path(job.results_dir) / "verify.pt")


def _hf_to_megatron(job: RankJob, groups) -> dict:
    from entr_megatron.checkpoint.io import load_checkpoint, save_checkpoint
    from entr_megatron.learner.hf_load import load_hf_weights

    chunks, spec = _build(job, groups)
    check_megatron_config(chunks, spec)
    progress = _Progress("reading HF tensors", dist.get_rank() == 0)
    skipped = load_hf_weights(chunks, spec, groups, job.hf_dir, allow_unmapped=job.allow_unmapped, progress=progress)
    progress.close()
    t0 = time.monotonic()
    save_checkpoint(job.ckpt_root, 0, chunks, model_config=job.hf_config)
    record = {"skipped": skipped, "save_s": time.monotonic() - t0, "rank0_tensors": progress.tensors,
              "rank0_bytes": progress.bytes}
    if job.verify_sequences:
        del chunks
        gc.collect()
        chunks, spec = _build(job, groups)  # what was written, not what is in memory
        load_checkpoint(job.ckpt_root, chunks, cleanup=False, verify=False)  # its manifest was just written
        _save_verify(job, chunks, spec, groups)
    return record


def _megatron_to_hf(job: RankJob, groups) -> dict:
    from entr_megatron.checkpoint.hf_files import ShardWriter
    from entr_megatron.checkpoint.io import load_checkpoint
    from entr_megatron.learner.hf_export import iter_hf_weights

    chunks, spec = _build(job, groups)
    check_megatron_config(chunks, spec)
    # verify=False: the command checked the files against the manifest before starting the ranks.
    step, _ = load_checkpoint(job.ckpt_root, chunks, step=job.step, cleanup=False, verify=False)
    if job.verify_sequences:
        _save_verify(job, chunks, spec, groups)
    if job.direction == "verify":
        return {"step": step}
    writer = None
    if groups.tp_rank == 0 and groups.dp_rank == 0 and groups.cp_rank == 0:  # one writer per stage
        writer = ShardWriter(Path(job.out_dir), job.max_shard_bytes, prefix=f"stage{groups.pp_rank:03d}")
    progress = _Progress("writing HF tensors", dist.get_rank() == 0)
    for name, tensor in iter_hf_weights(chunks, spec, groups, layout="checkpoint"):
        if writer is not None:
            writer.add(name, tensor)
        progress(name, tensor)
    if writer is not None:
        writer.finish()
    progress.close()
    return {"step": step, "rank0_tensors": progress.tensors, "rank0_bytes": progress.bytes}


def _rank(rank: int, world: int, job: RankJob) -> None:
    from entr_megatron.parallel.cpu_compat import enable_cpu_compat
    from entr_megatron.parallel.groups import destroy, initialize_model_parallel

    enable_cpu_compat()
    groups = initialize_model_parallel(job.tp, job.pp, ep=job.ep)
    work = _hf_to_megatron if job.direction == "hf-to-megatron" else _megatron_to_hf
    record = work(job, groups)
    if rank == 0:
        torch.save(record, Path(job.results_dir) / "record.pt")
    destroy()


def world_size(tp: int, pp: int, ep: int) -> int:
    """Ranks for TP x PP x EP: expert parallelism is carved out of data parallelism (tp * dp must be a
    multiple of ep), so the data-parallel size is the smallest that allows it."""
    return tp * pp * (ep // math.gcd(ep, tp))


def run_ranks(job: RankJob, timeout_s: float = 24 * 3600.0) -> dict:
    """Run the job on tp*pp spawned gloo ranks; rank 0's record, with "verify" (the log-probs) when
    asked. A failed rank raises RuntimeError with its error's message (or its traceback)."""
    from entr_megatron.utils.spawn import run_gloo

    try:
        run_gloo(_rank, world_size(job.tp, job.pp, job.ep), job, timeout_s=timeout_s)
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
        text = str(e).strip()
        found = list(_ERROR_LINE.finditer(text))
        message = text[found[-1].end():] if found else text
        raise RuntimeError(message.strip()) from None
    record = torch.load(Path(job.results_dir) / "record.pt")
    verify = Path(job.results_dir) / "verify.pt"
    if verify.exists():
        record["verify"] = torch.load(verify)
    return record
