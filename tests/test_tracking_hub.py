"""The campaign's MLflow calls and pictures run in its hub process, not in `campaign launch`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from mlflow import MlflowClient

REPO = Path(__file__).resolve().parent.parent


def run_script(code: str, cwd: Path) -> dict:
    """`code` in a fresh interpreter (this one has MLflow imported); its last line, JSON."""
    done = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(REPO)!r})\n" + textwrap.dedent(code)],
                          cwd=cwd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_tracking_call_runs_in_the_hub_answers_as_it_would_here_and_runs_here_once_the_hub_is_gone(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    out = run_script(f"""
        import json, sys
        from tasks.hub_calls import HubCallError, use_hub
        from tasks.tracking import mark_killed, open_campaign_run, run_experiment
        from tasks.tracking_hub import MetricsHub

        hub = MetricsHub(store={uri!r})
        use_hub(hub)
        run_id = open_campaign_run({uri!r}, "hubbed", "c", {{"training.lr": [0.1, 0.2]}}, 2)
        experiment = run_experiment({uri!r}, run_id)
        try:
            mark_killed({uri!r}, ["no-such-run"])
            error = None
        except HubCallError as e:
            error = str(e)
        imported_while_hubbed = "mlflow" in sys.modules
        hub.proc.kill()  # the hub dies: the calls run here
        hub.proc.wait()
        again = open_campaign_run({uri!r}, "hubbed", "c", {{"training.lr": [0.1, 0.2]}}, 2)
        print(json.dumps({{"run": run_id, "experiment": experiment, "error": error, "imported_while_hubbed": imported_while_hubbed,
                          "again": again, "imported_after": "mlflow" in sys.modules}}))
    """, tmp_path)
    assert not out["imported_while_hubbed"]  # every MLflow call ran in the hub
    run = MlflowClient(tracking_uri=uri).get_run(out["run"])
    assert run.info.experiment_id == out["experiment"] and run.data.params["grid.training.lr"] == "[0.1, 0.2]"
    assert run.data.tags["campaign.kind"] == "campaign"
    # The hub's exception comes back naming the call, with MLflow's own message.
    assert out["error"].startswith("tasks.tracking.mark_killed failed in the campaign's hub: MlflowException") and "no-such-run" in out["error"]
    assert out["again"] == out["run"] and out["imported_after"]  # found again, by this process itself


def test_an_answer_left_unread_by_an_interrupted_call_is_not_taken_for_the_next_calls(tmp_path):
    import json

    from tasks.tracking_hub import MetricsHub

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    hub = MetricsHub(store=uri)
    try:
        opened = hub.call("tasks.tracking.open_campaign_run", [uri, "e", "c", {}, 1], {})
        # A call whose thread was interrupted after its request went: its answer stays in the pipe.
        hub._next += 1
        hub.proc.stdin.write(json.dumps({"id": hub._next, "name": "tasks.tracking.open_campaign_run",
                                         "args": [uri, "e", "other", {}, 1], "kwargs": {}}) + "\n")
        hub.proc.stdin.flush()
        experiment = hub.call("tasks.tracking.run_experiment", [uri, opened], {})
    finally:
        hub.close()
    assert experiment == MlflowClient(tracking_uri=uri).get_run(opened).info.experiment_id


def test_a_hub_opened_without_a_store_builds_it_when_told_and_the_next_answer_is_the_next_calls(tmp_path):
    """A launch opens its hub while it checks the spec (MLflow imported there meanwhile), and
    tells it the store once the checks have passed: that order returns at once, its answer is
    skipped, and each later call gets its own."""
    from tasks.tracking_hub import MetricsHub

    store = tmp_path / "mlflow.db"
    uri = f"sqlite:///{store}"
    hub = MetricsHub()
    try:
        hub.call_unanswered("tasks.tracking.build_store", [uri])
        opened = hub.call("tasks.tracking.open_campaign_run", [uri, "e", "c", {}, 1], {})
        experiment = hub.call("tasks.tracking.run_experiment", [uri, opened], {})
    finally:
        hub.close()
    assert store.exists() and experiment == MlflowClient(tracking_uri=uri).get_run(opened).info.experiment_id


def test_a_drain_kept_waiting_by_a_trainer_that_never_ends_ends_the_hub_and_says_so():
    import socket

    from tasks.tracking_hub import MetricsHub

    hub = MetricsHub()
    trainer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    trainer.connect(hub.path)  # connected, and never closed while the campaign waits
    try:
        with pytest.warns(UserWarning, match="did not answer drain in 1 s"):
            hub.drain(timeout=1)
        assert hub.gone and hub.proc.wait(timeout=30) == -9  # ended, not left behind
    finally:
        trainer.close()
        hub.close()
    assert not Path(hub.path).parent.exists()


@pytest.mark.slow
def test_campaign_launch_imports_neither_mlflow_nor_matplotlib_and_its_runs_pictures_and_system_metrics_are_all_there(tmp_path, digits_npz):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({
        "campaign": {"name": "hubbed"}, "data": {"path": str(digits_npz)}, "model": {"name": "mlp", "width": 8},
        "training": {"steps": 6, "batch_size": 16, "lr": 0.05, "eval_every": 3, "checkpoint_every": 3, "log_every": 1},
        "grid": {"training.lr": [0.05, 0.1]}, "resources": {"devices": 1}, "cluster": {"cpu_slots": 2},
        "tracking": {"mlflow_uri": uri, "experiment": "hubbed", "runs_dir": str(tmp_path / "runs"), "summary": str(tmp_path / "s.json"),
                     "system_metrics_every_s": 1},
    }))
    launch = """
        import atexit, json, runpy, sys
        def said():
            print(json.dumps({"mlflow": "mlflow" in sys.modules, "matplotlib": "matplotlib" in sys.modules}), flush=True)
        atexit.register(said)
        sys.argv = ["campaign", "launch", "params.yaml", "--no-live"]
        runpy.run_module("flows.cli", run_name="__main__")
    """
    env = {**os.environ, "CAMPAIGN_LEASE_DB": str(tmp_path / "leases.db")}
    done = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(REPO)!r})\n" + textwrap.dedent(launch)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"mlflow": False, "matplotlib": False}

    for run in two_trials_whole(uri, "hubbed"):  # the sampler's metrics and the closing tags
        assert any(k.startswith("system/") for k in run.data.metrics) and run.data.tags["system.devices"]
        assert run.data.tags["final.step"] == "6" and run.data.tags["world_size"] == "1"
    assert (tmp_path / "runs" / "hubbed" / "curves.png").stat().st_size > 0
    assert (tmp_path / "runs" / "hubbed" / "timeline.png").stat().st_size > 0


def two_trials_whole(uri: str, experiment: str) -> list:
    """The campaign's MLflow runs of a two-trial, 6-step campaign, all there: its parent
    finished with its pictures and summary, each trial finished with every step's train_loss
    (the trainers' metrics, through the hub's socket). Returns the trials' runs."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    parent = next(r for r in runs if r.data.tags.get("campaign.kind") == "campaign")
    trials = [r for r in runs if r.data.tags.get("campaign.kind") == "trial"]
    assert parent.info.status == "FINISHED" and parent.data.tags["summary.finished"] == "2"
    assert {a.path for a in client.list_artifacts(parent.info.run_id)} == {"curves", "summary.json", "timeline"}
    assert len(trials) == 2 and all(r.info.status == "FINISHED" for r in trials)
    for run in trials:
        assert [m.step for m in client.get_metric_history(run.info.run_id, "train_loss")] == list(range(1, 7))
    return trials


def test_unanswered_calls_run_in_order_their_errors_are_logged_and_never_fill_the_answer_pipe(tmp_path):
    """The loop does not wait for a trial's run to be closed or a sample of its readings to be
    written: the hub runs those calls in order (a later answered call finds them done); one
    that fails is logged as a warning naming it; thousands that fail (each answered with its
    error) do not fill the answer pipe and stall the hub."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    out = run_script(f"""
        import json, logging
        from tasks.hub_calls import use_hub
        from tasks.system_metrics import log_readings
        from tasks.tracking import mark_running, open_campaign_run
        from tasks.tracking_hub import MetricsHub

        warned = []
        class Kept(logging.Handler):
            def emit(self, record):
                warned.append(record.getMessage())
        logging.getLogger("tasks.tracking_hub").addHandler(Kept())
        hub = MetricsHub(store={uri!r})
        use_hub(hub)
        run_id = open_campaign_run({uri!r}, "e", "c", {{}}, 1)
        for step in range(3):
            log_readings({uri!r}, run_id, {{"values": {{"system/cpu_percent": 10.0 * step}}, "timestamp_ms": 1000 + step, "step": step, "devices_tag": None}})
        for _ in range(1500):  # each fails in the hub: an answer of ~150 bytes no one waits for
            log_readings({uri!r}, "no-such-run", {{"values": {{"system/cpu_percent": 1.0}}, "timestamp_ms": 1000, "step": 0, "devices_tag": None}})
        again = open_campaign_run({uri!r}, "e", "c", {{}}, 1)  # answered: after all of them
        hub.close()
        print(json.dumps({{"run": run_id, "again": again, "warned": warned}}))
    """, tmp_path)
    assert out["again"] == out["run"]
    history = MlflowClient(tracking_uri=uri).get_metric_history(out["run"], "system/cpu_percent")
    assert [(m.step, m.value) for m in history] == [(0, 0.0), (1, 10.0), (2, 20.0)]
    assert len(out["warned"]) == 1500 and all(w.startswith("tasks.system_metrics.log_readings failed in the campaign's hub: ")
                                               and "no-such-run" in w for w in out["warned"]), out["warned"][:2]


def test_threads_calling_the_hub_at_once_each_get_their_own_answer(tmp_path):
    """The loop, the system sampler and the run opener call the hub from their own threads:
    each call's answer reaches its caller, whichever thread read it from the pipe."""
    import threading

    from tasks.tracking_hub import MetricsHub

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    hub = MetricsHub(store=uri)
    got: dict[str, list] = {}
    try:
        opened = {c: hub.call("tasks.tracking.open_campaign_run", [uri, "e", c, {}, 1], {}) for c in ("a", "b", "c", "d")}

        def ask(campaign: str) -> None:
            got[campaign] = [hub.call("tasks.tracking.open_campaign_run", [uri, "e", campaign, {}, 1], {}) for _ in range(15)]

        threads = [threading.Thread(target=ask, args=(c,)) for c in opened]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        hub.close()
    assert got == {c: [run] * 15 for c, run in opened.items()}
