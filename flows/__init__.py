"""Orchestration: the campaign spec, the Prefect flows and the `campaign` CLI."""
