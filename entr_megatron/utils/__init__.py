"""L0: small shared helpers (logging, timing)."""
