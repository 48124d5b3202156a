"""Fixtures shared by every test directory.

pytest puts this file's directory (tests/) on sys.path, so a test anywhere below
imports the shared helpers as `from helpers import ...` (tests/helpers.py).
"""

import pytest


@pytest.fixture(scope="module")
def tok():
    """The character-level tokenizer of the built-in tasks (one per test module)."""
    from entr_megatron.rollout.tasks import build_char_tokenizer

    return build_char_tokenizer()
