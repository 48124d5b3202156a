"""Registry of off-policy corrections, all with the CorrectionFn interface
(see correction_base.py). Keys equal entr_megatron.config.algorithm.CORRECTION_NAMES."""

from __future__ import annotations

from entr_megatron.algorithm.correction_base import CorrectionFn
from entr_megatron.algorithm.corrections_divergence import kpop_correction, m2po_correction
from entr_megatron.algorithm.corrections_entr import (
    entr_calibrated_correction,
    entr_correction,
    entr_soft_correction,
    matched_band_correction,
    matched_random_correction,
    random_drop_correction,
)
from entr_megatron.algorithm.corrections_sequence import a3po_correction, opsm_correction, trm_correction
from entr_megatron.algorithm.corrections_ratio import (
    decoupled_correction,
    icepop_correction,
    mis_geo_correction,
    mis_seq_correction,
    mis_token_correction,
    naive_correction,
    none_correction,
    tis_correction,
)

CORRECTIONS: dict[str, CorrectionFn] = {
    "none": none_correction,
    "naive": naive_correction,
    "entr": entr_correction,
    "entr_calibrated": entr_calibrated_correction,
    "entr_soft": entr_soft_correction,
    "tis": tis_correction,
    "mis_token": mis_token_correction,
    "mis_seq": mis_seq_correction,
    "mis_geo": mis_geo_correction,
    "icepop": icepop_correction,
    "kpop": kpop_correction,
    "m2po": m2po_correction,
    "decoupled": decoupled_correction,
    "opsm": opsm_correction,
    "trm": trm_correction,
    "a3po": a3po_correction,
    "matched_band": matched_band_correction,
    "matched_random": matched_random_correction,
    "random_drop": random_drop_correction,
}
