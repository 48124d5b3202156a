"""L2: process groups passed explicitly, vocab-parallel log-prob/entropy (fused with the output layer or not), launch bootstrap."""

from entr_megatron.parallel.fused_output import vocab_parallel_linear_logprobs_entropy
from entr_megatron.parallel.vocab_parallel import vocab_parallel_logprobs_entropy

__all__ = ["vocab_parallel_linear_logprobs_entropy", "vocab_parallel_logprobs_entropy"]
