"""L5: sync / one-step-off / fully-async training loops (main-job issue)."""
