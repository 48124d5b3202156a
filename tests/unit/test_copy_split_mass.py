"""tools/copy_split_mass.py on hand-built distributions: entropy bins, the mass on a token's split
pieces, the mass under 1e-2 and the rare draws it gives per 1k positions."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import load_tool

from entr_megatron.tasks.bpe_tokenizer import stdlib_corpus_files, train_bpe_tokenizer


@pytest.fixture(scope="module")
def tool():
    return load_tool("copy_split_mass")


def _dist(vocab: int, masses: dict[int, float]) -> list[float]:
    rest = (1.0 - sum(masses.values())) / (vocab - len(masses))
    return [masses.get(i, rest) for i in range(vocab)]


def test_bins_split_mass_and_rare_mass_by_hand(tool):
    V = 1000
    sure = _dist(V, {5: 0.99, 7: 0.006, 8: 0.004})              # tail 0 on the other 997: H ~0.067
    certain = _dist(V, {5: 1.0})                                 # H 0
    unsure = _dist(V, {5: 0.5, 9: 0.5})                          # H ln 2
    probs = torch.tensor([sure, certain, unsure, sure], dtype=torch.float64).clamp_min(1e-300)
    logp = probs.log()
    pieces = [[7, 8], [], [9], []]                               # positions 0 and 2 are tokens that can be cut
    rows = tool.position_rows(logp, [5, 5, 350, 5], pieces)
    h_sure = -(0.99 * math.log(0.99) + 0.006 * math.log(0.006) + 0.004 * math.log(0.004))
    assert rows[0] == pytest.approx((h_sure, True, 0.010, 0.010, 5))
    assert rows[1][:3] == (pytest.approx(0.0, abs=1e-12), False, 0.0) and rows[1][3] == pytest.approx(0.0)
    assert rows[2][:3] == pytest.approx((math.log(2), True, 0.5)) and rows[2][4] == 350
    out = {b["H"]: b for b in tool.summarize(rows)}
    assert out[(0.0, 0.01)]["share"] == 0.25 and out[(0.01, 0.1)]["share"] == 0.5
    assert out[(0.01, 0.1)]["multi_char"] == 0.5 and out[(0.01, 0.1)]["split_mass"] == pytest.approx(0.010)
    assert out[(0.01, 0.1)]["rare_per_1k"] == pytest.approx(1000 * 0.5 * 0.010)
    assert out[(0.1, 1.0)]["split_mass"] == pytest.approx(0.5)
    assert out[(0.1, 1.0)]["rare_mass"] == pytest.approx(0, abs=1e-12)
    assert sum(b["share"] for b in out.values()) == pytest.approx(1.0)
    assert "| [0.01, 0.1) | 0.500 | 0.50 | 0.0100 | 0.0100 | 5.00 |" in tool.table(tool.summarize(rows))
    ids = {b["ids"]: b for b in tool.by_id(rows)}        # the cuttable tokens: id 5 sure, id 350 not
    assert ids[(0, 300)] == {"ids": (0, 300), "positions": 1, "sure": 1.0}
    assert ids[(300, 1000)]["positions"] == 1 and ids[(300, 1000)]["sure"] == 0.0
    assert ids[(16000, None)]["positions"] == 0 and "| 16000- | 0 | 0.00 |" in tool.id_table(tool.by_id(rows))


def test_split_pieces_are_the_first_tokens_of_each_proper_prefix(tool):
    tok = train_bpe_tokenizer([f for f in stdlib_corpus_files() if f.name == "textwrap.py"], vocab_size=600)
    token = max(range(len(tok)), key=lambda t: len(tok.decode([t])))
    text = tok.decode([token])
    expected = sorted({tok.encode(text[:k], add_special_tokens=False)[0] for k in range(1, len(text))})
    assert len(text) >= 3 and tool.split_pieces(tok, token) == expected and token not in expected
    one_char = tok.encode("x", add_special_tokens=False)[0]
    assert tool.split_pieces(tok, one_char) == []


def test_target_is_the_warmups_soft_target_by_hand_and_its_loss_minimum(tool):
    """--target A:T tables q = (1 - A) onehot(y) + A softmax(logits / T): by hand on 4 tokens, and q is where
    tools/lm_prior_warmup.py's loss (with the same logits as its reference) has zero gradient."""
    p = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25]], dtype=torch.float64)
    logits = p.log() + 3.0                                           # a shift: softmax is unchanged
    q = tool.soft_target(logits, [3, 0], 0.1, 1.0).exp()
    assert q.tolist()[0] == pytest.approx([0.01, 0.02, 0.03, 0.94]) and q.tolist()[1] == pytest.approx(
        [0.925, 0.025, 0.025, 0.025])
    sharp = tool.soft_target(logits, [3, 0], 0.1, 0.5).exp()[0]     # T 0.5: p^2 / sum p^2 = [1, 4, 9, 16] / 30
    assert sharp.tolist() == pytest.approx([0.1 / 30, 0.4 / 30, 0.9 / 30, 0.9 + 1.6 / 30])
    warmup = load_tool("lm_prior_warmup")
    for mix, t in ((0.1, 1.0), (0.1, 0.5)):
        x = tool.soft_target(logits, [3, 0], mix, t).float().unsqueeze(0).requires_grad_(True)
        loss, _ = warmup.soft_target_loss(x, logits.float().unsqueeze(0), torch.tensor([[3, 0]]), torch.ones(1, 2),
                                          mix, t)
        loss.backward()
        assert x.grad.abs().max() < 1e-6
    assert tool.parse_target("0.015:0.5") == (0.015, 0.5) and tool.parse_target("0.02") == (0.02, 1.0)
    for bad in ("1.5", "0.01:0", "a:b"):
        with pytest.raises(Exception, match="MIX"):
            tool.parse_target(bad)
