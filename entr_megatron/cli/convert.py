"""`entr-megatron convert`: HF model directory <-> learner dist checkpoint.

    entr-megatron convert hf-to-megatron --hf HF_DIR --out CKPT_ROOT [--dtype fp32|bf16] [--tp N --pp N --ep N]
    entr-megatron convert megatron-to-hf --ckpt CKPT_ROOT_OR_RUN_DIR [--step N] --out HF_DIR [--max-shard-size 5GB]
    entr-megatron convert verify --hf HF_DIR --ckpt CKPT_ROOT_OR_RUN_DIR [--step N] [--tp N --pp N --ep N]

hf-to-megatron writes a checkpoint root (`latest`, `model_config.json`, `iter_0000000/` with its
manifest) holding the weights only (no optimizer state): `entr-megatron score --model CKPT_ROOT`
and `convert megatron-to-hf` read it at any TP/PP/EP (dist checkpoints reshard). A `train` run
starts from an HF directory (model.path) and resumes only from its own checkpoints, which hold
optimizer state: convert back (megatron-to-hf) to start a run from converted weights.

megatron-to-hf reads a checkpoint root or a run directory (its checkpoints/), the step `latest`
names or --step, and writes config.json, generation_config.json, safetensors shards (one at a
time, as each fills) with model.safetensors.index.json, and the tokenizer files the source has.

Both are strict: every HF tensor must map to a learner parameter and every parameter be filled
(--allow-unmapped PATTERN skips matching extra tensors, logged), shapes and the HF config are
checked field by field, a tied config's stored lm_head must equal the embedding. Verification (on
by default, --no-verify) forwards a few random token sequences through transformers (float32
weights, float64 log_softmax) and through the learner model loaded from the converted
checkpoint (or the source checkpoint, against the written HF directory), and fails when
max |delta log-prob| exceeds 1e-4 (fp32; bf16: 0.25), printing it and the mean KL.
`convert verify` runs that check alone on an existing pair (exit status 1 when it fails).

Outputs appear atomically: written into OUT.tmp-<pid>, renamed when complete and verified,
removed on any failure. An existing non-empty OUT is refused unless --overwrite.
OUT/conversion.json records the source files' SHA-256, versions, dtype, layout, tensor count and
bytes, and the verify results.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from entr_megatron import __version__, models
from entr_megatron.checkpoint import convert as conv
from entr_megatron.checkpoint import directory as ckpt_dir
from entr_megatron.checkpoint.hf_files import INDEX_FILE, check_hf_dir, merge_shards, parse_size, write_json
from entr_megatron.checkpoint.hf_files import staged_dir
from entr_megatron.checkpoint.manifest import choose_checkpoint, read_manifest

__all__ = ["add_parser"]

ASSETS_DIR = "hf_assets"  # in a converted checkpoint root: the source's tokenizer and generation config
_TORCH_DTYPE = {"fp32": "float32", "bf16": "bfloat16"}


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _check_layout(spec: models.ModelSpec, tp: int, pp: int, ep: int) -> None:
    if min(tp, pp, ep) < 1:
        raise ValueError(f"--tp, --pp and --ep must be >= 1, got {tp}, {pp}, {ep}")
    if ep > 1 and not spec.is_moe:
        raise ValueError(f"--ep {ep}: {spec.model_type} has no experts")
    conflicts = models.layout_conflicts(spec, tp=tp, pp=pp, ep=ep)
    if conflicts:
        c = conflicts[0]
        raise ValueError(f"--{c.size} {c.divisor} does not divide the model's {c.field}={c.value} "
                         f"({models.LAYOUT_REASONS[c.size]})")


def _verify(args, vocab_size: int) -> list[list[int]]:
    if not args.verify:
        return []
    length = 32 * max(args.tp, 1)  # sequence-parallel MoE layers need a multiple of TP
    return conv.verify_sequences(vocab_size, count=4, length=length)


def _finish_verify(reference, converted, sequences, dtype: str, outcome: str = "the output was removed") -> dict | None:
    if not sequences:
        return None
    result = conv.compare_logprobs(reference, converted, sequences, conv.VERIFY_TOLERANCE[dtype])
    _say(result.summary())
    if not result.passed:
        raise ValueError(result.summary() + ": the converted model does not compute the source's function "
                         f"(a transposed or swapped tensor?); {outcome}")
    return {"max_abs_delta_logprob": result.max_abs_delta_logprob, "mean_kl": result.mean_kl,
            "positions": result.tokens, "tolerance": result.tolerance, "sequences": len(sequences)}


def _run_job(**kwargs) -> dict:
    from entr_megatron.cli.convert_ranks import RankJob, run_ranks, world_size

    with tempfile.TemporaryDirectory(prefix="entr-convert-") as results:
        job = RankJob(results_dir=results, **kwargs)
        _say(f"  on {world_size(job.tp, job.pp, job.ep)} rank(s): tp={job.tp} pp={job.pp} ep={job.ep}")
        return run_ranks(job)


def hf_to_megatron(args) -> None:
    from entr_megatron.learner.hf_load import HfCheckpoint, check_hf_checkpoint, read_hf_config

    started = time.monotonic()
    hf = Path(args.hf)
    config = read_hf_config(hf)
    spec = models.get_family(config).spec(config)  # an unknown model_type lists the supported ones
    _check_layout(spec, args.tp, args.pp, args.ep)
    files = check_hf_dir(hf)  # every header: truncated / corrupt files, the index
    with HfCheckpoint(hf) as ckpt:
        skipped = check_hf_checkpoint(ckpt, spec, args.allow_unmapped)  # every tensor named and shaped
    conv.check_tied_embeddings(files, spec)
    for name in skipped:
        _say(f"  skipping {name} (--allow-unmapped)")
    _say(f"converting {hf} ({spec.model_type}, {len(files.tensors)} tensors, {files.nbytes / 1e9:.3f} GB in "
         f"{len(files.files)} file(s)) -> dist checkpoint {args.out} ({args.dtype})")
    sequences = _verify(args, spec.vocab_size)
    with staged_dir(args.out, overwrite=args.overwrite) as tmp:  # refuses a non-empty OUT first
        reference = conv.hf_logprobs(hf, sequences) if sequences else None
        record = _run_job(direction="hf-to-megatron", hf_config=config, ckpt_root=str(tmp), hf_dir=str(hf),
                          tp=args.tp, pp=args.pp, ep=args.ep, dtype=args.dtype,
                          allow_unmapped=tuple(args.allow_unmapped), verify_sequences=sequences)
        verified = _finish_verify(reference, record.get("verify"), sequences, args.dtype)
        (tmp / ASSETS_DIR).mkdir()
        assets = conv.copy_assets(hf, tmp / ASSETS_DIR)
        conv.write_provenance(tmp, {
            "direction": "hf-to-megatron", "entr_megatron_version": __version__, "model_type": spec.model_type,
            "dtype": args.dtype, "source": os.path.abspath(hf), "source_format": "hf-safetensors",
            "source_layout": {"files": len(files.files), "index": (hf / INDEX_FILE).is_file()},
            "target_layout": {"tp": args.tp, "pp": args.pp, "ep": args.ep, "step": 0},
            "tensors": len(files.tensors) - len(skipped), "bytes": files.nbytes, "skipped_unmapped": skipped,
            "source_sha256": conv.source_digests(hf, [*files.files, *([INDEX_FILE] if (hf / INDEX_FILE).is_file()
                                                                     else []), "config.json"]),
            "assets": assets, "verify": verified, "seconds": round(time.monotonic() - started, 3)})
    print(f"converted {spec.model_type} ({len(files.tensors)} tensors, {files.nbytes / 1e9:.3f} GB) to {args.out} "
          f"in {time.monotonic() - started:.1f} s")


def _resolve_checkpoint(path: Path) -> tuple[Path, Path | None]:
    """(checkpoint root, run directory or None) of --ckpt."""
    for root, run in ((path / "checkpoints", path), (path, None)):
        if (root / ckpt_dir.LATEST_FILE).is_file() or ckpt_dir.list_steps(root):
            return root, run
    if path.name.startswith("iter_") and ckpt_dir.list_steps(path.parent):
        raise ValueError(f"--ckpt {path} is one step of the checkpoint root {path.parent}: pass --ckpt "
                         f"{path.parent} --step N")
    raise ValueError(f"--ckpt {path}: not a learner checkpoint root (a 'latest' file and iter_NNNNNNN/ "
                     "directories) nor a run directory with checkpoints/")


def _checked_step(root: Path, step: int | None) -> tuple[int, Path]:
    """The step to convert (--step, else the one `latest` names), its files checked against its
    manifest here, before any rank starts; a damaged one is refused, not replaced by an older one."""
    if step is not None and step < 0:
        raise ValueError(f"--step must be >= 0, got {step}")
    step, _ = ckpt_dir.resolve_checkpoint_dir(root, step)
    choice = choose_checkpoint(root, step)  # raises CheckpointError naming the damaged files
    return choice.step, choice.path


def _asset_source(root: Path, run: Path | None, given: str | None) -> Path | None:
    candidates = [Path(given)] if given else [root / ASSETS_DIR]
    if run is not None and not given:
        candidates += [run / "sft" / "model", run / "model_init"]
    return next((c for c in candidates if c.is_dir()), None)


def megatron_to_hf(args) -> None:
    from entr_megatron.learner.hf_load import read_hf_config

    started = time.monotonic()
    root, run = _resolve_checkpoint(Path(args.ckpt))
    config = ckpt_dir.read_model_config(root)
    if config is None:
        raise ValueError(f"{root} has no {ckpt_dir.MODEL_CONFIG_FILE}: it does not say which model it holds")
    spec = models.get_family(config).spec(config)
    if args.hf_config:
        conv.compare_model_configs(config, read_hf_config(args.hf_config), f"checkpoint's {ckpt_dir.MODEL_CONFIG_FILE}",
                                   f"--hf-config {args.hf_config}")
    _check_layout(spec, args.tp, args.pp, args.ep)
    step, path = _checked_step(root, args.step)
    source_manifest = read_manifest(path)
    max_shard = parse_size(args.max_shard_size)
    _say(f"converting {path} ({spec.model_type}, step {step}) -> HF {args.out} ({args.dtype})")
    sequences = _verify(args, spec.vocab_size)
    with staged_dir(args.out, overwrite=args.overwrite) as tmp:
        record = _run_job(direction="megatron-to-hf", hf_config=config, ckpt_root=str(root), step=step,
                          out_dir=str(tmp), tp=args.tp, pp=args.pp, ep=args.ep, dtype=args.dtype,
                          max_shard_bytes=max_shard, verify_sequences=sequences)
        weight_map = merge_shards(tmp, [f"stage{i:03d}" for i in range(args.pp)])
        files = check_hf_dir(tmp)
        out_config = dict(config)
        out_config["torch_dtype" if "dtype" not in out_config else "dtype"] = _TORCH_DTYPE[args.dtype]
        write_json(tmp / "config.json", out_config)
        assets = conv.copy_assets(_asset_source(root, run, args.tokenizer), tmp)
        if "generation_config.json" not in assets:
            import transformers

            gen = transformers.GenerationConfig.from_model_config(transformers.AutoConfig.for_model(**config))
            gen.save_pretrained(tmp)
        verified = None
        if sequences:
            verified = _finish_verify(record["verify"], conv.hf_logprobs(tmp, sequences), sequences, args.dtype)
        conv.write_provenance(tmp, {
            "direction": "megatron-to-hf", "entr_megatron_version": __version__, "model_type": spec.model_type,
            "dtype": args.dtype, "source": os.path.abspath(path), "source_format": "megatron-dist-checkpoint",
            "source_layout": {"step": step, "saved_layout": _saved_layout(path)},
            "load_layout": {"tp": args.tp, "pp": args.pp, "ep": args.ep},
            "tensors": len(weight_map), "bytes": files.nbytes, "files": len(files.files),
            "source_sha256": {name: d["sha256"] for name, d in (source_manifest or {"files": {}})["files"].items()}
            or conv.source_digests(path, [p.name for p in path.iterdir() if p.is_file()]),
            "assets": assets, "verify": verified, "seconds": round(time.monotonic() - started, 3)})
    print(f"converted step {step} of {root} ({len(weight_map)} tensors, {files.nbytes / 1e9:.3f} GB in "
          f"{len(files.files)} file(s)) to {args.out} in {time.monotonic() - started:.1f} s")


def _saved_layout(path: Path) -> dict | None:
    """The layout (world size, TP/PP/...) the checkpoint was saved in, from its common record."""
    import torch

    from entr_megatron.checkpoint.state import INFO_KEY

    try:
        return torch.load(path / "common.pt", map_location="cpu", weights_only=False)[INFO_KEY]["layout"]
    except Exception:  # noqa: BLE001 - provenance only: the load itself checks the format
        return None


def verify_pair(args) -> None:
    """`convert verify`: an HF directory and a learner checkpoint compute the same log-probs."""
    from entr_megatron.learner.hf_load import read_hf_config

    root, _ = _resolve_checkpoint(Path(args.ckpt))
    config = ckpt_dir.read_model_config(root)
    if config is None:
        raise ValueError(f"{root} has no {ckpt_dir.MODEL_CONFIG_FILE}: it does not say which model it holds")
    conv.compare_model_configs(config, read_hf_config(args.hf), f"checkpoint's {ckpt_dir.MODEL_CONFIG_FILE}",
                               f"HF config of {args.hf}")
    spec = models.get_family(config).spec(config)
    _check_layout(spec, args.tp, args.pp, args.ep)
    step, _ = _checked_step(root, args.step)
    check_hf_dir(args.hf)
    sequences = _verify(argparse.Namespace(verify=True, tp=args.tp), spec.vocab_size)
    reference = conv.hf_logprobs(args.hf, sequences)
    record = _run_job(direction="verify", hf_config=config, ckpt_root=str(root), step=step, tp=args.tp,
                      pp=args.pp, ep=args.ep, verify_sequences=sequences)
    _finish_verify(reference, record["verify"], sequences, "fp32", outcome=f"{args.hf} and {root} differ")
    print(f"{args.hf} and step {step} of {root} agree")


def run(args) -> None:
    from entr_megatron.checkpoint.directory import CheckpointError

    try:
        args.convert(args)
    except (ValueError, RuntimeError, CheckpointError) as e:
        sys.exit(f"entr-megatron convert: error: {e}")


def add_parser(sub) -> None:
    p = sub.add_parser("convert", help="HF model directory <-> learner dist checkpoint (verified)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = p.add_subparsers(dest="direction", required=True, metavar="DIRECTION")
    to_m = actions.add_parser("hf-to-megatron", help="HF safetensors -> a dist checkpoint root",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    to_m.add_argument("--hf", required=True, metavar="DIR", help="HF model directory (config.json + safetensors)")
    to_m.add_argument("--out", required=True, metavar="CKPT", help="the checkpoint root to write")
    to_m.add_argument("--allow-unmapped", action="append", default=[], metavar="PATTERN",
                      help="skip HF tensors matching this fnmatch pattern that no learner parameter takes "
                           "(repeatable; logged)")
    to_m.set_defaults(func=run, convert=hf_to_megatron)
    to_hf = actions.add_parser("megatron-to-hf", help="a learner checkpoint -> an HF model directory",
                               description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    to_hf.add_argument("--ckpt", required=True, metavar="DIR", help="a checkpoint root or a run directory")
    to_hf.add_argument("--step", type=int, default=None, help="the step to convert (default: the one 'latest' names)")
    to_hf.add_argument("--out", required=True, metavar="DIR", help="the HF model directory to write")
    to_hf.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (default 5GB)")
    to_hf.add_argument("--hf-config", default=None, metavar="PATH",
                       help="an HF config (dir or config.json) the checkpoint must match field by field")
    to_hf.add_argument("--tokenizer", default=None, metavar="DIR",
                       help="copy tokenizer / generation config files from here (default: the checkpoint's "
                            f"{ASSETS_DIR}/, or the run's sft/model or model_init)")
    to_hf.set_defaults(func=run, convert=megatron_to_hf)
    ver = actions.add_parser("verify", help="check an HF directory and a learner checkpoint compute the same "
                             "log-probs", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ver.add_argument("--hf", required=True, metavar="DIR", help="HF model directory")
    ver.add_argument("--ckpt", required=True, metavar="DIR", help="a checkpoint root or a run directory")
    ver.add_argument("--step", type=int, default=None, help="the step (default: the one 'latest' names)")
    ver.set_defaults(func=run, convert=verify_pair)
    for a in (to_m, to_hf, ver):
        a.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks used (default 1)")
        a.add_argument("--pp", type=int, default=1, help="pipeline-parallel ranks (default 1)")
        a.add_argument("--ep", type=int, default=1, help="expert-parallel ranks (MoE; default 1)")
    for a in (to_m, to_hf):
        a.add_argument("--dtype", choices=sorted(_TORCH_DTYPE), default="fp32", help="weights written (default fp32)")
        a.add_argument("--verify", action=argparse.BooleanOptionalAction, default=True,
                       help="compare log-probs of random sequences under transformers and the learner (default on)")
        a.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT once the new one is complete")
