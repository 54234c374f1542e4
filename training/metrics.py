"""Rank-0 metric logging to MLflow, in a process of its own that training never waits on.

One `log_metric` on SQLite costs ~25 ms, longer than a training step here; a batched
`log_batch` still costs tens of milliseconds of Python, and importing MLflow costs seconds.
In a thread of the trainer all of that would hold the GIL against the training loop
(py-spy put the flushes alone at ~2% of the trainer's wall time). So the trainer writes one JSON line
per call into a pipe, and a sink process (`python -m training.metrics`), started at the
lowest CPU priority and free to run on any core, imports MLflow and sends what arrived
with one `log_batch` every `flush_s`. When the trainer closes the pipe (or dies: the pipe
closes with it) the sink sends the rest and exits.

A warm worker (training/worker.py) runs trial after trial: its trials share one sink
(`share_sink`), each line naming its run, so MLflow is imported once per worker. A trial's
end does not wait for its metrics to reach MLflow: the sink sends them in order while the
next trial starts on the device (waiting there left a device idle for as long as a young
sink took to import MLflow, seconds for a short trial). The worker's exit waits for them
all (`close_shared_sink`), and a campaign ends its workers before it reads MLflow for its
summary and pictures; a worker that is killed leaves its sink to send the rest by itself.

A trainer launched by a campaign on this machine finds `CAMPAIGN_METRICS_SOCKET` in its
environment and sends the same lines to the campaign's hub (training/metrics_hub.py)
instead: no sink process, no MLflow import in the trial at all.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

from training.metrics_journal import MetricsJournal, read_journal


def format_metrics(metrics: dict[str, float]) -> str:
    """{'val_accuracy': 0.97222, 'train_loss': 0.0812} -> 'val_accuracy 0.9722, train_loss 0.0812'
    (the learning rate and timings left out: they are in MLflow)."""
    return ", ".join(f"{k} {format_figure(v)}" for k, v in metrics.items()
                     if isinstance(v, (int, float)) and k != "lr" and not k.endswith("_s"))


def format_figure(value: float) -> str:
    """Four decimals where they say something (0.9722), significant digits where they would
    not (1.234e+05, 2.5e-06: a grad_noise_scale of 0.0000 hides the figure)."""
    if value == 0 or 1e-3 <= abs(value) < 1e4:
        return f"{value:.4f}"
    return f"{value:.4g}"


def result_line(trial_id: str, result: dict[str, Any]) -> str:
    """A trial's last line in its log: 'trial t: finished 300 steps: val_accuracy 0.9833, ...'."""
    ended = f"pruned at step {result['steps']}" if result.get("pruned") else f"finished {result['steps']} steps"
    return f"trial {trial_id}: {ended}: {format_metrics(result['metrics'])}"

def progress_line(trial_id: str, step: int, steps: int, metrics: dict[str, Any]) -> str:
    """A trial's line at each log step, so its log follows training ('campaign logs -f'):
    'trial t: step 120/300: train_loss 0.41, ...'."""
    return f"trial {trial_id}: step {step}/{steps}: {format_metrics(metrics)}"


MAX_BATCH = 1000  # MLflow's limit of metrics per log_batch call
METRICS_SOCKET_ENV = "CAMPAIGN_METRICS_SOCKET"  # a campaign's hub on this machine (training/metrics_hub.py)


class _Sink:
    """A sink process and the pipe to it: metric lines in; closing the pipe ends it once it has sent them."""

    def __init__(self, args: list[str]):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "training.metrics", *args], stdin=subprocess.PIPE,
            text=True, env={**os.environ, "PYTHONPATH": _package_root()},
        )

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def send(self, lines: str) -> None:
        self.proc.stdin.write(lines)
        self.proc.stdin.flush()

    def close(self, timeout: float) -> None:
        """Close the pipe and wait for the sink to send what it holds; warn if it could not in time."""
        try:
            self.proc.stdin.close()
        except (OSError, ValueError):
            pass
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            warnings.warn(f"MLflow metrics sink did not finish in {timeout:.0f} s; the last metrics may be missing")


class _HubConnection:
    """The campaign's hub (training/metrics_hub.py), in place of a sink process: the same
    lines over a Unix socket. Closing it only closes the connection: the hub sends the rest,
    and the campaign waits for that before it reads MLflow. The first line names the run the
    connection logs to: the hub reads it as it accepts, in the order trainers connected, so a
    resumed trainer's lines wait until its killed predecessor's connection is read to its end."""

    def __init__(self, path: str, route: dict):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.sock.connect(path)
            self.sock.sendall((json.dumps({**route, "opens": True}) + "\n").encode())
        except OSError:
            self.sock.close()
            raise
        self.closed = False

    @property
    def alive(self) -> bool:
        return not self.closed

    def send(self, lines: str) -> None:
        self.sock.sendall(lines.encode())

    def close(self, timeout: float) -> None:
        self.closed = True
        self.sock.close()


def _hub(route: dict) -> _HubConnection | None:
    """A connection to the campaign's hub when a campaign on this machine launched us."""
    path = os.environ.get(METRICS_SOCKET_ENV)
    if not path:
        return None
    try:
        return _HubConnection(path, route)
    except OSError as e:  # the campaign is gone or the path is stale: a sink of our own
        warnings.warn(f"the campaign's metrics hub at {path} is unreachable ({e.__class__.__name__}); starting a sink process")
        return None


_shared: _Sink | None = None  # a warm worker's one sink for all its trials (share_sink)
_share = False


def share_sink() -> None:
    """Trials run one after another in this process (a warm worker): they share one sink
    process, so MLflow is imported once, not at every trial's start and end."""
    global _share
    _share = True


class MetricsLogger:
    """Rank 0's metrics: journaled in the trial's folder (`journal`: training.metrics_journal,
    the source of truth), then sent to MLflow through the campaign's hub or a sink process."""

    def __init__(self, tracking_uri: str | None, run_id: str | None, flush_s: float = 2.0, journal: Path | str | None = None):
        global _shared
        self.enabled = bool(tracking_uri and run_id)
        self.journal = MetricsJournal(journal) if journal is not None and self.enabled else None
        self._route = {"run": run_id, "uri": tracking_uri}
        self._sink: _Sink | _HubConnection | None = None
        self._owned = not _share
        if self.enabled and (hub := _hub(self._route)) is not None:
            self._sink, self._owned = hub, True
        elif self.enabled and _share:
            if _shared is None or not _shared.alive:
                _shared = _Sink(["--flush-s", str(flush_s)])
            self._sink = _shared
        elif self.enabled:
            self._sink = _Sink(["--flush-s", str(flush_s)])

    def log(self, step: int, **metrics: float) -> None:
        stamp = int(time.time() * 1000)
        if self.journal is not None:  # first, and whether or not the sender lives: what MLflow is fed from later
            metrics = self.journal.admit(step, metrics, stamp)
        if self.enabled and metrics:
            self._send("".join(json.dumps({**self._route, "key": k, "value": float(v), "timestamp": stamp, "step": step}) + "\n"
                               for k, v in metrics.items()))

    def sync_journal(self) -> None:
        """The journal durable on disk (before a checkpoint: no step it covers can be lost)."""
        if self.journal is not None:
            self.journal.sync()

    def tag(self, key: str, value: str) -> None:
        """A run tag (an event worth reading as text), sent with the next batch."""
        if self.enabled:
            self._send(json.dumps({**self._route, "key": key, "tag": value}) + "\n")

    def _send(self, lines: str) -> None:
        try:
            self._sink.send(lines)
        except (BrokenPipeError, ValueError, OSError) as e:  # the sink is gone: training goes on
            warnings.warn(f"MLflow metrics sink exited ({e.__class__.__name__}); later metrics are not logged")
            self.enabled = False

    def close(self, timeout: float = 60.0) -> None:
        """Let the sink send what it holds, and wait for it; a shared sink goes on sending
        while the worker's next trial trains (close_shared_sink waits for it)."""
        if self.journal is not None:
            self.journal.close()
            self.journal = None
        if self._sink is None:
            return
        sink, self._sink, self.enabled = self._sink, None, False
        if self._owned:
            sink.close(timeout)


def feed_journal(journal: Path | str, tracking_uri: str, run_id: str) -> int:
    """Send a trial's whole journal to its MLflow run through the campaign's hub, which logs
    only the (key, step) pairs the run does not hold yet: what a kill lost in flight arrives
    now, nothing twice. The number of metric values read; 0 without a hub (a pool's trial:
    its node's sink sends what it has) or a journal."""
    lines = [json.dumps({"run": run_id, "uri": tracking_uri, "key": key, "value": value, "timestamp": stamp, "step": step}) + "\n"
             for key, step, value, stamp in read_journal(journal)]
    if not lines or (hub := _hub({"run": run_id, "uri": tracking_uri})) is None:
        return 0
    try:
        for start in range(0, len(lines), MAX_BATCH):
            hub.send("".join(lines[start:start + MAX_BATCH]))
    finally:
        hub.close(0)
    return len(lines)


def close_shared_sink(timeout: float = 60.0) -> None:
    """A warm worker's end: wait until its shared sink has sent every trial's metrics."""
    global _shared
    sink, _shared = _shared, None
    if sink is not None:
        sink.close(timeout)


def _package_root() -> str:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)


# --- the sink process --------------------------------------------------------------------
def _ignore_signals() -> None:
    """A signal to the trainer's process group is not for the sink: it stops when the pipe
    closes, after sending what it holds."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _lower_priority(thread_id: int = 0) -> None:
    """Yield to training: lowest CPU priority, and any core rather than the trainer's own
    (the pinning was inherited)."""
    try:  # SCHED_IDLE: runs only on an otherwise idle core (nice 19 slowed training more here)
        os.sched_setscheduler(thread_id, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        if thread_id == 0:
            os.nice(19)
    try:
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
    except OSError:  # a cpuset narrower than cpu_count: keep the inherited set
        pass


def _off_trainer_cores() -> None:
    """Leave the core(s) the trainer is pinned to (inherited) for the others, where there are
    others: importing MLflow and opening its store take seconds of CPU at normal priority,
    which on the trainer's own core came out of its first steps."""
    try:
        pinned = os.sched_getaffinity(0)
        others = set(range(os.cpu_count() or 1)) - pinned
        if others:
            os.sched_setaffinity(0, others)
    except (AttributeError, OSError):  # not Linux, or a cpuset without the other cores: stay
        pass


def _normal_priority(thread_id: int) -> None:
    try:
        os.sched_setscheduler(thread_id, os.SCHED_OTHER, os.sched_param(0))
    except (AttributeError, OSError):
        pass


def _read_lines(buffer: list[dict], lock: threading.Lock, wake: threading.Event, closed: threading.Event) -> None:
    seen: set[tuple[str, str]] = set()
    for line in sys.stdin:
        item = json.loads(line)
        with lock:
            buffer.append(item)
        # Send now, at normal priority, for a run not seen before: its tracking store is
        # opened then (a second or two), while the trial trains, not at its end.
        if "run" in item and (item["uri"], item["run"]) not in seen:
            seen.add((item["uri"], item["run"]))
            _normal_priority(threading.main_thread().native_id)
            wake.set()
    # The trainer is done: send the rest at normal priority, or a busy host would keep an
    # idle-only sink (and the trainer waiting on it) for as long as other trials train.
    _normal_priority(threading.main_thread().native_id)
    closed.set()
    wake.set()


class _Runs:
    """What the sink knows of each run it logs to: its client, and the steps it holds per metric."""

    def __init__(self):
        from mlflow import MlflowClient

        self._client_type = MlflowClient
        self.clients: dict[str, Any] = {}
        self.logged: dict[tuple[str, str], dict[str, set[int]]] = {}

    def client(self, uri: str):
        if uri not in self.clients:
            self.clients[uri] = self._client_type(tracking_uri=uri)
        return self.clients[uri]

    def steps(self, uri: str, run: str) -> dict[str, set[int]]:
        if (uri, run) not in self.logged:
            self.logged[(uri, run)] = logged_steps(self.client(uri), run)
        return self.logged[(uri, run)]

    def send(self, items: list[dict]) -> None:
        from mlflow.entities import Metric, RunTag

        for uri, run in dict.fromkeys((i["uri"], i["run"]) for i in items):
            mine = [i for i in items if (i["uri"], i["run"]) == (uri, run)]
            logged = self.steps(uri, run)
            tags = [RunTag(i["key"], i["tag"]) for i in mine if "tag" in i]
            # Each (key, step) once: a step the run holds already (a journal fed again after a
            # kill, a resumed trial's replay), or that came earlier in this batch, is not logged twice.
            fresh = []
            for i in mine:
                if "tag" not in i and i["step"] not in logged.setdefault(i["key"], set()):
                    fresh.append(i)
                    logged[i["key"]].add(i["step"])
            metrics = [Metric(i["key"], i["value"], i["timestamp"], i["step"]) for i in fresh]
            for start in range(0, max(len(metrics), len(tags)), MAX_BATCH):
                batch, batch_tags = metrics[start:start + MAX_BATCH], tags[start:start + MAX_BATCH]
                try:
                    self.client(uri).log_batch(run, metrics=batch, tags=batch_tags, synchronous=True)
                except Exception as e:  # a tracking hiccup must not end the sink: later batches may pass
                    for metric in batch:  # not held after all: the journal fed again sends them again
                        logged[metric.key].discard(metric.step)
                    print(f"MLflow log_batch failed, {len(batch)} metrics and {len(batch_tags)} tags dropped: {e}", file=sys.stderr, flush=True)


def sink(flush_s: float, runs: "_Runs | None" = None) -> None:
    """Send what arrives every flush_s, and the rest once the pipe closes."""
    buffer: list[dict] = []
    lock, wake, closed = threading.Lock(), threading.Event(), threading.Event()
    threading.Thread(target=_read_lines, args=(buffer, lock, wake, closed), daemon=True).start()
    runs = runs or _Runs()
    while True:
        wake.wait(flush_s)
        wake.clear()
        done = closed.is_set()
        with lock:
            items, buffer[:] = list(buffer), []
        runs.send(items)
        if done:
            return
        if not closed.is_set():
            _lower_priority()  # sent: back to idle-only until a new run or the end


def logged_steps(client, run_id: str) -> dict[str, set[int]]:
    """Per metric, every step the run holds (one history read per metric it has: none for a new run)."""
    try:
        keys = [m.key for m in client.get_run(run_id).data.to_proto().metrics]
        return {key: {int(m.step) for m in client.get_metric_history(run_id, key)} for key in keys}
    except Exception as e:  # an unreachable store: the batches will say so; nothing to skip
        print(f"could not read the run's logged steps ({e.__class__.__name__}); replayed steps may be logged twice", file=sys.stderr, flush=True)
        return {}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Send trainers' metrics (JSON lines on stdin, each naming its run) to MLflow.")
    parser.add_argument("--flush-s", type=float, default=2.0)
    args = parser.parse_args(argv)
    _ignore_signals()
    _off_trainer_cores()
    # MLflow is imported now, at normal priority, while the trial starts: imported at idle
    # priority on a busy host it was still importing when the trial ended, and whoever waits
    # for its last metrics (a torchrun trial's end, a warm worker's exit) waited seconds for it.
    runs = _Runs()
    _lower_priority()
    sink(args.flush_s, runs)


if __name__ == "__main__":
    main()
