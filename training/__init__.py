"""Training: runnable with plain `torchrun`, independent of Prefect.

The trainer, the data pipeline, the models, DCP checkpointing and rank-0 metric logging.
"""
