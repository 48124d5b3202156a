"""L1: per-architecture data: Megatron <-> HF parameter name and layout tables (learner issue)."""
