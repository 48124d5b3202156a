"""What `entr-megatron convert` runs (the command, its flags and guarantees: cli/convert.py): the
sources checked, the conversion streamed into OUT.tmp-<pid> (`checkpoint.dist_convert`,
`checkpoint.hf_dir`), verified on learner ranks (cli/convert_ranks.py), conversion.json written, OUT
put in place; a signal removes the staged output.

    run(build_parser().parse_args(["convert", "hf-to-megatron", "--hf", HF_DIR, "--out", CKPT_ROOT]))
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import os
import re
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from entr_megatron import __version__, models
from entr_megatron.checkpoint import convert as conv
from entr_megatron.checkpoint import directory as ckpt_dir
from entr_megatron.checkpoint.hf_files import INDEX_FILE, parse_size
from entr_megatron.checkpoint.hf_files import staged_dir
from entr_megatron.checkpoint.manifest import read_manifest
from entr_megatron.checkpoint.model_inputs import TOKENIZER_FILES, check_model_dir, tokenizer_problem
from entr_megatron.cli.convert_ranks import RankJob, run_ranks, world_size
from entr_megatron.learner import hf_load
from entr_megatron.utils.outputs import check_output

__all__ = ["run"]

# What each direction writes at OUT's top level: an old OUT that holds only these is replaced, else kept aside.
_WRITES = {
    "hf-to-megatron": re.compile(rf"^({ckpt_dir.LATEST_FILE}|{re.escape(ckpt_dir.MODEL_CONFIG_FILE)}|iter_\d{{7,}}|"
                                 rf"hf_assets|{re.escape(conv.PROVENANCE_FILE)})$"),
    "megatron-to-hf": re.compile(r"^(config\.json|model\.safetensors|model-\d{5}-of-\d{5}\.safetensors|"
                                 rf"{re.escape(INDEX_FILE)}|{re.escape(conv.PROVENANCE_FILE)}|"
                                 rf"{'|'.join(re.escape(f) for f in conv.ASSET_FILES)})$"),
}
_SIGNAL_EXIT = {signal.SIGINT: 130, signal.SIGTERM: 143}  # 128 + the signal's number, as shells report it


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


@contextlib.contextmanager
def _progress() -> Iterator:
    """The conversion's progress on stderr; on an error or interrupt its line is ended (no summary)
    so the message that follows starts a line of its own."""
    from entr_megatron.checkpoint.dist_convert import Progress  # lazy: megatron (below)

    progress = Progress("converting")
    try:
        yield progress
    except BaseException:
        if progress.bar is not None:
            progress.bar.close()
        raise
    progress.close()


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


def _run_verify(**kwargs) -> list:
    """The learner's log-probs of the verify sequences, the checkpoint loaded on spawned ranks."""
    with tempfile.TemporaryDirectory(prefix="entr-convert-") as results:
        job = RankJob(results_dir=results, **kwargs)
        _say(f"  verifying on {world_size(job.tp, job.pp, job.ep)} rank(s): tp={job.tp} pp={job.pp} ep={job.ep}")
        return run_ranks(job)["verify"]


def hf_to_megatron(args) -> None:
    # lazy: megatron (checkpoint.state's records): a refused source or OUT is said before its seconds of import
    from entr_megatron.checkpoint.dist_convert import hf_to_dist
    from entr_megatron.checkpoint.hf_dir import ASSETS_DIR, DTYPES

    started = time.monotonic()
    hf = Path(args.hf)
    # config.json and every header (truncated / corrupt files, the index), before anything is written
    source = check_model_dir(hf, "--hf", tokenizer=False)
    config, files = source.config, source.files
    spec = models.get_family(config).spec(config)  # an unknown model_type lists the supported ones
    _check_layout(spec, args.tp, args.pp, args.ep)
    if source.tokenizer_missing:
        _say(f"warning: --hf {source.tokenizer_missing}: the checkpoint's {ASSETS_DIR}/ gets no tokenizer; "
             f"`train` with model.path {args.out} will need model.tokenizer "
             f"(a directory with {' or '.join(TOKENIZER_FILES[:2])}), and `convert megatron-to-hf` from it --tokenizer")
    with hf_load.HfCheckpoint(hf) as ckpt:
        skipped = hf_load.check_hf_checkpoint(ckpt, spec, args.allow_unmapped)  # every tensor named and shaped
    conv.check_tied_embeddings(files, spec)
    for name in skipped:
        _say(f"  skipping {name} (--allow-unmapped)")
    _say(f"converting {hf} ({spec.model_type}, {len(files.tensors)} tensors, {files.nbytes / 1e9:.3f} GB in "
         f"{len(files.files)} file(s)) -> dist checkpoint {args.out} ({args.dtype})")
    sequences = _verify(args, spec.vocab_size)
    hashed = [*files.files, *([INDEX_FILE] if (hf / INDEX_FILE).is_file() else []), "config.json"]
    # The sources' SHA-256 (conversion.json) on a thread while the conversion runs.
    with concurrent.futures.ThreadPoolExecutor(1) as pool, _staged(args) as tmp:
        digests = pool.submit(conv.source_digests, hf, hashed)
        with _progress() as progress:
            hf_to_dist(files, spec, tmp, hf_config=config, dtype=DTYPES[args.dtype], progress=progress)
        converted_s = time.monotonic() - started
        verified = None
        if sequences:
            learner = _run_verify(hf_config=config, ckpt_root=str(tmp), step=0, tp=args.tp, pp=args.pp, ep=args.ep,
                                  dtype=args.dtype, verify_sequences=sequences)
            verified = _finish_verify(conv.hf_logprobs(hf, sequences), learner, sequences, args.dtype)
        (tmp / ASSETS_DIR).mkdir()
        assets = conv.copy_assets(hf, tmp / ASSETS_DIR)
        if not assets:  # an empty hf_assets/ would hide the run's own tokenizer from megatron-to-hf
            (tmp / ASSETS_DIR).rmdir()
        conv.write_provenance(tmp, {
            "direction": "hf-to-megatron", "entr_megatron_version": __version__, "model_type": spec.model_type,
            "dtype": args.dtype, "source": os.path.abspath(hf), "source_format": "hf-safetensors",
            "source_layout": {"files": len(files.files), "index": (hf / INDEX_FILE).is_file()},
            "target_layout": {"saved_as": "tp=pp=ep=1, one process", "step": 0},
            "verify_layout": {"tp": args.tp, "pp": args.pp, "ep": args.ep} if sequences else None,
            "tensors": len(files.tensors) - len(skipped), "bytes": files.nbytes, "skipped_unmapped": skipped,
            "source_sha256": digests.result(), "assets": assets, "verify": verified,
            "convert_seconds": round(converted_s, 3), "seconds": round(time.monotonic() - started, 3)})
    print(f"converted {spec.model_type} ({len(files.tensors)} tensors, {files.nbytes / 1e9:.3f} GB) to {args.out} "
          f"in {time.monotonic() - started:.1f} s")


def megatron_to_hf(args) -> None:
    from entr_megatron.checkpoint import hf_dir  # lazy: megatron (see hf_to_megatron)

    started = time.monotonic()
    root, run = hf_dir.resolve_source(args.ckpt)
    config, spec = hf_dir.source_model(root)
    if args.hf_config:
        conv.compare_model_configs(config, hf_load.read_hf_config(args.hf_config), f"checkpoint's {ckpt_dir.MODEL_CONFIG_FILE}",
                                   f"--hf-config {args.hf_config}")
    _check_layout(spec, args.tp, args.pp, args.ep)
    step, path = hf_dir.checked_step(root, args.step)
    source_manifest = read_manifest(path)
    max_shard = parse_size(args.max_shard_size)
    dtype = hf_dir.output_dtype(args.dtype, path, spec)
    assets = hf_dir.asset_source(root, run, args.tokenizer)
    if args.tokenizer and assets is None:
        raise ValueError(f"--tokenizer {args.tokenizer}: not a directory")
    missing = tokenizer_problem(assets) if assets is not None else (
        f"no tokenizer in {root / hf_dir.ASSETS_DIR}" + (f", {run / 'sft' / 'model'} or {run / 'model_init'}" if run
                                                         else ""))
    if missing:
        _say(f"warning: {missing}: {args.out} gets no tokenizer; `train` from it will need model.tokenizer, "
             "`generate` --input with \"prompt\" text a tokenizer (or pass --tokenizer DIR here)")
    _say(f"converting {path} ({spec.model_type}, step {step}) -> HF {args.out} ({dtype})")
    sequences = _verify(args, spec.vocab_size)
    with _staged(args) as tmp:
        with _progress() as progress:
            written = hf_dir.write_hf_dir(tmp, path, spec, config, dtype=dtype, max_shard_bytes=max_shard,
                                          assets=assets, progress=progress)
        converted_s = time.monotonic() - started
        verified = None
        if sequences:
            learner = _run_verify(hf_config=config, ckpt_root=str(root), step=step, tp=args.tp, pp=args.pp,
                                  ep=args.ep, dtype=dtype, verify_sequences=sequences)
            verified = _finish_verify(learner, conv.hf_logprobs(tmp, sequences), sequences, dtype)
        conv.write_provenance(tmp, {
            "direction": "megatron-to-hf", "entr_megatron_version": __version__, "model_type": spec.model_type,
            "dtype": dtype, "source": os.path.abspath(path), "source_format": "megatron-dist-checkpoint",
            "source_layout": {"step": step, "saved_layout": _saved_layout(path)},
            "verify_layout": {"tp": args.tp, "pp": args.pp, "ep": args.ep} if sequences else None,
            "tensors": len(written.weight_map), "bytes": written.files.nbytes, "files": len(written.files.files),
            "source_sha256": {name: d["sha256"] for name, d in (source_manifest or {"files": {}})["files"].items()}
            or conv.source_digests(path, [p.name for p in path.iterdir() if p.is_file()]),
            "assets": written.assets, "verify": verified, "convert_seconds": round(converted_s, 3),
            "seconds": round(time.monotonic() - started, 3)})
    print(f"converted step {step} of {root} ({len(written.weight_map)} tensors, {written.files.nbytes / 1e9:.3f} GB "
          f"in {len(written.files.files)} file(s)) to {args.out} in {time.monotonic() - started:.1f} s")


def _saved_layout(path: Path) -> dict | None:
    """The layout (world size, TP/PP/...) the checkpoint was saved in, from its common record."""
    from entr_megatron.checkpoint.state import INFO_KEY  # lazy: megatron (see hf_to_megatron)

    try:
        return torch.load(path / "common.pt", map_location="cpu", weights_only=False)[INFO_KEY]["layout"]
    except Exception:  # noqa: BLE001 - provenance only: the load itself checks the format
        return None


def verify_pair(args) -> None:
    """`convert verify`: an HF directory and a learner checkpoint compute the same log-probs."""
    from entr_megatron.checkpoint import hf_dir  # lazy: megatron (see hf_to_megatron)

    root, _ = hf_dir.resolve_source(args.ckpt)
    config, spec = hf_dir.source_model(root)
    conv.compare_model_configs(config, hf_load.read_hf_config(args.hf), f"checkpoint's {ckpt_dir.MODEL_CONFIG_FILE}",
                               f"HF config of {args.hf}")
    _check_layout(spec, args.tp, args.pp, args.ep)
    step, _ = hf_dir.checked_step(root, args.step)
    check_model_dir(args.hf, "--hf", tokenizer=False)
    sequences = _verify(argparse.Namespace(verify=True, tp=args.tp), spec.vocab_size)
    reference = conv.hf_logprobs(args.hf, sequences)
    learner = _run_verify(hf_config=config, ckpt_root=str(root), step=step, tp=args.tp, pp=args.pp, ep=args.ep,
                          verify_sequences=sequences)
    _finish_verify(reference, learner, sequences, "fp32", outcome=f"{args.hf} and {root} differ")
    print(f"{args.hf} and step {step} of {root} agree")


def _staged(args):
    """OUT staged in OUT.tmp-<pid>; --overwrite keeps an old OUT aside when it holds what this direction does not write."""
    return staged_dir(args.out, overwrite=args.overwrite, replaceable=_WRITES[args.direction].match, say=_say)


def _sources(args) -> list[tuple[str, str]]:
    """(flag, path) of what the conversion reads."""
    flags = {"hf-to-megatron": ("hf",), "megatron-to-hf": ("ckpt", "tokenizer", "hf_config")}[args.direction]
    return [(f"--{f.replace('_', '-')}", getattr(args, f)) for f in flags if getattr(args, f, None)]


def check_out(args) -> None:
    """OUT is not a source, inside one, or around one (real paths: symlinks followed); ValueError names both."""
    check_output("--out", args.out, _sources(args))


class _Interrupts:
    """SIGINT / SIGTERM during a conversion: remembered, and raised as KeyboardInterrupt so the staged
    output is removed on the way out; later signals are ignored while it cleans up."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def _handle(self, signum, frame) -> None:
        if self.signum is None:
            self.signum = signum
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self._handle) for sig in _SIGNAL_EXIT}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def run(args) -> None:
    try:
        if getattr(args, "out", None):
            check_out(args)
    except ValueError as e:
        print(f"entr-megatron convert: error: {e}", file=sys.stderr)
        sys.exit(2)
    convert = {"hf-to-megatron": hf_to_megatron, "megatron-to-hf": megatron_to_hf, "verify": verify_pair}[args.direction]
    interrupts = _Interrupts()
    try:
        with interrupts.installed():
            convert(args)
    except BaseException as e:  # noqa: BLE001 - an interrupt may surface as any error of the code it cut
        if interrupts.signum is None and isinstance(e, KeyboardInterrupt):
            interrupts.signum = signal.SIGINT
        if interrupts.signum is not None:
            name = signal.Signals(interrupts.signum).name
            print(f"entr-megatron convert: interrupted ({name}); no partial output is left", file=sys.stderr,
                  flush=True)
            sys.exit(_SIGNAL_EXIT[interrupts.signum])
        if isinstance(e, (ValueError, RuntimeError, ckpt_dir.CheckpointError)):
            sys.exit(f"entr-megatron convert: error: {e}")
        raise

