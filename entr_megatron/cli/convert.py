"""`entr-megatron convert`: HF model directory <-> learner dist checkpoint.

    entr-megatron convert hf-to-megatron --hf HF_DIR --out CKPT_ROOT [--dtype fp32|bf16] [--tp N --pp N --ep N]
    entr-megatron convert megatron-to-hf --ckpt CKPT_ROOT_OR_RUN_DIR [--step N] --out HF_DIR [--dtype auto|fp32|bf16]
                                         [--max-shard-size 5GB]
    entr-megatron convert verify --hf HF_DIR --ckpt CKPT_ROOT_OR_RUN_DIR [--step N] [--tp N --pp N --ep N]

Both conversions stream in this one process without building the model: one tensor is read,
converted and written before the next (`checkpoint.dist_convert`), so host memory is about the
largest tensor, not the model. hf-to-megatron writes a checkpoint root (`latest`,
`model_config.json`, `iter_0000000/` with its manifest) holding the weights only (no optimizer
state), as Megatron's own save would at TP=PP=EP=1: `entr-megatron score --model CKPT_ROOT`,
`convert megatron-to-hf` and `train` (model.path: CKPT_ROOT) read it at any TP/PP/EP (dist
checkpoints reshard).

megatron-to-hf reads a checkpoint root or a run directory (its checkpoints/), the step `latest`
names or --step, saved at any layout (optimizer and RNG state skipped), and writes config.json,
generation_config.json, safetensors shards (each header first, each tensor's bytes as it is
converted) with model.safetensors.index.json, and the tokenizer files the source has.
--dtype auto keeps the dtype the checkpoint stores.

Both are strict: every HF tensor must map to a learner parameter and every parameter be filled
(--allow-unmapped PATTERN skips matching extra tensors, logged), every tensor of the dist
checkpoint must be a parameter of its model config, shapes and the HF config are checked field by
field, a tied config's stored lm_head must equal the embedding. Verification (on by default,
--no-verify) forwards a few random token sequences through transformers (float32 weights, float64
log_softmax) and through the learner model loaded from the converted checkpoint at --tp/--pp/--ep
(or the source checkpoint, against the written HF directory), and fails when max |delta log-prob|
exceeds 1e-4 (fp32; bf16: 0.25), printing it and the mean KL. It builds the model (and loads
transformers'), so it takes memory the conversion itself does not. `convert verify` runs that
check alone on an existing pair (exit status 1 when it fails).

Outputs appear atomically: written into OUT.tmp-<pid>, renamed when complete and verified,
removed on any failure. Ctrl-C or SIGTERM stops the conversion, removes OUT.tmp-<pid> and exits
130 (SIGINT) or 143 (SIGTERM) with one line saying it was interrupted; the OUT.tmp-<pid> of a
killed run (SIGKILL) is removed by the next conversion to the same OUT, which says so. OUT may not
be, lie inside or contain a source (--hf, --ckpt, --tokenizer; real paths compared): exit status 2.
An existing non-empty OUT is refused unless --overwrite. --overwrite deletes nothing this command
does not write: the old OUT is removed once the new one is in place only when it holds nothing but
what a conversion of this direction writes (for hf-to-megatron latest, model_config.json,
iter_NNNNNNN/, hf_assets/, conversion.json; for megatron-to-hf config.json, the safetensors files
and their index, tokenizer and generation config files, conversion.json); otherwise it is kept
whole as OUT.previous-<time>, and the command says so.
OUT/conversion.json records the source files' SHA-256, versions, dtype, layout, tensor count and
bytes, and the verify results.

A source without tokenizer files converts with a warning: `train` from the output (model.path) then
needs model.tokenizer, and a megatron-to-hf directory needs --tokenizer for prompts given as text.
"""

from __future__ import annotations

import argparse

__all__ = ["add_parser"]

_TORCH_DTYPE = {"fp32": "float32", "bf16": "bfloat16"}


def run(args) -> None:
    """The conversion (or `verify`) that args.direction names, staged and interruptible (cli/conversion.py)."""
    from entr_megatron.cli.conversion import run as convert  # lazy: torch and transformers, only when it runs

    convert(args)


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
    to_m.set_defaults(func=run)
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
                            "hf_assets/, or the run's sft/model or model_init)")
    to_hf.set_defaults(func=run)
    ver = actions.add_parser("verify", help="check an HF directory and a learner checkpoint compute the same "
                             "log-probs", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ver.add_argument("--hf", required=True, metavar="DIR", help="HF model directory")
    ver.add_argument("--ckpt", required=True, metavar="DIR", help="a checkpoint root or a run directory")
    ver.add_argument("--step", type=int, default=None, help="the step (default: the one 'latest' names)")
    ver.set_defaults(func=run)
    for a in (to_m, to_hf, ver):
        a.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks the verify load uses (default 1)")
        a.add_argument("--pp", type=int, default=1, help="pipeline-parallel ranks of the verify load (default 1)")
        a.add_argument("--ep", type=int, default=1, help="expert-parallel ranks of the verify load (MoE; default 1)")
    to_m.add_argument("--dtype", choices=sorted(_TORCH_DTYPE), default="fp32", help="weights written (default fp32)")
    to_hf.add_argument("--dtype", choices=["auto", *sorted(_TORCH_DTYPE)], default="fp32",
                       help="weights written (default fp32; auto: the dtype the checkpoint stores)")
    for a in (to_m, to_hf):
        a.add_argument("--verify", action=argparse.BooleanOptionalAction, default=True,
                       help="compare log-probs of random sequences under transformers and the learner (default on)")
        a.add_argument("--overwrite", action="store_true",
                       help="replace a non-empty OUT once the new one is complete; an old OUT holding files this "
                            "command does not write is kept whole as OUT.previous-<time> (nothing is deleted "
                            "that a conversion did not write)")
