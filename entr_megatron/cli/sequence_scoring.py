"""What `entr-megatron score` runs (the command, its flags and its input and output: cli/score.py):
the input lines checked, tp*pp ranks spawned (or this process one of mpirun's) that load the model and
score the sequences, the output written with each line's mismatch and the summary printed.

    run(build_parser().parse_args(["score", "--model", M, "--input", I, "--output", O]))
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from entr_megatron import models
from entr_megatron.algorithm import ENTR_DEFAULT_EPS, entr_mask, mismatch_metrics
from entr_megatron.checkpoint import directory as checkpoint_dir
from entr_megatron.checkpoint.model_inputs import check_model_dir
from entr_megatron.learner.hf_load import HfCheckpoint, check_hf_checkpoint
from entr_megatron.learner.scoring import score_sequences
from entr_megatron.parallel.cpu_compat import enable_cpu_compat
from entr_megatron.parallel.groups import (LaunchInfo, destroy, init_distributed_from_env, initialize_model_parallel,
                                           launched_by_mpirun, resolve_launch_env)
from entr_megatron.utils.jsonl import atomic_output, check_token_ids, read_jsonl_objects
from entr_megatron.utils.outputs import check_output
from entr_megatron.utils.run_log import PROGRESS_EVERY_S
from entr_megatron.utils.spawn import enter_rank, free_port, torchrun_env


@dataclass(frozen=True)
class _Job:
    """What each spawned rank needs (pickled to the ranks)."""

    model_dir: str
    # A learner checkpoint: its HF config and the step to load (None: an HF model directory).
    model_config: dict | None
    step: int | None
    tp: int
    pp: int
    sequences_path: str
    results_path: str
    temperature: float
    batch_tokens: int


# --- input and output ---------------------------------------------------------------------------


@dataclass
class Line:
    """One validated input line."""

    lineno: int
    input_ids: list[int]
    rollout_logprobs: list[float] | None


def _parse_line(obj: dict, where: str, vocab_size: int, max_len: int | None = None) -> Line:
    if obj.get("input_ids") is None:
        raise ValueError(f'{where}: missing "input_ids"')
    ids = check_token_ids(obj["input_ids"], where, "input_ids", vocab_size)
    if max_len is not None and len(ids) > max_len:
        # Positions past max_position_embeddings were never trained: their scores would mean nothing.
        raise ValueError(f'{where}: "input_ids" has {len(ids)} tokens, more than the model\'s {max_len} positions '
                         "(max_position_embeddings); shorten or drop the line")
    rollout = obj.get("rollout_logprobs")
    if rollout is not None:
        if not isinstance(rollout, list) or not 1 <= len(rollout) <= len(ids) - 1:
            raise ValueError(f'{where}: "rollout_logprobs" must be a list of 1 to len(input_ids)-1={len(ids) - 1} '
                             "numbers (one per response token: the last tokens of input_ids)")
        for k, x in enumerate(rollout):
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x > 0:
                raise ValueError(f"{where}: rollout_logprobs[{k}]={x!r} is not a finite log-probability (<= 0)")
        rollout = [float(x) for x in rollout]
    return Line(0, ids, rollout)


def read_input(path: str, vocab_size: int, max_len: int | None = None) -> list[Line]:
    """Every non-blank line of a JSONL file, validated (token ids in the vocabulary, at most `max_len`
    of them when given); ValueError names the file and line."""
    lines = []
    for lineno, where, obj in read_jsonl_objects(path):
        line = _parse_line(obj, where, vocab_size, max_len)
        line.lineno = lineno
        lines.append(line)
    return lines


def _line_mismatch(lp, ent, rollout, tau):
    """Response-token tensors [1, R] (learner log-probs, behaviour log-probs, entropy) and the per-line dict."""
    r = len(rollout)
    lp_R, ent_R = lp[-r:].double(), ent[-r:].double()
    mu_R = torch.tensor(rollout, dtype=torch.float64)
    delta = lp_R - mu_R
    summary = {
        "k1": float((-delta).mean()),
        "k3": float((torch.expm1(delta) - delta).mean()),
        "mean_abs_delta": float(delta.abs().mean()),
        "entr_mask_fraction": float((~entr_mask(delta, ent_R, tau, ENTR_DEFAULT_EPS)).double().mean()),
    }
    return lp_R, mu_R, ent_R, summary


def _summary(lp, mu, ent, n_lines, tau) -> str:
    """The mismatch metrics of all lines with rollout_logprobs, as a table."""
    lp, mu, ent = torch.cat(lp)[None], torch.cat(mu)[None], torch.cat(ent)[None]
    keep = entr_mask(lp - mu, ent, tau, ENTR_DEFAULT_EPS)
    m = {k: float(v) for k, v in mismatch_metrics(lp, mu, ent, torch.ones_like(keep), keep_mask_BT=keep).items()}
    out = [
        f"mismatch vs rollout_logprobs: {n_lines} lines, {int(m['mismatch/tokens'])} response tokens "
        "(delta = learner log-prob - rollout log-prob)",
        f"  {'k1 = mean(-delta)':<32} {m['mismatch/k1']:+.6f}",
        f"  {'k3 = mean(e^delta - 1 - delta)':<32} {m['mismatch/k3']:+.6f}",
        f"  {'mean |delta|':<32} {m['mismatch/mean_abs_delta']:+.6f}",
        f"  {'ENTR mask fraction':<32} {m['mask/fraction']:.4f} (tau={tau:g}, eps={ENTR_DEFAULT_EPS:g})",
        f"  {'entropy bin':>12} {'tokens':>8} {'mean|delta|':>11} {'mean score':>10} {'masked':>7} {'rollout p<1e-3':>14}",
    ]
    for key in m:
        if key.startswith("entropy_bin/") and key.endswith("/count") and m[key] > 0:
            prefix = key[: -len("count")]
            out.append(f"  {prefix.split('/')[1]:>12} {int(m[key]):>8} {m[prefix + 'mean_abs_delta']:>11.5f} "
                       f"{m[prefix + 'mean_score']:>10.4f} {m[prefix + 'mask_fraction']:>7.2%} "
                       f"{m[prefix + 'low_prob_share']:>14.2%}")
    return "\n".join(out)


def write_output(in_path, out_path, lines, logprobs, entropy, tau) -> str | None:
    """Write every input line back with the scores, atomically; returns the mismatch summary (or None)."""
    by_lineno = {line.lineno: i for i, line in enumerate(lines)}
    mism_lp, mism_mu, mism_ent = [], [], []
    with atomic_output(out_path) as out:
        for lineno, _, obj in read_jsonl_objects(in_path):
            i = by_lineno[lineno]
            obj["logprobs"] = logprobs[i].tolist()
            obj["entropy"] = entropy[i].tolist()
            if lines[i].rollout_logprobs is not None:
                lp, mu, ent, obj["mismatch"] = _line_mismatch(logprobs[i], entropy[i], lines[i].rollout_logprobs, tau)
                mism_lp.append(lp), mism_mu.append(mu), mism_ent.append(ent)
            out.write(json.dumps(obj) + "\n")
    return _summary(mism_lp, mism_mu, mism_ent, len(mism_lp), tau) if mism_lp else None


# --- the ranks ----------------------------------------------------------------------------------


def _rank_main(rank: int, world: int, port: int, threads: int, job: _Job) -> None:
    """One spawned rank: join the loopback process group, score, rank 0 saves the results."""
    enter_rank(torchrun_env(rank, world, "127.0.0.1", port), threads)
    results = _score_in_world(job, torch.load(job.sequences_path))
    if results is not None:
        torch.save(results, job.results_path)


def _score_in_world(job: _Job, data: dict, info: LaunchInfo | None = None) -> dict | None:
    """This process as one rank (of our spawn, or of mpirun: `info`): join the process group, build
    and load the model, score `data` ({"input_ids", "lengths"}); rank 0 returns the flat
    {"logprobs", "entropy"} of all sequences, the other ranks None."""
    # lazy: megatron, in the ranks only (the parent validates and writes without it)
    from entr_megatron.learner.build import build_learner_model_from_hf

    rank = init_distributed_from_env(info=info).rank
    results = None
    try:
        enable_cpu_compat()  # a no-op with CUDA
        groups = initialize_model_parallel(job.tp, job.pp)
        if job.model_config is None:
            chunks, spec = build_learner_model_from_hf(job.model_dir, groups)
        else:
            from entr_megatron.checkpoint.io import load_checkpoint  # lazy: megatron, in the ranks only

            # No random init: every weight comes from the checkpoint (a strict load).
            chunks, spec = build_learner_model_from_hf(job.model_config, groups, load_weights=False,
                                                       config_overrides={"perform_initialization": False})
            # cleanup=False: a training run may be saving into this root right now.
            load_checkpoint(job.model_dir, chunks, step=job.step, cleanup=False)
        sequences = torch.split(data["input_ids"], data["lengths"].tolist())
        started, last = time.monotonic(), [0.0]
        tokens = sum(data["lengths"].tolist())

        def progress(done: int, total: int) -> None:
            now = time.monotonic()
            if rank == 0 and (now - last[0] >= PROGRESS_EVERY_S or done == total) and now - started > 1.0:
                last[0] = now
                print(f"  scored {done}/{total} sequences ({done / total:.0%}, "
                      f"~{tokens * done / total / (now - started):.0f} tokens/s)", file=sys.stderr, flush=True)

        scored = score_sequences(chunks, spec, groups, sequences, temperature=job.temperature,
                                 batch_tokens=job.batch_tokens, progress=progress)
        if rank == 0:
            results = {"logprobs": torch.cat([lp for lp, _ in scored]), "entropy": torch.cat([ent for _, ent in scored])}
        destroy()
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return results


def _launch(world: int, job: _Job) -> None:
    """Run `_rank_main` on `world` spawned local ranks; raise RuntimeError with a failed rank's traceback
    (or its exit code / signal when it died without one)."""
    threads = max(1, (os.cpu_count() or 1) // world)
    ctx = mp.start_processes(_rank_main, args=(world, free_port(), threads, job), nprocs=world, join=False,
                             start_method="spawn")
    try:
        while not ctx.join(timeout=1.0):
            pass
    # torch.multiprocessing exports these two (their base, ProcessException, only from .spawn).
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
        raise RuntimeError(f"rank {e.error_index} failed: {str(e).strip()}") from None
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()


# --- the command --------------------------------------------------------------------------------


def _check_layout(spec, tp: int, pp: int) -> None:
    """Refuse layouts Megatron cannot build for this model, naming the sizes (experts are not TP-split here)."""
    conflicts = models.layout_conflicts(spec, tp=tp, pp=pp)
    if conflicts:
        c = conflicts[0]
        raise ValueError(f"--{c.size} {c.divisor} does not divide the model's {c.field}={c.value} "
                         f"({models.LAYOUT_REASONS[c.size]})")


def run(args) -> None:
    """Validate, score on spawned ranks, write the output atomically, print the summary."""
    try:
        _run(args)
    except (ValueError, RuntimeError) as e:
        sys.exit(f"entr-megatron score: error: {e}")


def _is_learner_checkpoint(path: str) -> bool:
    """A learner checkpoint root: a `latest` file or iter_NNNNNNN/ directories (``checkpoint_dir``'s layout)."""
    return (os.path.isfile(os.path.join(path, checkpoint_dir.LATEST_FILE))
            or bool(checkpoint_dir.list_steps(path)))


def _resolve_model(path: str, step: int | None) -> tuple[dict | None, int | None, str]:
    """``(model_config, step, description)`` of --model: ``(None, None, ...)`` for an HF model directory,
    the checkpoint root's HF config and the (checked) step to load for a learner checkpoint."""
    if step is not None and step < 0:
        raise ValueError(f"--step must be >= 0, got {step}")
    if os.path.isfile(os.path.join(path, "config.json")):
        if step is not None:
            raise ValueError(f"--step {step}: --model {path!r} is an HF model directory (config.json); "
                             "--step selects the step of a learner checkpoint")
        return None, None, path
    if not _is_learner_checkpoint(path):
        hint = ""
        parent = os.path.dirname(os.path.abspath(path))
        if os.path.basename(os.path.abspath(path)).startswith("iter_") and _is_learner_checkpoint(parent):
            hint = f" (this looks like one step of the checkpoint root {parent}: pass --model {parent} --step N)"
        raise ValueError(f"--model {path!r} is neither an HF model directory (config.json + safetensors) nor a "
                         f"learner checkpoint root (a '{checkpoint_dir.LATEST_FILE}' file and iter_NNNNNNN/ "
                         f"directories){hint}")
    config = checkpoint_dir.read_model_config(path)
    if config is None:
        raise ValueError(
            f"learner checkpoint {path!r} has no {os.path.join(path, checkpoint_dir.MODEL_CONFIG_FILE)}: it was "
            "saved without model_config, so it does not say which model it holds. Save with "
            "save_checkpoint(..., model_config=read_hf_config(HF_DIR)), or copy the HF config.json of the "
            f"model it was trained from to {os.path.join(path, checkpoint_dir.MODEL_CONFIG_FILE)}")
    # Fails here, naming the steps there, rather than in every rank.
    step, _ = checkpoint_dir.resolve_checkpoint_dir(path, step)
    return config, step, f"learner checkpoint {path} (step {step})"


def _run(args) -> None:
    check_output("--output", args.output, [("--input", args.input), ("--model", args.model)])  # never onto them
    if args.tp < 1 or args.pp < 1:
        raise ValueError(f"--tp and --pp must be >= 1, got --tp {args.tp} --pp {args.pp}")
    world = args.tp * args.pp
    # Under mpirun this process is one of the ranks (an MPI broadcast of rank 0's address, so every
    # rank gets here); otherwise it spawns them.
    mpi = resolve_launch_env() if launched_by_mpirun() else None
    if mpi is not None and mpi.world_size != world:
        raise ValueError(f"mpirun started {mpi.world_size} rank(s) but --tp {args.tp} x --pp {args.pp} needs "
                         f"{world}: run mpirun -np {world}")
    lead = mpi is None or mpi.rank == 0
    if args.batch_tokens < 1:
        raise ValueError(f"--batch-tokens must be >= 1, got {args.batch_tokens}")
    if not args.temperature > 0:
        raise ValueError(f"--temperature must be > 0, got {args.temperature}")
    if not args.tau > 0:
        raise ValueError(f"--tau must be > 0, got {args.tau}")
    out_dir = os.path.dirname(os.path.abspath(args.output))
    if lead and (not os.path.isdir(out_dir) or not os.access(out_dir, os.W_OK)):
        raise ValueError(f"--output {args.output}: directory {out_dir} does not exist or is not writable")
    model_config, step, what = _resolve_model(args.model, args.step)
    # An HF directory: its config and every safetensors header checked before any rank starts.
    hf_config = model_config if model_config is not None else check_model_dir(args.model, "--model",
                                                                               tokenizer=False).config
    spec = models.model_spec(hf_config)
    _check_layout(spec, args.tp, args.pp)
    if model_config is None:
        with HfCheckpoint(args.model) as ckpt:
            check_hf_checkpoint(ckpt, spec)
    lines = read_input(args.input, spec.vocab_size, spec.max_position_embeddings)
    if not lines:
        raise ValueError(f"{args.input}: no input lines")
    n_tokens = sum(len(line.input_ids) for line in lines)
    if lead:
        print(f"scoring {len(lines)} sequences ({n_tokens} tokens) with {spec.model_type} from {what} "
              f"on {world} {'MPI ' if mpi else ''}rank(s): tp={args.tp} pp={args.pp}", file=sys.stderr, flush=True)
    started = time.monotonic()
    data = {"input_ids": torch.tensor([t for line in lines for t in line.input_ids], dtype=torch.long),
            "lengths": torch.tensor([len(line.input_ids) for line in lines], dtype=torch.long)}
    if mpi is not None:
        # The intra-op threads our own spawn gives each rank: the same numbers either way.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // mpi.local_world_size))
        # No file paths: this process is a rank, the sequences and results stay in memory.
        job = _Job(args.model, model_config, step, args.tp, args.pp, "", "", args.temperature, args.batch_tokens)
        results = _score_in_world(job, data, mpi)
        if not lead:
            return
    else:
        with tempfile.TemporaryDirectory(prefix="entr-score-") as tmp:
            job = _Job(args.model, model_config, step, args.tp, args.pp, os.path.join(tmp, "sequences.pt"),
                       os.path.join(tmp, "results.pt"), args.temperature, args.batch_tokens)
            torch.save(data, job.sequences_path)
            _launch(world, job)
            results = torch.load(job.results_path)
    sizes = [len(line.input_ids) - 1 for line in lines]
    logprobs = torch.split(results["logprobs"], sizes)
    entropy = torch.split(results["entropy"], sizes)
    summary = write_output(args.input, args.output, lines, logprobs, entropy, tau=args.tau)
    print(f"scored {len(lines)} sequences in {time.monotonic() - started:.1f} s -> {args.output}")
    if summary is not None:
        print(summary)

