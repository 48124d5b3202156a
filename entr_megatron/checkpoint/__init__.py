"""L3: HF <-> Megatron checkpoint conversion with resharding."""
