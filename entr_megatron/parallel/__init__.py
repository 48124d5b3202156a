"""L2: process groups passed explicitly, vocab-parallel log-prob/entropy, launch bootstrap."""

from entr_megatron.parallel.vocab_parallel import vocab_parallel_logprobs_entropy

__all__ = ["vocab_parallel_logprobs_entropy"]
