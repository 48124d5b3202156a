"""The ranks of `entr-megatron convert`'s verification: load a dist checkpoint into the learner
model at a given layout and compute log-probs of a few sequences.

    record = run_ranks(RankJob(hf_config, ckpt_root, step=0, tp=2, ep=2, verify_sequences=seqs, ...))

The conversions themselves run in the command's process without a model
(`checkpoint.dist_convert`); only `--verify` builds one: the ranks build their chunks without
initialising them, check the Megatron config against the HF one, load the checkpoint (any layout:
dist checkpoints reshard) and write the last stage's log-probs for the command to compare with
transformers'.

This module joins `learner` and `checkpoint`, which do not import each other (the layers of
ARCHITECTURE.md), so it lives with the command.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from entr_megatron import models
from entr_megatron.parallel.cpu_compat import enable_cpu_compat
from entr_megatron.parallel.groups import destroy, initialize_model_parallel
from entr_megatron.utils.spawn import run_gloo

__all__ = ["DTYPES", "RankJob", "full_logprobs", "run_ranks", "world_size"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# An exception's last line in a rank's traceback: "ValueError: ..." / "entr_megatron...CheckpointError: ...".
_ERROR_LINE = re.compile(r"^(?:[\w.]+\.)?\w*(?:Error|Exception): ", re.M)


@dataclass(frozen=True)
class RankJob:
    """What each spawned rank needs (pickled to the ranks)."""

    hf_config: dict
    ckpt_root: str
    step: int | None = None  # None: latest
    tp: int = 1
    pp: int = 1
    ep: int = 1
    dtype: str = "fp32"  # the model's parameters (a bf16 conversion is verified in bf16)
    verify_sequences: list[list[int]] = field(default_factory=list)
    results_dir: str = ""


def _build(job: RankJob, groups):
    """This rank's chunks, uninitialised (every weight is about to be overwritten), and the spec."""
    from entr_megatron.learner.build import build_learner_model_from_hf  # lazy: megatron, in the ranks only

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
    from entr_megatron.learner.schedule import run_pipeline  # lazy: megatron, in the ranks only

    length = len(sequences[0])
    assert all(len(s) == length for s in sequences) and length % groups.tp_size == 0, length
    data = [(torch.tensor([list(s)]), torch.arange(length)[None]) for s in sequences]

    def forward_step(item, model):
        ids, positions = item
        output = model(ids, positions, None)

        def loss_func(logits_BLv):
            parts = [torch.empty_like(logits_BLv) for _ in range(groups.tp_size)]
            dist.all_gather(parts, logits_BLv.contiguous(), group=groups.tp)
            logits_LV = torch.cat(parts, -1)[0, :, : spec.vocab_size].double()
            return logits_BLv.new_zeros(()), {"lp": torch.log_softmax(logits_LV, -1)}

        return output, loss_func

    for chunk in chunks:
        chunk.eval()
    stored = run_pipeline(chunks, data, forward_step, groups, forward_only=True, seq_length=length)
    return [out["lp"] for out in stored] if groups.is_last_stage() else None


def _verify(job: RankJob, groups) -> dict:
    """Load the checkpoint and write the last stage's log-probs (its TP/DP rank 0) for the parent."""
    from entr_megatron.checkpoint.io import load_checkpoint  # lazy: megatron, in the ranks only

    chunks, spec = _build(job, groups)
    check_megatron_config(chunks, spec)
    # verify=False: the command checked the files against the manifest before starting the ranks.
    step, _ = load_checkpoint(job.ckpt_root, chunks, step=job.step, cleanup=False, verify=False)
    lp = full_logprobs(chunks, spec, groups, job.verify_sequences)
    if lp is not None and groups.tp_rank == 0 and groups.dp_rank == 0 and groups.cp_rank == 0:
        torch.save(lp, Path(job.results_dir) / "verify.pt")
    return {"step": step}


def _rank(rank: int, world: int, job: RankJob) -> None:
    enable_cpu_compat()
    groups = initialize_model_parallel(job.tp, job.pp, ep=job.ep)
    record = _verify(job, groups)
    if rank == 0:
        torch.save(record, Path(job.results_dir) / "record.pt")
    destroy()


def world_size(tp: int, pp: int, ep: int) -> int:
    """Ranks for TP x PP x EP: expert parallelism is carved out of data parallelism (tp * dp must be a
    multiple of ep), so the data-parallel size is the smallest that allows it."""
    return tp * pp * (ep // math.gcd(ep, tp))


def run_ranks(job: RankJob, timeout_s: float = 24 * 3600.0) -> dict:
    """Run the job on `world_size` spawned gloo ranks; rank 0's record with "verify" (the log-probs).
    A failed rank raises RuntimeError with its error's message (or its traceback)."""
    try:
        run_gloo(_rank, world_size(job.tp, job.pp, job.ep), job, timeout_s=timeout_s)
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
        text = str(e).strip()
        found = list(_ERROR_LINE.finditer(text))
        message = text[found[-1].end():] if found else text
        raise RuntimeError(message.strip()) from None
    record = torch.load(Path(job.results_dir) / "record.pt")
    record["verify"] = torch.load(Path(job.results_dir) / "verify.pt")
    return record
