"""AlgorithmConfig: defaults, validation messages, and agreement with the algorithm registries."""

import ast
import dataclasses
import math

import pytest

from entr_megatron.algorithm import ADVANTAGE_ESTIMATORS, CORRECTIONS, LOSS_AGGREGATIONS, POLICY_LOSSES
from entr_megatron.config import algorithm as config_module
from entr_megatron.config.algorithm import (
    ADVANTAGE_ESTIMATOR_NAMES,
    CLIP_RANGE_DEFAULTS,
    CORRECTION_NAMES,
    LOSS_AGG_MODES,
    POLICY_LOSS_NAMES,
    AlgorithmConfig,
)


def test_registries_match_the_config_names():
    assert set(CORRECTIONS) == set(CORRECTION_NAMES) and len(CORRECTIONS) == len(CORRECTION_NAMES)
    assert set(POLICY_LOSSES) == set(POLICY_LOSS_NAMES) == set(CLIP_RANGE_DEFAULTS)
    assert set(ADVANTAGE_ESTIMATORS) == set(ADVANTAGE_ESTIMATOR_NAMES)
    assert set(LOSS_AGGREGATIONS) == set(LOSS_AGG_MODES)


def test_config_module_does_not_import_the_algorithm_layer():
    # L0 below L1 (ARCHITECTURE.md): the names are duplicated here on purpose.
    tree = ast.parse(open(config_module.__file__).read())
    imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    imported += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert imported and not any(m.startswith("entr_megatron.algorithm") or m == "torch" for m in imported)


def test_defaults_follow_entr_md():
    import re
    from pathlib import Path

    table = (Path(__file__).parents[2] / "docs" / "ENTR.md").read_text()
    tau, eps = re.search(r"^\| `entr` \|.*\| tau ([\d.]+), eps ([\d.]+) \|", table, re.M).groups()
    cfg = AlgorithmConfig()
    assert (cfg.correction, cfg.tau, cfg.entr_eps) == ("entr", float(tau), float(eps)) == ("entr", 1.0, 0.01)
    assert (cfg.policy_loss, cfg.aggregation, cfg.entropy_source) == ("ppo_clip", "token-mean", "learner")
    assert cfg.loss_agg_mode is None and cfg.correction_mode == "published" and cfg.counts_rejected
    assert cfg.clip_range() == (0.2, 0.28)
    assert cfg.icepop_band == (0.5, 5.0) and cfg.tis_cap == 2.0 and cfg.decoupled_cap == 5.0
    assert cfg.decoupled_cap_mode == "drop" and cfg.mis_geo_band == (0.999, 1.001)
    assert cfg.kpop_threshold == 0.1 and cfg.m2po_threshold == 0.04 and cfg.calibrated_z == 3.5


def test_published_aggregation_and_denominator_per_method():
    # GSPO averages per sequence (the paper's 1/G sum_i 1/|y_i|); the rest per token.
    assert AlgorithmConfig(policy_loss="gspo").aggregation == "seq-mean-token-mean"
    assert AlgorithmConfig(policy_loss="cispo").aggregation == "token-mean"
    assert AlgorithmConfig(policy_loss="gspo", loss_agg_mode="token-mean").aggregation == "token-mean"
    # verl's rejection sampling drops rejected tokens from the denominator; ENTR and IcePop count them.
    for name in ("mis_token", "mis_seq", "mis_geo"):
        assert not AlgorithmConfig(correction=name).counts_rejected
        assert AlgorithmConfig(correction=name, correction_mode="mask_only").counts_rejected
        assert AlgorithmConfig(correction=name, rejected_in_denominator=True).counts_rejected
    for name in ("entr", "icepop", "decoupled", "kpop", "m2po"):
        assert AlgorithmConfig(correction=name).counts_rejected
    assert not AlgorithmConfig(correction="entr", rejected_in_denominator=False).counts_rejected


def test_every_field_has_a_docstring():
    source = open(config_module.__file__).read()
    for f in dataclasses.fields(AlgorithmConfig):
        line = next(l for l in source.splitlines() if l.strip().startswith(f"{f.name}:"))
        following = source.split(line, 1)[1].lstrip()
        assert following.startswith('"""'), f"field {f.name} has no docstring"


def test_clip_range_per_loss():
    assert AlgorithmConfig(policy_loss="gspo").clip_range() == (3e-4, 4e-4)
    assert AlgorithmConfig(policy_loss="cispo").clip_range() == (1.0, 0.28)
    assert AlgorithmConfig().clip_range("gspo") == (3e-4, 4e-4)
    assert AlgorithmConfig(policy_loss="gspo", eps_clip_high=1e-3).clip_range() == (3e-4, 1e-3)
    assert AlgorithmConfig(eps_clip_low=0.1).clip_range() == (0.1, 0.28)


def test_uses_old_logprobs():
    for name in ("tis", "icepop", "mis_token", "mis_seq", "mis_geo", "kpop", "decoupled"):
        assert AlgorithmConfig(correction=name).uses_old_logprobs, name
    for name in ("none", "entr", "entr_calibrated", "entr_soft", "m2po"):
        assert not AlgorithmConfig(correction=name).uses_old_logprobs, name
    assert not AlgorithmConfig(correction="icepop", correction_mode="mask_only").uses_old_logprobs


def test_bands_from_yaml_lists_become_tuples():
    cfg = AlgorithmConfig(mis_seq_band=[0.25, 4])
    assert cfg.mis_seq_band == (0.25, 4.0) and isinstance(cfg.mis_seq_band, tuple)
    assert AlgorithmConfig(icepop_band=(0, math.inf)).icepop_band == (0.0, math.inf)


@pytest.mark.parametrize(
    "field, value, allowed_hint",
    [
        ("correction", "entr2", "entr_calibrated"),
        ("policy_loss", "ppo", "ppo_clip"),
        ("advantage_estimator", "gae", "rloo"),
        ("loss_agg_mode", "sum", "seq-mean-token-sum-norm"),
        ("entropy_source", "engine", "rollout"),
        ("tau", 0.0, "(0.0"),
        ("tau", -1.0, "(0.0"),
        ("tau", "0.5", "number"),
        ("tau", True, "number"),
        ("entr_eps", 0.0, "(0.0"),
        ("calibrated_z", -3.0, "(0.0"),
        ("tis_cap", math.nan, "number"),
        ("kpop_threshold", 0, "(0.0"),
        ("m2po_threshold", -0.04, "(0.0"),
        ("decoupled_cap", 0.0, "(0.0"),
        ("soft_mask_multiple", 0.5, "[1.0"),
        ("eps_clip_low", 1.5, "[0.0, 1.0]"),
        ("eps_clip_high", -0.1, "[0.0"),
        ("dual_clip_c", 1.0, "(1.0"),
        ("mis_token_band", (2.0, 0.5), "0 <= lo <= 1 <= hi"),
        ("icepop_band", (1.5, 5.0), "0 <= lo <= 1 <= hi"),
        ("mis_geo_band", (0.5,), "pair"),
        ("mis_seq_band", (-0.1, 2.0), "0 <= lo <= 1 <= hi"),
    ],
)
def test_errors_name_field_value_and_allowed(field, value, allowed_hint):
    with pytest.raises(ValueError) as info:
        AlgorithmConfig(**{field: value})
    message = str(info.value)
    assert f"AlgorithmConfig.{field}=" in message
    assert repr(value) in message
    assert allowed_hint in message


def test_unknown_correction_lists_all_valid_names():
    with pytest.raises(ValueError) as info:
        AlgorithmConfig(correction="entropy")
    assert all(name in str(info.value) for name in CORRECTION_NAMES)


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        AlgorithmConfig().tau = 1.0  # type: ignore[misc]
