"""Rank-0 metrics reach a real MLflow store through the sink process or the campaign's hub, even when the trainer dies."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

from training.metrics import MetricsLogger

REPO = Path(__file__).resolve().parent.parent


def new_run(tmp_path: Path) -> tuple[str, MlflowClient, str]:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    run_id = client.create_run(client.create_experiment("metrics")).info.run_id
    return uri, client, run_id


def test_metrics_and_tags_arrive_in_order_of_steps(tmp_path):
    uri, client, run_id = new_run(tmp_path)
    logger = MetricsLogger(uri, run_id, flush_s=0.2)
    for step in range(1, 31):
        logger.log(step, train_loss=1.0 / step, lr=0.1)
    logger.tag("resize.1", '{"from": 2, "to": 1}')
    logger.close()
    history = client.get_metric_history(run_id, "train_loss")
    assert [m.step for m in sorted(history, key=lambda m: m.step)] == list(range(1, 31))
    assert {m.step: m.value for m in history}[4] == 0.25
    assert client.get_run(run_id).data.tags["resize.1"] == '{"from": 2, "to": 1}'
    assert not logger.enabled


def test_a_trainer_that_dies_without_closing_still_has_its_metrics_sent(tmp_path):
    uri, client, run_id = new_run(tmp_path)
    # A process that logs and then dies at once (no close, no flush): the pipe closing is
    # the sink's signal to send what it holds.
    script = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(REPO)!r})
        from training.metrics import MetricsLogger
        logger = MetricsLogger({uri!r}, {run_id!r}, flush_s=30)
        for step in range(5):
            logger.log(step, train_loss=float(step))
        print(logger._sink.proc.pid, flush=True)
        os._exit(9)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 9, done.stderr
    sink_pid = int(done.stdout.strip())
    # The sink outlives its parent only to send the rest: wait for it to exit.
    for _ in range(600):
        if not Path(f"/proc/{sink_pid}").exists() or "Z" in Path(f"/proc/{sink_pid}/stat").read_text().split()[2]:
            break
        time.sleep(0.1)
    assert sorted(m.step for m in client.get_metric_history(run_id, "train_loss")) == [0, 1, 2, 3, 4]


def test_a_sink_that_cannot_log_does_not_stop_training(tmp_path):
    uri, _, _ = new_run(tmp_path)
    logger = MetricsLogger(uri, "no-such-run", flush_s=0.1)
    for step in range(3):
        logger.log(step, train_loss=1.0)  # the trainer's side never raises
    logger.close()


def test_a_shared_sink_serves_trials_one_after_another(tmp_path, monkeypatch):
    """A warm worker's trials share one sink: a trial's close() does not wait for MLflow (the
    device goes to the next trial), each trial's metrics reach its own run through the same
    process, and the worker's end (close_shared_sink) waits until all of them are there."""
    from training import metrics

    monkeypatch.setattr(metrics, "_share", True)
    monkeypatch.setattr(metrics, "_shared", None)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("shared")
    pids, runs = [], []
    for trial in range(2):
        run_id = client.create_run(exp).info.run_id
        logger = MetricsLogger(uri, run_id, flush_s=30)  # nothing is sent before the worker's end
        pids.append(logger._sink.proc.pid)
        for step in range(1, 4):
            logger.log(step, loss=float(trial * 10 + step))
        logger.close()
        runs.append(run_id)
    assert pids[0] == pids[1]  # one sink process for both
    assert metrics._shared.alive  # a trial's end leaves the shared sink sending
    metrics.close_shared_sink(30)
    for trial, run_id in enumerate(runs):
        assert [m.value for m in client.get_metric_history(run_id, "loss")] == [trial * 10 + 1.0, trial * 10 + 2.0, trial * 10 + 3.0]
    assert metrics._shared is None


def test_a_campaigns_hub_takes_its_trainers_metrics_without_a_sink_process_each(tmp_path, monkeypatch):
    """Trainers launched by a campaign on its machine log through the campaign's hub: no
    sink process of their own; a trainer that dies without closing keeps what it sent whole;
    a resumed trainer's replayed steps are logged once; the hub's close sends everything."""
    from training.metrics import METRICS_SOCKET_ENV, _HubConnection
    from tasks.tracking_hub import MetricsHub

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("hub")
    killed, resumed = client.create_run(exp).info.run_id, client.create_run(exp).info.run_id
    hub = MetricsHub(flush_s=30)  # nothing is sent before the close: the close must send it all
    monkeypatch.setenv(METRICS_SOCKET_ENV, hub.env()[METRICS_SOCKET_ENV])
    script = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(REPO)!r})
        from training.metrics import MetricsLogger
        logger = MetricsLogger({uri!r}, {killed!r}, flush_s=30)
        for step in range(5):
            logger.log(step, train_loss=float(step))
        print(type(logger._sink).__name__, flush=True)
        os._exit(9)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 9 and done.stdout.strip() == "_HubConnection", done.stdout + done.stderr
    first = MetricsLogger(uri, resumed, flush_s=30)
    assert isinstance(first._sink, _HubConnection)
    for step in range(1, 6):
        first.log(step, loss=float(step))
    first.close()
    again = MetricsLogger(uri, resumed, flush_s=30)  # resumed from step 3: steps 4 and 5 come again
    for step in range(4, 9):
        again.log(step, loss=float(step) + 0.5)
    again.close()
    hub.close(timeout=30)
    assert sorted(m.step for m in client.get_metric_history(killed, "train_loss")) == [0, 1, 2, 3, 4]
    history = {m.step: m.value for m in client.get_metric_history(resumed, "loss")}
    assert history == {1: 1.0, 2: 2.0, 3: 3.0, 4: 4.0, 5: 5.0, 6: 6.5, 7: 7.5, 8: 8.5}
    assert not Path(hub.path).exists()


def test_a_resumed_trainers_lines_wait_while_its_killed_predecessors_connection_is_still_read(tmp_path):
    """The race a full run once hit: the successor's lines read before the rest of its
    predecessor's would win the dedup of replayed steps. Lines of a run wait while an
    earlier connection to that run is open; other runs' lines go at once."""
    import json
    import socket

    from tests.conftest import wait_for
    from training.metrics import _HubConnection
    from training.metrics_hub import Hub

    path = str(tmp_path / "sink")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(8)
    hub = Hub(server, path, flush_s=3600)  # nothing sends by itself: the test takes batches with _ready()
    route, other_route = {"uri": "u", "run": "resumed"}, {"uri": "u", "run": "other"}

    def line(route, step):
        return json.dumps({**route, "key": "loss", "value": float(step), "timestamp": 0, "step": step}) + "\n"

    killed = _HubConnection(path, route)
    killed.send("".join(line(route, step) for step in (1, 2, 3)))
    successor = _HubConnection(path, route)
    successor.send("".join(line(route, step) for step in (2, 3, 4, 5)))
    other = _HubConnection(path, other_route)
    other.send(line(other_route, 1))
    wait_for(lambda: len(hub.buffer) == 8, 30, "the hub to read every line")
    first = hub._ready()
    assert [(i["run"], i["step"]) for i in first] == [("resumed", 1), ("resumed", 2), ("resumed", 3), ("other", 1)]
    assert hub._ready() == []  # the successor's still wait: its predecessor's connection is open
    killed.close(0)
    wait_for(lambda: 0 not in hub.open_runs, 30, "the killed connection to be read to its end")
    assert [i["step"] for i in hub._ready()] == [2, 3, 4, 5]
    successor.close(0)
    other.close(0)
    hub.close()
    server.close()


def test_a_campaign_killed_outright_leaves_its_hub_to_send_what_its_trainers_logged(tmp_path, monkeypatch):
    """The hub outlives its campaign: SIGKILL to the campaign closes the hub's stdin, and
    the hub sends what a trainer logged once that trainer's connection ends."""
    import signal

    from training.metrics import METRICS_SOCKET_ENV

    uri, client, run_id = new_run(tmp_path)
    campaign = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(REPO)!r})
        from tasks.tracking_hub import MetricsHub
        hub = MetricsHub(flush_s=30)
        print(hub.path, hub.proc.pid, flush=True)
        time.sleep(600)
    """)], stdout=subprocess.PIPE, text=True)
    path, hub_pid = campaign.stdout.readline().split()
    monkeypatch.setenv(METRICS_SOCKET_ENV, path)
    logger = MetricsLogger(uri, run_id, flush_s=30)
    for step in range(1, 4):
        logger.log(step, loss=float(step))
    campaign.send_signal(signal.SIGKILL)
    campaign.wait()
    logger.close()  # the trainer ends after its campaign (the warden's kill, here a close)
    for _ in range(600):  # the hub exits once it has sent everything
        if not Path(f"/proc/{hub_pid}").exists() or "Z" in Path(f"/proc/{hub_pid}/stat").read_text().split()[2]:
            break
        time.sleep(0.1)
    assert sorted(m.step for m in client.get_metric_history(run_id, "loss")) == [1, 2, 3]
    assert not Path(path).parent.exists()  # the socket's folder went with the hub, not left in /tmp


def test_a_hub_that_is_gone_leaves_the_trainer_its_own_sink(tmp_path, monkeypatch):
    from training.metrics import METRICS_SOCKET_ENV, _Sink

    uri, client, run_id = new_run(tmp_path)
    monkeypatch.setenv(METRICS_SOCKET_ENV, str(tmp_path / "no-hub"))
    with pytest.warns(UserWarning, match="metrics hub .* is unreachable"):
        logger = MetricsLogger(uri, run_id, flush_s=0.2)
    assert isinstance(logger._sink, _Sink)
    logger.log(1, loss=1.0)
    logger.close()
    assert [m.step for m in client.get_metric_history(run_id, "loss")] == [1]


# --- system metrics: each trial's own devices, under its MLflow run ---------------------------

def test_system_metrics_sample_exactly_each_trials_own_devices(tmp_path):
    import mlflow

    from cluster.types import Device
    from tests.fakes.fake_nvml import FakeGpu, FakeNvml, gpu_uuid
    from tasks.system_metrics import SystemSampler

    GiB = 1 << 30
    nvml = FakeNvml([FakeGpu(gpu_uuid(0, i), used_bytes=(10 + 10 * i) * GiB, utilization_pct=30 + 30 * i, power_mw=(100 + 100 * i) * 1000)
                     for i in range(3)])
    gpu = lambda i: Device(gpu_uuid(0, i), "n", i, "gpu", "H100", 80 * GiB)
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    exp = client.create_experiment("s")
    a, b, c = (client.create_run(exp).info.run_id for _ in range(3))
    sampler = SystemSampler(client.tracking_uri, period_s=3600, nvml=nvml, cpu_percent=lambda: [10.0, 70.0, 40.0])
    try:
        sampler.watch(a, [gpu(2)])  # one GPU: logged as its gpu_0
        sampler.watch(b, [gpu(1), gpu(0)])  # two, in rank order
        sampler.watch(c, [Device("n/cpu1", "n", 1, "cpu", "CPU core 1", GiB), Device("n/cpu2", "n", 2, "cpu", "CPU core 2", GiB)])
        sampler.log(sampler.sample(), now=1000.0)
        assert sampler.forget(a) is None  # sampled already: nothing more at its end
        sampler.log(sampler.sample(), now=1010.0)
    finally:
        sampler.close()
    assert nvml.active_sessions == 0  # the sampler's NVML session is closed with it
    metrics = lambda run: client.get_run(run).data.metrics
    assert metrics(a) == {"system/gpu_0_utilization_percentage": 90.0, "system/gpu_0_memory_usage_megabytes": 30 * 1024.0,
                          "system/gpu_0_memory_usage_percentage": 37.5, "system/gpu_0_power_usage_watts": 300.0}
    assert metrics(b)["system/gpu_0_utilization_percentage"] == 60.0 and metrics(b)["system/gpu_1_utilization_percentage"] == 30.0
    assert metrics(c) == {"system/cpu_0_utilization_percentage": 70.0, "system/cpu_1_utilization_percentage": 40.0,
                          "system/cpu_utilization_percentage": 55.0}
    # A trial that ends before the first period still gets one sample, when it is forgotten,
    # written with its run's closing tags.
    from tasks.system_metrics import DEVICES_TAG
    from tasks.tracking import close_trial_run

    short = client.create_run(exp).info.run_id
    quick = SystemSampler(client.tracking_uri, period_s=3600, nvml=nvml, cpu_percent=lambda: [10.0, 70.0, 40.0])
    try:
        quick.watch(short, [gpu(0)])
        last = quick.forget(short)
    finally:
        quick.close()
    assert "system/gpu_0_utilization_percentage" not in metrics(short)  # not logged by itself
    close_trial_run(client.tracking_uri, short, {"checkpoint": "c", "metrics": {"val_loss": 0.5}, "steps": 2}, [gpu(0).id], reading=last)
    assert metrics(short)["system/gpu_0_utilization_percentage"] == 30.0
    closed = client.get_run(short)
    assert closed.data.tags[DEVICES_TAG] == f"gpu_0={gpu_uuid(0, 0)}" and closed.data.tags["final.val_loss"] == "0.5"
    assert closed.info.status == "FINISHED"
    # Forgotten after the first sample (its trial ended); the others sampled twice, steps 0 and 1.
    assert [m.step for m in client.get_metric_history(a, "system/gpu_0_utilization_percentage")] == [0]
    assert sorted(m.step for m in client.get_metric_history(b, "system/gpu_1_power_usage_watts")) == [0, 1]


def test_system_metrics_come_three_times_in_a_trials_first_ten_seconds_and_name_its_devices(tmp_path):
    import mlflow

    from cluster.types import Device
    from tasks.system_metrics import DEVICES_TAG, SystemSampler

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    run = client.create_run(client.create_experiment("r")).info.run_id
    now = [100.0]
    sampler = SystemSampler(client.tracking_uri, period_s=10.0, cpu_percent=lambda: [5.0, 50.0], clock=lambda: now[0])
    sampler._stop.set()  # this test drives the sampling itself, on its clock
    try:
        sampler.watch(run, [Device("vm/cpu1", "vm", 1, "cpu", "CPU core 1", 1 << 30)], "t")
        sampled_at = []
        for tick in range(0, 41):  # 20 s of a trial, every half second
            now[0] = 100.0 + tick / 2
            if due := sampler.due_runs():
                sampler.log(sampler.sample(only=due), time.time())
                sampled_at.append(now[0] - 100.0)
    finally:
        sampler.close()
    assert sampled_at == [1.0, 3.0, 7.0, 17.0]  # three within 10 s, then every period
    assert client.get_run(run).data.tags[DEVICES_TAG] == "cpu_0=vm/cpu1"  # metric cpu_0 is the trial's vm/cpu1
    history = client.get_metric_history(run, "system/cpu_0_utilization_percentage")
    assert [m.step for m in sorted(history, key=lambda m: m.step)] == [0, 1, 2, 3] and history[0].value == 50.0


def test_system_metrics_count_the_memory_of_a_trials_whole_process_tree(tmp_path):
    import mlflow

    from tasks.system_metrics import SystemSampler

    # A launcher whose child holds 64 MiB: the trial's processes, as torchrun and its worker.
    launcher = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import subprocess, sys
        child = subprocess.Popen([sys.executable, "-c", "import time; x = bytearray(64 << 20); x[::4096] = b'1' * len(x[::4096]); time.sleep(60)"])
        child.wait()
    """)])
    try:
        client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
        run = client.create_run(client.create_experiment("m")).info.run_id
        sampler = SystemSampler(client.tracking_uri, period_s=3600, cpu_percent=lambda: [0.0],
                                processes_of=lambda trial: [launcher.pid] if trial == "t" else [])
        try:
            sampler.watch(run, [], "t")
            deadline = time.time() + 30
            while (rss := sampler.sample()[run].get("system/trial_memory_rss_megabytes", 0.0)) < 64 and time.time() < deadline:
                time.sleep(0.2)
            assert 64 <= rss < 1024  # the child's 64 MiB, counted through its launcher
            sampler.log(sampler.sample(), now=time.time())
        finally:
            sampler.close()
        assert client.get_run(run).data.metrics["system/trial_memory_rss_megabytes"] >= 64
    finally:
        launcher.kill()
        launcher.wait()
