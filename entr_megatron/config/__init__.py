"""L0: typed, validated configuration dataclasses (errors name the field and what is allowed)."""
