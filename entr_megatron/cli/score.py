"""`entr-megatron score`: the learner's per-token log-probs and entropy for token sequences.

Useful on its own to diagnose train-inference mismatch: score what an inference
engine sampled and compare with the log-probs the engine reported.

    entr-megatron score --model HF_DIR --tp 2 --input rollouts.jsonl --output scored.jsonl
    entr-megatron score --model CKPT_ROOT [--step N] --tp 2 --input rollouts.jsonl --output scored.jsonl

--model is an HF model directory (config.json + safetensors), or a learner
checkpoint root (the directory passed to save_checkpoint: a `latest` file and
iter_NNNNNNN/ directories). A checkpoint root must hold model_config.json (the HF
config, written by save_checkpoint(..., model_config=...)); the model is built
from it and the weights of step --step (default: the step `latest` names) are
loaded. Dist checkpointing reshards: --tp/--pp need not be the saving run's.

Input: JSONL, one object per line with "input_ids": [token ids], at most the model's
max_position_embeddings of them (a longer line is refused, naming it). Output: every
line with all its fields, in the same order, plus
  "logprobs": [L-1 floats]  log p(input_ids[i+1] | input_ids[0..i])
  "entropy":  [L-1 floats]  entropy (nats) of that next-token distribution
both at --temperature. Blank lines are skipped.

Lines with "rollout_logprobs" (R floats, the behaviour log-probs an engine
reported) are read as: the LAST R tokens of input_ids are the response and
rollout_logprobs[k] is the log-prob of input_ids[L-R+k], i.e. it aligns with
logprobs[L-1-R+k] (so 1 <= R <= L-1). Such lines also get
  "mismatch": {"k1", "k3", "mean_abs_delta", "entr_mask_fraction"}
with delta = logprobs - rollout_logprobs over the response, and a summary of the
mismatch metrics of ENTR.md over all of them (k1, k3, mean |delta|, per-entropy-bin
statistics, the fraction ENTR would mask at --tau) is printed at the end.

The command starts tp*pp local ranks itself (gloo on CPU, NCCL when CUDA is
present), loads the model sharded over them, and runs Megatron's forward-only
pipeline schedule. The output file appears atomically when everything is done.

Under mpirun the MPI ranks are the ranks instead (mpi4py: the `cluster` extra):

    mpirun -np 2 entr-megatron score --model HF_DIR --tp 2 --input rollouts.jsonl --output scored.jsonl

-np must be tp*pp. Every rank reads --model and --input (a shared file system across
nodes); MPI rank 0 writes --output and prints. Rank 0's MASTER_ADDR / MASTER_PORT
(default: its host name's address and a free port) are broadcast over MPI for the
torch.distributed rendezvous.
"""

from __future__ import annotations

import argparse

from entr_megatron.config.algorithm import AlgorithmConfig
from entr_megatron.learner.sequence_packing import DEFAULT_BATCH_TOKENS

__all__ = ["add_parser"]


def run(args) -> None:
    """Validate, score on the ranks, write the output, print the summary (cli/sequence_scoring.py)."""
    from entr_megatron.cli.sequence_scoring import run as score  # lazy: torch, only when the command runs

    score(args)


def add_parser(sub) -> None:
    p = sub.add_parser("score", help="per-token log-probs and entropy of token sequences under an HF model "
                       "or a learner checkpoint (TP/PP ranks)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, metavar="DIR",
                   help="HF model directory (config.json + safetensors), or a learner checkpoint root "
                        "(with model_config.json, as save_checkpoint(model_config=...) writes)")
    p.add_argument("--step", type=int, default=None, metavar="N",
                   help="learner checkpoint only: the step to load (default: the one its 'latest' file names)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (default 1)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel ranks (default 1)")
    p.add_argument("--input", required=True, metavar="FILE.jsonl", help='lines {"input_ids": [...], ...}')
    p.add_argument("--output", required=True, metavar="FILE.jsonl", help="written atomically when done")
    p.add_argument("--temperature", type=float, default=1.0, help="score softmax(logits / T) (default 1)")
    p.add_argument("--batch-tokens", type=int, default=DEFAULT_BATCH_TOKENS,
                   help=f"tokens per packed micro-batch; a longer sequence gets its own (default {DEFAULT_BATCH_TOKENS})")
    p.add_argument("--tau", type=float, default=AlgorithmConfig.tau,
                   help=f"ENTR threshold for the mask fraction in the summary (default {AlgorithmConfig.tau})")
    p.set_defaults(func=run)

