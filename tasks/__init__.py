"""Prefect tasks: small typed steps, thin wrappers around cluster/ and training/."""
