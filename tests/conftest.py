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


@pytest.fixture(scope="module")
def tok():
    """The character-level tokenizer of the built-in tasks (one per test module)."""
    from entr_megatron.rollout.tasks import build_char_tokenizer

    return build_char_tokenizer()
