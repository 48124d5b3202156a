"""Countdown task: reward of hand-written traces, the token labeller, the solver, the SFT sampler,
splits, the registry and config errors. Every expected value is worked out by hand in the comments."""

import random
from collections import Counter

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

from entr_megatron.config import load_config  # noqa: E402
from entr_megatron.tasks.countdown import (  # noqa: E402
    TOKEN_LABELS, CountdownProblem, CountdownTask, check_response, count_solutions, countdown_reward,
    format_trace, label_response, sample_solution, solutions,
)
from entr_megatron.types import Sample  # noqa: E402

P = CountdownProblem((3, 7, 9, 1), 59)
"""+ - *, values up to 99: 9*7=63 leaves 3 1 63; 63-1=62 leaves 3 62; 62-3=59 leaves 59."""
VALID = "9*7=63:3 1 63,63-1=62:3 62,62-3=59:59,ans 59"

F, C, A, N = "forced", "choice", "arithmetic", "answer"


@pytest.fixture(scope="module")
def task(tok):
    return CountdownTask(tokenizer=tok)


def _sample(tok, text, eos=True):
    ids = tok.encode(text, add_special_tokens=False) + ([tok.eos_token_id] if eos else [])
    return Sample(prompt_ids=tok.encode(P.text), response_ids=ids, behaviour_logprobs=[0.0] * len(ids),
                  versions=[0] * len(ids))


def test_prompt_and_trace_format():
    assert P.text == "3 7 9 1 to 59:"
    assert format_trace(P, ((9, "*", 7), (63, "-", 1), (62, "-", 3))) == VALID
    with pytest.raises(ValueError, match="not legal"):
        format_trace(P, ((9, "*", 8),))
    with pytest.raises(ValueError, match="every number"):
        format_trace(P, ((9, "*", 7),))


@pytest.mark.parametrize("text, expected", [
    (VALID, (True, True)),
    ("7*9=63:3 1 63,63-1=62:3 62,62-3=59:59,ans 59", (True, True)),     # the other operand order
    ("9*7=64:3 1 64,64-1=63:3 63,63-3=60:60,ans 60", (True, False)),    # 9*7 is not 64
    ("9*8=72:3 7 1 72,72-7=65:3 1 65,65-1=64:3 64,ans 64", (True, False)),  # no 8 to take
    ("9*9=81:3 7 1 81,81-7=74:3 1 74,74-1=73:3 73,ans 73", (True, False)),  # one 9 only
    ("9*7=63:3 63 1,63-1=62:3 62,62-3=59:59,ans 59", (True, False)),    # list reordered (63 goes last)
    ("9*7=63:3 1 63,63-1=62:3 62,62+3=65:65,ans 65", (True, False)),    # valid steps, 65 is not the target
    ("9*7=63:3 1 63,63-1=62:3 62,62-3=59:59,ans 58", (True, False)),    # answer is not the final value
    ("9*7=63:3 1 63,63-1=62:3 62,ans 62", (True, False)),               # 3 is left unused
    ("1-3=2:7 9 2,9*7=63:2 63,63-2=61:61,ans 61", (True, False)),       # 1-3 is negative
    ("9*7=63:3 1 63,63-1=62:3 62,62*3=186:186,ans 186", (True, False)),  # 186 > max_value
    ("9*7=63:3 1 63,63-1=62:3 62,62-3=59:59,ans 59,", (False, False)),  # trailing separator
    ("9*7=63,63-1=62,62-3=59,ans 59", (False, False)),                  # no restated lists
    ("59", (False, False)),
    ("", (False, False)),
])
def test_check_response_hand_cases(text, expected):
    assert check_response(P, text) == expected


def test_reward_needs_eos_and_pays_format_only_when_asked(tok):
    t = CountdownTask(tokenizer=tok)
    assert t.reward(_sample(tok, VALID), P) == 1.0
    assert t.reward(_sample(tok, VALID, eos=False), P) == 0.0     # cut off before EOS
    wrong = "9*7=63:3 1 63,63-1=62:3 62,62+3=65:65,ans 65"
    assert t.reward(_sample(tok, wrong), P) == 0.0
    fmt = CountdownTask(tokenizer=tok, format_reward=0.1)
    assert fmt.reward(_sample(tok, wrong), P) == 0.1
    assert fmt.reward(_sample(tok, VALID), P) == 1.0
    assert fmt.reward(_sample(tok, "9*7=63 ans"), P) == 0.0
    assert fmt.reward(_sample(tok, wrong, eos=False), P) == 0.0
    # what follows EOS never counts
    ids = _sample(tok, VALID).response_ids + tok.encode("junk", add_special_tokens=False)
    assert t.reward(Sample(prompt_ids=[1], response_ids=ids, behaviour_logprobs=[0.0] * len(ids),
                           versions=[0] * len(ids)), P) == 1.0
    assert countdown_reward(CountdownProblem((2, 2), 4, ("+",), 99), "2+2=4:4,ans 4", ended=True) == 1.0
    # "+" is not among this problem's operations
    assert countdown_reward(CountdownProblem((2, 2), 4, ("*",), 99), "2+2=4:4,ans 4", ended=True) == 0.0


def test_division_only_when_exact():
    p = CountdownProblem((8, 2, 3), 12, ("+", "-", "*", "/"))
    assert check_response(p, "8/2=4:3 4,4*3=12:12,ans 12") == (True, True)
    assert check_response(CountdownProblem((8, 3, 3), 9, ("+", "-", "*", "/")), "8/3=2:3 2,...") == (False, False)
    assert check_response(CountdownProblem((7, 2, 6), 18, ("+", "-", "*", "/")),
                          "7/2=3:6 3,6*3=18:18,ans 18") == (True, False)   # 7/2 is not exact


def test_labels_of_a_valid_trace_by_hand():
    # Step 1 on [3 7 9 1]: first digits 3 7 9 1 (choice); 9 takes + - * (choice); B in 3 7 1 (choice);
    # no number starts with 7 and goes on, so "=" is forced. Result digits: arithmetic; ":3 1 63," forced.
    # Step 2 on [3 1 63]: "6" choice (3, 1 or 6); "3" forced (only 63 starts with 6); 63 takes + - *
    # (63*1 = 63 <= 99); B in 3 1 (choice); "=" forced. Step 3 on [3 62]: "6" choice; "2" forced;
    # 62 takes + and - but not * (186 > 99): choice; B can only be 3: forced; "=" forced.
    # One number left: "ans " forced, "59" answer, EOS forced.
    expected = ([C, C, C, F, A, A] + [F] * 8
                + [C, F, C, C, F, A, A] + [F] * 6
                + [C, F, C, F, F, A, A] + [F] * 4
                + [F] * 4 + [N, N] + [F])
    assert label_response(P, VALID, eos=True) == expected
    assert label_response(P, VALID) == expected[:-1]


def test_labels_of_an_invalid_trace_by_hand():
    # "9*8": 8 is not in the list: the "8" position still had three legal tokens (3 7 1: choice), and
    # after "9*8" nothing is legal ("=" is choice). The written list 3 1 72 is what comes next: "ans"
    # with three numbers left is not legal, so its positions are choice; what follows it is the answer.
    text = "9*8=72:3 1 72,ans 72"
    assert label_response(P, text, eos=True) == [C, C, C, C, A, A] + [F] * 8 + [C] * 4 + [N, N] + [F]
    # garbage: every position of a broken head is choice; a result without ":" goes straight to ","
    assert label_response(P, "x9*") == [C, C, C]
    assert label_response(P, "9*7=63,") == [C, C, C, F, A, A, F]
    assert label_response(P, "") == [] and label_response(P, "", eos=True) == [F]
    assert set(TOKEN_LABELS) == {F, C, A, N}


def test_token_labels_follow_the_ids(tok, task):
    sample = _sample(tok, VALID)
    assert task.token_labels(sample, P) == label_response(P, VALID, eos=True)
    cut = _sample(tok, VALID[:10], eos=False)
    assert task.token_labels(cut, P) == label_response(P, VALID[:10])
    # a special token mid-response decodes to nothing: choice; after EOS everything is forced
    ids = tok.encode("9*", add_special_tokens=False) + [tok.pad_token_id, tok.eos_token_id, tok.encode("1")[-1]]
    s = Sample(prompt_ids=[1], response_ids=ids, behaviour_logprobs=[0.0] * 5, versions=[0] * 5)
    assert task.token_labels(s, P) == [C, C, C, F, F]


def test_solver_finds_every_solution_of_a_tiny_problem():
    # 2 3 4 to 20: (2,3)->5 6 1 then with 4: only 5*4; (2,4)->6 8 2 then with 3: 18 24 6 9 11 5 5 3 1, no 20;
    # (3,4)->7 12 1 then with 2: 14 24 14 10 9 5 ..., no 20. So 2+3 or 3+2, then 5*4 or 4*5.
    p = CountdownProblem((2, 3, 4), 20)
    expected = {((2, "+", 3), (5, "*", 4)), ((2, "+", 3), (4, "*", 5)),
                ((3, "+", 2), (5, "*", 4)), ((3, "+", 2), (4, "*", 5))}
    assert len(solutions(p)) == 4 and set(solutions(p)) == expected
    assert count_solutions((4, 2, 3), 20, p.ops, p.max_value) == 4
    # equal numbers make one text, not two: 2+2 and 2*2 (2-2 = 0)
    assert set(solutions(CountdownProblem((2, 2), 4))) == {((2, "+", 2),), ((2, "*", 2),)}
    assert solutions(CountdownProblem((2, 2), 5)) == [] and count_solutions((2, 2), 5, ("+", "-", "*"), 99) == 0


def test_sft_sampler_draws_among_all_solutions_uniformly():
    p = CountdownProblem((2, 3, 4), 20)
    rng = random.Random(0)
    draws = Counter(sample_solution(p, rng) for _ in range(800))
    assert set(draws) == set(solutions(p))
    assert all(150 <= c <= 250 for c in draws.values()), draws    # 200 each, +-3.5 sd
    assert sample_solution(CountdownProblem((2, 2), 5), rng) is None
    # seeded: the same draw for the same rng seed
    assert sample_solution(p, random.Random(5)) == sample_solution(p, random.Random(5))


def test_sft_examples_are_valid_diverse_traces(tok, task):
    examples = task.sft_examples("train", 64, seed=3)
    problems = task.problems("train", 64, seed=3)
    texts = []
    for (prompt, target), p in zip(examples, problems):
        assert prompt == tok.encode(p.text) and target[-1] == tok.eos_token_id
        text = tok.decode(target[:-1])
        assert check_response(p, text) == (True, True)
        texts.append(text)
    assert 40 <= sum(len(t) + 1 for t in texts) / len(texts) <= 60   # responses of ~44 tokens with EOS
    assert examples == task.sft_examples("train", 64, seed=3)
    # one problem, many seeds: several different solutions come out
    p = CountdownProblem((3, 7, 9, 1), 59)
    assert count_solutions(p.numbers, 59, p.ops, p.max_value) > 1
    assert len({sample_solution(p, random.Random(s)) for s in range(50)}) > 1


def test_problems_are_solvable_in_range_and_split(task):
    train = task.problems("train", 300, seed=0)
    test = task.problems("test", 100, seed=0)
    assert not {p.text for p in train} & {p.text for p in test}
    assert len(set(train)) == 300 and train == task.problems("train", 300, seed=0)
    for p in train[:50] + test[:50]:
        assert len(p.numbers) == 4 and all(1 <= v <= 9 for v in p.numbers) and 10 <= p.target <= 99
        assert count_solutions(p.numbers, p.target, p.ops, p.max_value) >= 1
    with pytest.raises(ValueError, match="split"):
        task.problems("valid", 1, 0)
    with pytest.raises(ValueError, match="widen the ranges"):
        CountdownTask(2, 1, 2, min_target=90, max_target=99).problems("train", 1, 0)  # 2 numbers <= 2: at most 4


def test_task_argument_errors():
    with pytest.raises(ValueError, match="num_operands"):
        CountdownTask(num_operands=7)
    with pytest.raises(ValueError, match="max_number"):
        CountdownTask(min_number=5, max_number=3)
    with pytest.raises(ValueError, match="ops"):
        CountdownTask(ops=("^",))
    with pytest.raises(ValueError, match="format_reward"):
        CountdownTask(format_reward=1.0)


@pytest.mark.parametrize("override, field", [
    ("task.countdown.num_operands=1", r"task\.countdown\.num_operands=1 .*\[2, 6\]"),
    ("task.countdown.max_number=200", r"task\.countdown\.max_number=200 .*\[0, 99\]"),
    ("task.countdown.min_target=200", r"task\.countdown\.min_target=200 .*\[0, 99\]"),
    ("task.countdown.max_target=100", r"task\.countdown\.max_target=100 .*\[0, 99\]"),
    ("task.countdown.operations=['^']", r"task\.countdown\.operations=.*\+, -, \*, /"),
    ("task.countdown.operations=[]", r"task\.countdown\.operations=\[\].*at least one"),
    ("task.countdown.format_reward=1.0", r"task\.countdown\.format_reward=1\.0 .*< 1"),
    ("task.countdown.layout=wide", r"task\.countdown\.layout='wide' .*compact, spaced"),
])
def test_config_errors_name_the_field(override, field):
    with pytest.raises(ValueError, match=field):
        load_config(None, ["task.name=countdown", override])


def test_registry_builds_it_from_the_config(tok):
    from entr_megatron.controller.job.run import build_task
    from entr_megatron.tasks import TASK_BUILDERS, default_tokenizer

    cfg = load_config(None, ["task.name=countdown", "task.countdown.num_operands=3", "task.countdown.max_value=50",
                             "task.countdown.max_target=50", "task.countdown.operations=['+', '*']"])
    task = build_task(cfg, tok)
    assert isinstance(task, CountdownTask) and "countdown" in TASK_BUILDERS
    assert (task.num_operands, task.max_value, task.ops) == (3, 50, ("+", "*"))
    assert len(task.problems("test", 5, 0)[0].numbers) == 3
    assert default_tokenizer("countdown").encode(P.text) == tok.encode(P.text)
    short = load_config(None, ["task.name=countdown", "model.max_prompt_len=10"])
    with pytest.raises(ValueError, match=r"model\.max_prompt_len=10 .*countdown"):
        build_task(short, tok)


def _check_variants_written_at_rate(tok, variant_set: str, table: dict, rate: float, n: int,
                                    layout: str = "compact") -> CountdownTask:
    """A task with `variant_set` at `rate`: its n warm-up traces, read back through `table` (each variant
    as its character, and from the spaced layout to the compact one), are correct and earn 1; each
    variant is written within 4 binomial sds of the rate. Returns the task."""
    from entr_megatron.tasks.countdown import compact

    task = CountdownTask(tokenizer=tok, separator_variants=rate, variant_set=variant_set, layout=layout)
    back = str.maketrans({v: c for c, vs in table.items() for v in vs})
    written = Counter()
    for (_, target), p in zip(task.sft_examples("train", n, seed=0), task.problems("train", n, seed=0)):
        text = tok.decode(target[:-1])
        written.update(text)
        plain = text.translate(back)
        assert check_response(p, compact(plain) if layout == "spaced" else plain) == (True, True)
        assert task.reward(_sample(tok, text), p) == 1.0
    for c, variants in table.items():
        total = written[c] + sum(written[v] for v in variants)
        for v in variants:
            assert abs(written[v] / total - rate) < 4 * (rate * (1 - rate) / total) ** 0.5, (c, v, written)
    return task


def test_separator_variants_are_written_at_their_rate_and_read_as_separators():
    """separator_variants (the long-tail testbed): warm-up traces write "," ":" " " as ";" "|" "_" at
    the given rate; the reward and the labels read a variant as its separator. Without it a variant
    is what it is: a broken trace."""
    from entr_megatron.tasks.char_tokenizer import CHARS, build_char_tokenizer
    from entr_megatron.tasks.countdown import VARIANT_SETS

    table = {",": (";",), ":": ("|",), " ": ("_",)}
    assert VARIANT_SETS["separators"] == table
    tok = build_char_tokenizer(CHARS + ";|_")
    task = _check_variants_written_at_rate(tok, "separators", table, 0.1, 400)
    varied = VALID.replace(",", ";", 1).replace(" ", "_", 1).replace(":", "|", 1)
    plain = CountdownTask(tokenizer=tok)
    assert task.reward(_sample(tok, varied), P) == 1.0 and plain.reward(_sample(tok, varied), P) == 0.0
    assert task.token_labels(_sample(tok, varied), P) == plain.token_labels(_sample(tok, VALID), P)
    assert plain.sft_examples("train", 8, seed=0) == CountdownTask(tokenizer=tok).sft_examples("train", 8, seed=0)
    with pytest.raises(ValueError, match="separator_variants"):
        CountdownTask(tokenizer=tok, separator_variants=0.5)
    with pytest.raises(ValueError, match=r"task\.countdown\.separator_variants=0\.5 .*\[0, 0\.5\)"):
        load_config(None, ["task.name=countdown", "task.countdown.separator_variants=0.5"])


def test_structural_variant_set_writes_each_variant_at_the_rate_and_leaves_separators_traces_as_they_were():
    """variant_set="structural": "," ":" " " "=" each have two variants, each written with chance
    separator_variants (counted against the binomial), each read back as its character. The default
    set draws exactly as the one-variant rule it replaced (written out here), so the long-tail grid's
    warm-ups are unchanged. The config's names and variant counts are the task's."""
    from typing import get_args

    from entr_megatron.config.task import VARIANTS_PER_CHARACTER, VariantSet
    from entr_megatron.tasks.char_tokenizer import CHARS, build_char_tokenizer
    from entr_megatron.tasks.countdown import VARIANT_SETS, format_trace, sample_solution

    assert set(get_args(VariantSet)) == set(VARIANT_SETS)
    assert VARIANTS_PER_CHARACTER == {k: len(next(iter(t.values()))) for k, t in VARIANT_SETS.items()}
    assert all(len(vs) == VARIANTS_PER_CHARACTER[k] for k, t in VARIANT_SETS.items() for vs in t.values())
    table = {",": (";", "&"), ":": ("|", "!"), " ": ("_", "#"), "=": ("~", "@")}
    assert VARIANT_SETS["structural"] == table
    tok = build_char_tokenizer(CHARS + ";|_&!#~@")
    task = _check_variants_written_at_rate(tok, "structural", table, 0.05, 600)
    varied = VALID.replace("=", "@", 1).replace(",", "&", 1).replace(":", "!", 1).replace(" ", "#", 1)
    plain = CountdownTask(tokenizer=tok)
    assert task.reward(_sample(tok, varied), P) == 1.0 and plain.reward(_sample(tok, varied), P) == 0.0
    assert task.token_labels(_sample(tok, varied), P) == plain.token_labels(_sample(tok, VALID), P)
    # the one-variant rule as it was written before the sets: one draw per separator
    old = {",": ";", ":": "|", " ": "_"}
    seps = CountdownTask(tokenizer=tok, separator_variants=0.2)
    rng = random.Random("countdown-sft:train:3")
    for (_, target), p in zip(seps.sft_examples("train", 50, seed=3), seps.problems("train", 50, seed=3)):
        trace = format_trace(p, sample_solution(p, rng))
        text = "".join(old[c] if c in old and rng.random() < 0.2 else c for c in trace)
        assert tok.decode(target[:-1]) == text
    with pytest.raises(ValueError, match="variant_set"):
        CountdownTask(tokenizer=tok, separator_variants=0.01, variant_set="digits")
    with pytest.raises(ValueError, match="rarer way"):
        CountdownTask(tokenizer=tok, separator_variants=0.3, variant_set="structural")
    with pytest.raises(ValueError, match=r"task\.countdown\.variant_set='digits'.*separators, structural"):
        load_config(None, ["task.name=countdown", "task.countdown.variant_set=digits"])
    with pytest.raises(ValueError, match=r"task\.countdown\.separator_variants=0\.3 .*\[0, 0\.25\)"):
        load_config(None, ["task.name=countdown", "task.countdown.separator_variants=0.3",
                           "task.countdown.variant_set=structural"])


def test_structural_digits_variant_set_varies_digits_too_and_reads_them_back():
    """variant_set="structural_digits": structural's variants, and each digit d written as the capitals
    "A"+d and "K"+d, each with chance separator_variants (against the binomial); the reward and the
    labels read a varied trace as the plain one."""
    from entr_megatron.tasks.char_tokenizer import CHARS, build_char_tokenizer
    from entr_megatron.tasks.countdown import VARIANT_SETS

    digits = {str(d): ("ABCDEFGHIJ"[d], "KLMNOPQRST"[d]) for d in range(10)}
    assert VARIANT_SETS["structural_digits"] == {**VARIANT_SETS["structural"], **digits}
    tok = build_char_tokenizer(CHARS + ";|_&!#~@" + "ABCDEFGHIJKLMNOPQRST")
    task = _check_variants_written_at_rate(tok, "structural_digits", VARIANT_SETS["structural_digits"], 0.05, 400)
    varied = "".join(digits[c][i % 2] if c in digits and i % 3 == 0 else c for i, c in enumerate(VALID))
    assert varied != VALID
    plain = CountdownTask(tokenizer=tok)
    assert task.reward(_sample(tok, varied), P) == 1.0 and plain.reward(_sample(tok, varied), P) == 0.0
    assert task.token_labels(_sample(tok, varied), P) == plain.token_labels(_sample(tok, VALID), P)


def test_structural_forced_digits_varies_a_digit_only_where_the_text_before_it_determines_it():
    """variant_set="structural_forced_digits": structural_digits' table; separators varied everywhere at
    the rate, a digit only at positions `label_response` calls forced or answer (at the rate there,
    against the binomial), never at a choice or arithmetic position; the reward reads traces back."""
    from entr_megatron.tasks.char_tokenizer import CHARS, build_char_tokenizer
    from entr_megatron.tasks.countdown import ANSWER, FORCED, VARIANT_SETS, label_response

    table = VARIANT_SETS["structural_forced_digits"]
    assert table == VARIANT_SETS["structural_digits"]
    tok = build_char_tokenizer(CHARS + ";|_&!#~@" + "ABCDEFGHIJKLMNOPQRST")
    rate = 0.05
    task = CountdownTask(tokenizer=tok, separator_variants=rate, variant_set="structural_forced_digits")
    back = str.maketrans({v: c for c, vs in table.items() for v in vs})
    varied, total = Counter(), Counter()  # by (character class, label is sure)
    for (_, target), p in zip(task.sft_examples("train", 400, seed=0), task.problems("train", 400, seed=0)):
        text = tok.decode(target[:-1])
        plain = text.translate(back)
        assert check_response(p, plain) == (True, True) and task.reward(_sample(tok, text), p) == 1.0
        for c, was, label in zip(text, plain, label_response(p, plain)):
            if was in table:
                key = ("digit", label in (FORCED, ANSWER)) if was.isdigit() else ("separator", None)
                total[key] += 1
                varied[key] += c != was
    assert varied[("digit", False)] == 0 and total[("digit", False)] > 500  # choices and results: never
    for key in [("digit", True), ("separator", None)]:  # both variants together: 2 x rate
        n, share = total[key], varied[key] / total[key]
        assert n > 1000 and abs(share - 2 * rate) < 4 * (2 * rate * (1 - 2 * rate) / n) ** 0.5, (key, share, n)


SPACED = "9 * 7 = 63 : 3 1 63 , 63 - 1 = 62 : 3 62 , 62 - 3 = 59 : 59 , ans 59"
"""VALID in the spaced layout, written out by hand."""


def test_spaced_layout_reads_back_exactly_and_refuses_any_other_spacing(tok):
    from typing import get_args

    from entr_megatron.config.task import CountdownLayout
    from entr_megatron.tasks.countdown import LAYOUTS, compact, spaced

    assert set(get_args(CountdownLayout)) == set(LAYOUTS)
    assert spaced(VALID) == SPACED and compact(SPACED) == VALID
    for bad in [VALID, SPACED.replace("* 7", "*7"), SPACED.replace("9 *", "9  *"), "9 * 7 =63"]:
        assert compact(bad) is None, bad
    task = CountdownTask(tokenizer=tok, layout="spaced")
    assert task.reward(_sample(tok, SPACED), P) == 1.0
    assert task.reward(_sample(tok, VALID), P) == 0.0                       # compact text: not this layout
    assert task.reward(_sample(tok, SPACED.replace(", ans", ",  ans")), P) == 0.0
    assert task.reward(_sample(tok, SPACED + " "), P) == 0.0
    assert task.reward(_sample(tok, SPACED.replace("59 , ans 59", "58 , ans 58")), P) == 0.0
    assert CountdownTask(tokenizer=tok).reward(_sample(tok, SPACED), P) == 0.0
    wrong = CountdownTask(tokenizer=tok, layout="spaced", format_reward=0.1)
    assert wrong.reward(_sample(tok, SPACED.replace("59 , ans 59", "58 , ans 58")), P) == 0.1
    with pytest.raises(ValueError, match="layout"):
        CountdownTask(layout="wide")


def test_spaced_labels_by_hand():
    from entr_megatron.tasks.countdown import label_spaced

    # On [9 7] (+ - *): "9" choice (9 or 7 first), the operator choice (9+7, 9-7, 9*7), "7" forced,
    # "=" forced; "16" arithmetic; ":16," forced; "ans " forced (one number left); "16" answer.
    # Spaced: the space before "+" asks the operator's question (a BPE writes " +" as one token):
    # choice; the space after a mark is forced; the spaces before "=" ":" "," take their forced label.
    q = CountdownProblem((9, 7), 16)
    #   9  _  +  _  7  _  =  _  1  6  _  :  _  1  6  _  ,  _  a  n  s  _  1  6
    expected = [C, C, C] + [F] * 5 + [A, A] + [F] * 12 + [N, N]
    assert label_spaced(q, "9 + 7 = 16 : 16 , ans 16", eos=True) == expected + [F]
    assert label_spaced(q, "9 + 7 = 16 : 16 , ans 16") == expected
    assert label_response(q, "9+7=16:16,ans 16") == [C, C, F, F, A, A] + [F] * 8 + [N, N]
    # a mark missing a space loses only that space; the rest keeps the compact labels
    assert label_spaced(q, "9 +7") == [C, C, C, F] and label_spaced(q, "") == []


def test_spaced_token_labels_and_space_variants(tok):
    """The task's token labels in the spaced layout: on every character of VALID, the compact labels;
    variant_set="spaces" writes each space as "_" and "#" at the rate and touches nothing else."""
    from entr_megatron.tasks.char_tokenizer import CHARS, build_char_tokenizer
    from entr_megatron.tasks.countdown import VARIANT_SETS

    task = CountdownTask(tokenizer=tok, layout="spaced")
    labels = task.token_labels(_sample(tok, SPACED), P)
    marks = "+-*=:,"
    inserted = {i for i, c in enumerate(SPACED) if c == " " and (SPACED[i - 1] in marks or SPACED[i + 1] in marks)}
    assert [x for i, x in enumerate(labels[:-1]) if i not in inserted] == label_response(P, VALID)
    assert labels[-1] == F and all(labels[i] == F for i in inserted if SPACED[i - 1] in marks)
    assert VARIANT_SETS["spaces"] == {" ": ("_", "#")}
    chars = build_char_tokenizer(CHARS + "_#")
    spaces = _check_variants_written_at_rate(chars, "spaces", VARIANT_SETS["spaces"], 0.05, 300, layout="spaced")
    varied = SPACED.replace(" ", "_", 3).replace(" ", "#", 2)
    assert spaces.reward(_sample(chars, varied), P) == 1.0
    assert spaces.token_labels(_sample(chars, varied), P) == task.token_labels(_sample(tok, SPACED), P)
