"""Rank-0 metric logging to MLflow that never waits on the tracking store.

One `log_metric` on SQLite costs ~25 ms, longer than a training step here, so the trainer
only appends to a buffer; a daemon thread imports MLflow (itself a few seconds, kept off
the start of training) and sends the buffer with one `log_batch` call every `flush_s`.
"""

from __future__ import annotations

import queue
import threading
import time
import warnings

MAX_BATCH = 1000  # MLflow's limit of metrics per log_batch call


class MetricsLogger:
    def __init__(self, tracking_uri: str | None, run_id: str | None, flush_s: float = 2.0):
        self.enabled = bool(tracking_uri and run_id)
        self._queue: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._uri, self._run_id, self._flush_s = tracking_uri, run_id, flush_s
        self._thread: threading.Thread | None = None
        if self.enabled:
            self._thread = threading.Thread(target=self._run, name="mlflow-metrics", daemon=True)
            self._thread.start()

    def log(self, step: int, **metrics: float) -> None:
        if self.enabled:
            stamp = int(time.time() * 1000)
            for key, value in metrics.items():
                self._queue.put((key, float(value), stamp, step))

    def tag(self, key: str, value: str) -> None:
        """A run tag (an event worth reading as text), sent with the next batch."""
        if self.enabled:
            self._queue.put((key, value, None, None))

    def _drain(self) -> list:
        items = []
        while True:
            try:
                items.append(self._queue.get_nowait())
            except queue.Empty:
                return items

    def _run(self) -> None:
        from mlflow import MlflowClient
        from mlflow.entities import Metric, RunTag

        client = MlflowClient(tracking_uri=self._uri)
        while True:
            stopping = self._stop.wait(self._flush_s)
            items = self._drain()
            tags = [RunTag(k, v) for k, v, t, _ in items if t is None]
            metrics = [Metric(k, v, t, s) for k, v, t, s in items if t is not None]
            for start in range(0, max(len(metrics), len(tags)), MAX_BATCH):
                batch, batch_tags = metrics[start:start + MAX_BATCH], tags[start:start + MAX_BATCH]
                try:
                    client.log_batch(self._run_id, metrics=batch, tags=batch_tags, synchronous=True)
                except Exception as e:  # a tracking hiccup must not kill training
                    warnings.warn(f"MLflow log_batch failed, {len(batch)} metrics dropped: {e}")
            if stopping:
                return

    def close(self, timeout: float = 60.0) -> None:
        """Send what is buffered and stop the thread."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout)
            self._thread = None
