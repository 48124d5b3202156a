"""One way to derive per-item seeds from a run's seed.

    mix_seed(seed, group_id)              # group g of a run seeded `seed`
    mix_seed(seed, i, modulus=2**31)      # where the consumer takes at most 31 bits
"""

from __future__ import annotations

SEED_STRIDE = 1_000_003
"""A prime larger than any item index used: base * SEED_STRIDE + index differs for every
(base, index) with 0 <= index < SEED_STRIDE, so no two items of two runs share a seed."""


def mix_seed(base: int, index: int, modulus: int | None = None) -> int:
    """The seed of item `index` under the run seed `base`: base * SEED_STRIDE + index,
    reduced modulo `modulus` when the consumer needs a bounded seed (e.g. 2**31 for
    torch/numpy generators fed from Python ints, 2**63 for SGLang's int64 sampling seed)."""
    value = base * SEED_STRIDE + index
    return value if modulus is None else value % modulus
