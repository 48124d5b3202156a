"""Fixtures shared by every test directory.

pytest puts this file's directory (tests/) on sys.path, so a test anywhere below
imports the shared helpers as `from helpers import ...` (tests/helpers.py).
"""

import os

# Before anything imports torch (its OpenMP runtime reads this once): OpenMP threads that wait
# sleep instead of spinning. The suite runs several processes (driver, ranks, engines) on few
# cores; a spinning thread there burns the core another process needs (up to 10x slower SFT
# steps were seen with two jobs sharing 2 cores). Results are unchanged; only waits differ.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

# Without CUDA, Triton kernels run only in Triton's CPU interpreter, which must be on before
# triton is first imported (its own library functions are built then). The fused output op's
# Triton tests rely on it; backend="auto" never picks the interpreter, so nothing else changes.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module")
def tok():
    """The character-level tokenizer of the built-in tasks (one per test module)."""
    from entr_megatron.tasks import build_char_tokenizer

    return build_char_tokenizer()
