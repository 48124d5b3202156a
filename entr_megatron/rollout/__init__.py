"""L3: rollout engines (engines issue): the embedded HF engine, the SGLang client, tasks and rewards.

`engine.py` holds the `RolloutEngine` protocol and the records that cross it,
`sampling.py` the definition of the sampled distribution (and so of every
behaviour log-prob), `weights.py` the staging of weight versions; the embedded
engine is `embedded.py` (client) + `embedded_worker.py` (its process), which talk
only through the typed records of `embedded_protocol.py`, + `decoder.py`
(continuous batching) + `hf_model.py` (the HF model and its cache). The SGLang
engine is the `sglang/` package (protocol, client, engine, launcher); tasks and
rewards are in `tasks/` (TASK_BUILDERS: the trainable tasks).
"""

from entr_megatron.rollout.embedded import EmbeddedEngine, EmbeddedEngineConfig
from entr_megatron.rollout.engine import (
    FINISH_REASONS,
    EngineError,
    EngineHealth,
    GenerateRequest,
    GenerateResult,
    RolloutEngine,
    SamplingParams,
    WeightReceiver,
    WeightSource,
    WeightUpdateReport,
    generate,
)
from entr_megatron.rollout.weights import BucketEntry, WeightBucket, WeightStage, pack_buckets

__all__ = [
    "FINISH_REASONS",
    "BucketEntry",
    "EmbeddedEngine",
    "EmbeddedEngineConfig",
    "EngineError",
    "EngineHealth",
    "GenerateRequest",
    "GenerateResult",
    "RolloutEngine",
    "SamplingParams",
    "WeightBucket",
    "WeightReceiver",
    "WeightSource",
    "WeightStage",
    "WeightUpdateReport",
    "generate",
    "pack_buckets",
]
