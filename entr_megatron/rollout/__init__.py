"""L3: rollout engines (engines issue): the embedded HF engine, the SGLang client, tasks and rewards."""
