"""Rank-0 metric logging to MLflow, in a process of its own that training never waits on.

One `log_metric` on SQLite costs ~25 ms, longer than a training step here; a batched
`log_batch` still costs tens of milliseconds of Python, and importing MLflow costs seconds.
In a thread of the trainer all of that would hold the GIL against the training loop
(py-spy put the flushes alone at ~2% of the trainer's wall time). So the trainer writes one JSON line
per call into a pipe, and a sink process (`python -m training.metrics`), started at the
lowest CPU priority and free to run on any core, imports MLflow and sends what arrived
with one `log_batch` every `flush_s`. When the trainer closes the pipe (or dies: the pipe
closes with it) the sink sends the rest and exits.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
import warnings

MAX_BATCH = 1000  # MLflow's limit of metrics per log_batch call


class MetricsLogger:
    def __init__(self, tracking_uri: str | None, run_id: str | None, flush_s: float = 2.0):
        self.enabled = bool(tracking_uri and run_id)
        self._sink: subprocess.Popen | None = None
        if self.enabled:
            self._sink = subprocess.Popen(
                [sys.executable, "-m", "training.metrics", "--uri", tracking_uri, "--run-id", run_id, "--flush-s", str(flush_s)],
                stdin=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": _package_root()},
            )

    def log(self, step: int, **metrics: float) -> None:
        if self.enabled:
            stamp = int(time.time() * 1000)
            self._send("".join(json.dumps({"key": k, "value": float(v), "timestamp": stamp, "step": step}) + "\n" for k, v in metrics.items()))

    def tag(self, key: str, value: str) -> None:
        """A run tag (an event worth reading as text), sent with the next batch."""
        if self.enabled:
            self._send(json.dumps({"key": key, "tag": value}) + "\n")

    def _send(self, lines: str) -> None:
        try:
            self._sink.stdin.write(lines)
            self._sink.stdin.flush()
        except (BrokenPipeError, ValueError, OSError) as e:  # the sink is gone: training goes on
            warnings.warn(f"MLflow metrics sink exited ({e.__class__.__name__}); later metrics are not logged")
            self.enabled = False

    def close(self, timeout: float = 60.0) -> None:
        """Let the sink send what it holds, and wait for it."""
        if self._sink is None:
            return
        sink, self._sink, self.enabled = self._sink, None, False
        try:
            sink.stdin.close()
        except OSError:
            pass
        try:
            sink.wait(timeout)
        except subprocess.TimeoutExpired:
            warnings.warn(f"MLflow metrics sink did not finish in {timeout:.0f} s; the last metrics may be missing")
            sink.kill()


def _package_root() -> str:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)


# --- the sink process --------------------------------------------------------------------
def _lower_priority() -> None:
    """Yield to training: lowest CPU priority, and any core rather than the trainer's own
    (the pinning was inherited)."""
    try:  # SCHED_IDLE: runs only on an otherwise idle core (nice 19 slowed training more here)
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        os.nice(19)
    # A signal to the trainer's process group is not for the sink: it stops when the pipe
    # closes, after sending what it holds.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
    except OSError:  # a cpuset narrower than cpu_count: keep the inherited set
        pass


def _read_lines(buffer: list[dict], lock: threading.Lock, closed: threading.Event) -> None:
    for line in sys.stdin:
        with lock:
            buffer.append(json.loads(line))
    # The trainer is done: send the rest at normal priority, or a busy host would keep an
    # idle-only sink (and the trainer waiting on it) for as long as other trials train.
    try:
        os.sched_setscheduler(threading.main_thread().native_id, os.SCHED_OTHER, os.sched_param(0))
    except (AttributeError, OSError):
        pass
    closed.set()


def sink(uri: str, run_id: str, flush_s: float) -> None:
    buffer: list[dict] = []
    lock, closed = threading.Lock(), threading.Event()
    threading.Thread(target=_read_lines, args=(buffer, lock, closed), daemon=True).start()

    from mlflow import MlflowClient
    from mlflow.entities import Metric, RunTag

    client = MlflowClient(tracking_uri=uri)
    logged = last_logged_steps(client, run_id)
    while True:
        done = closed.wait(flush_s)
        with lock:
            items, buffer[:] = list(buffer), []
        tags = [RunTag(i["key"], i["tag"]) for i in items if "tag" in i]
        # A resumed trial replays the steps after its checkpoint: those the run holds already are not logged twice.
        fresh = [i for i in items if "tag" not in i and i["step"] > logged.get(i["key"], -1)]
        metrics = [Metric(i["key"], i["value"], i["timestamp"], i["step"]) for i in fresh]
        for i in fresh:
            logged[i["key"]] = max(i["step"], logged.get(i["key"], -1))
        for start in range(0, max(len(metrics), len(tags)), MAX_BATCH):
            batch, batch_tags = metrics[start:start + MAX_BATCH], tags[start:start + MAX_BATCH]
            try:
                client.log_batch(run_id, metrics=batch, tags=batch_tags, synchronous=True)
            except Exception as e:  # a tracking hiccup must not end the sink: later batches may pass
                print(f"MLflow log_batch failed, {len(batch)} metrics and {len(batch_tags)} tags dropped: {e}", file=sys.stderr, flush=True)
        if done:
            return


def last_logged_steps(client, run_id: str) -> dict[str, int]:
    """Per metric, the highest step the run holds (MLflow keeps each metric's latest by step)."""
    try:
        return {m.key: int(m.step) for m in client.get_run(run_id).data.to_proto().metrics}
    except Exception as e:  # an unreachable store: the batches will say so; nothing to skip
        print(f"could not read the run's logged steps ({e.__class__.__name__}); replayed steps may be logged twice", file=sys.stderr, flush=True)
        return {}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Send a trainer's metrics (JSON lines on stdin) to an MLflow run.")
    parser.add_argument("--uri", required=True)
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--flush-s", type=float, default=2.0)
    args = parser.parse_args(argv)
    _lower_priority()
    sink(args.uri, args.run_id, args.flush_s)


if __name__ == "__main__":
    main()
