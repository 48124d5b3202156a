"""L4: bucketed, versioned weight broadcasts from the learner to the engines (engines issue)."""
