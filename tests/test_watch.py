"""Watching a campaign from the terminal: `campaign status --watch`, `campaign logs TRIAL -f`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import campaign_cli
from test_signed_results import trainer_result
from training.files import write_json_atomic
from training.result import write_result


def a_campaign(runs: Path) -> Path:
    """A campaign record with one trial that is still running (its owner: this process)."""
    from tasks.records import CampaignRecord, TrialEntry, update_record, write_campaign

    write_campaign(runs, CampaignRecord(name="w", trials=(TrialEntry("t1", "lr=0.1", 10),)))
    trial = runs / "w" / "t1"
    trial.mkdir(parents=True)
    update_record(trial, state="running", devices=["cpu0"])
    (trial / "train.log").write_text("trial t1: world size 1, fresh start\n")
    return trial


def test_logs_follow_a_trial_until_it_ends_and_watch_ends_with_it(tmp_path):
    runs = tmp_path / "runs"
    trial = a_campaign(runs)
    follow = subprocess.Popen([sys.executable, "-m", "flows.cli", "logs", "t1", "-f", "--runs-dir", str(runs)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    watch = subprocess.Popen([sys.executable, "-m", "flows.cli", "status", "--watch", "--interval", "0.2", "--runs-dir", str(runs)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # `logs -f` has printed what there is so far and, the trial running, both keep going
    # (`status --watch` draws only at its end when its output is not a terminal).
    assert follow.stdout.readline() == "trial t1: world size 1, fresh start\n"
    assert follow.poll() is None and watch.poll() is None
    with open(trial / "train.log", "a") as log:
        log.write("trial t1: finished 10 steps\n")
    write_result(trial / "result.json", trainer_result("t1", steps=10))  # signed, as a trainer writes it
    out, err = follow.communicate(timeout=30)
    assert follow.returncode == 0, err
    assert out == "trial t1: finished 10 steps\n"  # the rest of the log, after the first line read above
    out, err = watch.communicate(timeout=30)
    assert watch.returncode == 0 and "finished" in out and "0.5000" in out, err


def test_logs_follow_a_stopped_trial_while_a_run_of_its_campaign_is_live(tmp_path):
    """Right after `campaign resume` the trial's record still says how the last run left it
    (interrupted): `logs -f` follows it while the campaign's run is live, and ends with the trial."""
    from flows.run.owner import claim_campaign
    from tasks.records import update_record

    runs = tmp_path / "runs"
    trial = a_campaign(runs)
    update_record(trial, state="interrupted")
    cli = [sys.executable, "-m", "flows.cli", "logs", "t1", "-f", "--runs-dir", str(runs)]
    alone = subprocess.run(cli, capture_output=True, text=True, timeout=60)  # no run: nothing will resume it
    assert alone.returncode == 0 and alone.stdout == "trial t1: world size 1, fresh start\n", alone.stderr
    ownership = claim_campaign(runs / "w", "w", "resume")  # this process resumes the campaign
    try:
        follow = subprocess.Popen(cli, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert follow.stdout.readline() == "trial t1: world size 1, fresh start\n"
        with open(trial / "train.log", "a") as log:
            log.write("trial t1: resumed from step-00000005\n")
        assert follow.stdout.readline() == "trial t1: resumed from step-00000005\n"  # still following
        write_result(trial / "result.json", trainer_result("t1", steps=10))
        out, err = follow.communicate(timeout=30)
        assert follow.returncode == 0 and out == "", err
    finally:
        ownership.release()


def test_a_finished_elastic_trial_shows_the_devices_it_ended_on(tmp_path):
    from tasks.records import campaign_status
    from training.agent_state import AgentState
    from training.layout import trial_files

    trial = a_campaign(tmp_path / "runs")  # started on cpu0
    AgentState(seq=2, gen=1, devices=("cpu0", "cpu1"), status="running").write(trial_files(trial).control)
    assert campaign_status(tmp_path / "runs", "w")[0].devices == ["cpu0", "cpu1"]
    write_result(trial / "result.json", trainer_result("t1", steps=10))
    AgentState(seq=3, gen=2, devices=("cpu1",), status="finished").write(trial_files(trial).control)
    [row] = campaign_status(tmp_path / "runs", "w")
    assert row.state == "finished" and row.devices == ["cpu1"]


def test_logs_name_the_trials_when_the_trial_is_unknown(tmp_path):
    runs = tmp_path / "runs"
    a_campaign(runs)
    done = campaign_cli("logs", "nope", "--runs-dir", str(runs))
    assert done.returncode == 2 and "has: t1" in done.stderr and "--campaign NAME" in " ".join(done.stderr.split())
    done = campaign_cli("logs", "t1", "--runs-dir", str(runs))
    assert done.returncode == 0 and done.stdout == "trial t1: world size 1, fresh start\n"
    done = campaign_cli("logs", "nope", "--campaign", "w", "--runs-dir", str(runs))
    assert done.returncode == 2 and "its trials: t1" in done.stderr


def test_logs_stream_a_large_log_whole_and_refuse_a_log_that_is_a_device(tmp_path):
    runs = tmp_path / "runs"
    trial = a_campaign(runs)
    text = "".join(f"step {i}: loss 0.5 · λ ✓\n" for i in range(120_000))  # ~3 MB, multi-byte characters across pieces
    (trial / "train.log").write_text(text)
    done = campaign_cli("logs", "t1", "--runs-dir", str(runs))
    assert done.returncode == 0 and done.stdout == text, done.stderr[-2000:]
    (trial / "train.log").unlink()
    (trial / "train.log").symlink_to("/dev/zero")  # read whole, it would never end
    done = campaign_cli("logs", "t1", "--runs-dir", str(runs))
    assert done.returncode == 2 and "train.log is a character device" in " ".join(done.stderr.split()), done.stderr[-2000:]


def test_logs_find_a_trial_of_an_earlier_campaign(tmp_path):
    """The latest campaign is not the only one: a trial id from another is found there."""
    from tasks.records import CampaignRecord, TrialEntry, write_campaign

    runs = tmp_path / "runs"
    a_campaign(runs)  # campaign w, trial t1
    write_campaign(runs, CampaignRecord(name="later", trials=(TrialEntry("t9", "lr=1", 1),)))
    (runs / "latest").write_text("later")  # the campaign launched last
    done = campaign_cli("logs", "t1", "--runs-dir", str(runs))
    assert done.returncode == 0 and done.stdout == "trial t1: world size 1, fresh start\n", done.stderr


def test_logs_take_a_unique_prefix_or_the_id_without_its_hash(tmp_path):
    """A trial is named by a unique prefix of its id, or its id without the hash suffix; an
    ambiguous one exits 2 listing the candidates."""
    from tasks.records import CampaignRecord, TrialEntry, write_campaign

    runs = tmp_path / "runs"
    ids = ("lr0.1-width16-1d6bd000", "lr0.1-width160-2aa00000", "lr0.2-width16-3bb00000")
    write_campaign(runs, CampaignRecord(name="p", trials=tuple(TrialEntry(i, i, 1) for i in ids)))
    for i in ids:
        (runs / "p" / i).mkdir(parents=True)
        (runs / "p" / i / "train.log").write_text(f"log of {i}\n")
    for given, shown in (("lr0.1-width16", ids[0]), ("lr0.1-width16-1d", ids[0]), ("lr0.1-width160", ids[1]),
                         ("lr0.2", ids[2]), (ids[1], ids[1])):
        done = campaign_cli("logs", given, "--runs-dir", str(runs))
        assert done.returncode == 0 and done.stdout == f"log of {shown}\n", (given, done.stderr)
    done = campaign_cli("logs", "lr0.1-w", "--runs-dir", str(runs))
    assert done.returncode == 2 and ids[0] in done.stderr and ids[1] in done.stderr and ids[2] not in done.stderr
    done = campaign_cli("logs", "lr0.1-w", "--campaign", "p", "--runs-dir", str(runs))
    assert done.returncode == 2 and ids[0] in done.stderr and ids[1] in done.stderr
    done = campaign_cli("resize", "lr0.1-w", "1", "--campaign", "p", "--runs-dir", str(runs))
    assert done.returncode == 2 and ids[0] in done.stderr and ids[1] in done.stderr
    done = campaign_cli("resize", "lr0.2", "1", "--campaign", "p", "--runs-dir", str(runs))
    assert done.returncode == 2 and f"trial {ids[2]} has a fixed size" in " ".join(done.stderr.split())


def test_the_timeline_has_a_bar_per_device_and_holding(tmp_path):
    from tasks.records import Allocation
    from tasks.timeline import intervals, write_timeline

    events = [
        {"time": 10.0, "trial": "a", "devices": ["d0", "d1"], "reason": "start"},
        {"time": 11.0, "trial": "b", "devices": ["d2"], "reason": "start"},
        {"time": 15.0, "trial": "a", "devices": ["d0"], "reason": "resize"},
        {"time": 18.0, "trial": "b", "devices": [], "reason": "preempted"},
        {"time": 20.0, "trial": "a", "devices": [], "reason": "end"},
        {"time": 21.0, "trial": "b", "devices": ["d1"], "reason": "start"},
    ]
    allocations = [Allocation(**{**e, "devices": tuple(e["devices"])}) for e in events]
    bars = {(b.trial, b.device, b.start, b.end, b.ended_by) for b in intervals(allocations, now=25.0)}
    assert bars == {("a", "d0", 10.0, 15.0, "resize"), ("a", "d1", 10.0, 15.0, "resize"), ("a", "d0", 15.0, 20.0, "end"),
                    ("b", "d2", 11.0, 18.0, "preempted"), ("b", "d1", 21.0, 25.0, "running")}
    (tmp_path / "allocations.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    png, html = write_timeline(tmp_path, "campaign t")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "<svg" in html.read_text() and "campaign t" in html.read_text()


# --- the live view of `campaign launch` -------------------------------------------------------

def test_the_trials_table_keeps_each_trial_id_whole_at_80_columns():
    """At 80 columns the trial ids stay whole on one line (people copy them); other cells fold."""
    from rich.console import Console

    from flows.run.live_view import trials_table
    from tasks.records import TrialStatus

    ids = ["lr0.1-width16-1d6bd000", "lr0.05-width128-weight_decay0.01-7a3e9f21", "lr0.001-width64-seed+1-3c2b1a00"]
    rows = [TrialStatus(i, i, "finished", 1000, 1000, ["cuda:0", "cuda:1"], {"val_accuracy": 0.98, "train_loss": 0.0512},
                        "/x/step-0001000") for i in ids]
    for etas in (None, {i: 12.0 for i in ids}):
        console = Console(width=80, record=True, file=open("/dev/null", "w"))
        console.print(trials_table("c", rows, etas))
        lines = console.export_text().splitlines()
        assert all(len(line) <= 80 for line in lines)
        for i in ids:
            assert any(i in line for line in lines), (i, "\n".join(lines))


def test_the_trials_table_marks_the_best_finished_trial_by_the_campaigns_objective():
    """The best of the finished trials is named under the table and its row is bold: by the
    campaign's objective (a search's metric, min or max), never a running trial's metrics so
    far or a pruned one's; without a record of the objective, by validation accuracy."""
    from rich.console import Console

    from flows.run.live_view import trials_table
    from tasks.records import TrialStatus

    def row(tid, state, accuracy, loss):
        return TrialStatus(tid, tid, state, 10, 10, ["cpu0"], {"val_accuracy": accuracy, "val_loss": loss, "train_loss": loss}, None)

    rows = [row("a", "finished", 0.91, 0.30), row("b", "finished", 0.95, 0.35), row("c", "running", 0.99, 0.10),
            row("d", "pruned", 0.99, 0.05), row("e", "finished", 0.90, 0.25)]

    def shown(objective):
        table = trials_table("c", rows, objective=objective)
        console = Console(width=100, record=True, file=open("/dev/null", "w"))
        console.print(table)
        bold = [r.trial_id for r, style in zip(rows, (table.rows[i].style for i in range(len(rows)))) if style == "bold"]
        return console.export_text(), bold

    text, bold = shown(None)
    assert "★ best: b, val_accuracy 0.9500" in text and bold == ["b"]
    assert "val acc" in text and "val loss" not in text  # the metric column is the one ranked by
    text, bold = shown(("val_loss", "min"))
    assert "★ best: e, val_loss 0.2500" in text and bold == ["e"]
    assert "val loss" in text and "val acc" not in text and "0.3500" in text
    text, bold = shown(("val_loss", "max"))
    assert "★ best: b, val_loss 0.3500" in text and bold == ["b"]
    text, bold = shown(("val_perplexity", "min"))  # no trial reports it: nothing is marked
    assert "best" not in text and bold == []


def test_campaign_status_names_the_best_trial_by_the_objective_the_launch_recorded(tmp_path):
    from tasks.records import update_campaign

    runs = tmp_path / "runs"
    trial = a_campaign(runs)
    write_result(trial / "result.json", trainer_result("t1", steps=10))
    out = subprocess.run([sys.executable, "-m", "flows.cli", "status", "--runs-dir", str(runs)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "★ best: t1, val_accuracy 0.8125" in out.stdout, out.stdout + out.stderr
    update_campaign(runs, "w", objective=("val_perplexity", "min"))  # a metric the trial did not report
    out = subprocess.run([sys.executable, "-m", "flows.cli", "status", "--runs-dir", str(runs)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "finished" in out.stdout and "best" not in out.stdout, out.stdout + out.stderr


def test_an_event_line_with_a_url_keeps_it_whole_at_80_columns_and_links_it_in_a_terminal():
    """The campaign's end prints an `MLflow compare` link longer than 80 columns: one line, no
    hard break inside it (copied whole), and an OSC 8 hyperlink where the console is a terminal."""
    import io
    import logging

    from rich.console import Console

    from flows.run.live_view import _EventLines
    from tasks.tracking import campaign_view_url

    url = campaign_view_url("http://127.0.0.1:5000", "3", "a-campaign-named-at-some-length", charts=True)
    assert len(url) > 80
    event = logging.LogRecord("campaign", logging.INFO, __file__, 1, f"MLflow compare {url}", None, None)
    for terminal in (False, True):
        out = io.StringIO()
        _EventLines(Console(file=out, width=80, force_terminal=terminal)).emit(event)
        text = out.getvalue()
        assert any(url in line for line in text.splitlines()), text
        assert ("\x1b]8;" in text) == terminal, text


def test_eta_counts_from_the_steps_made_since_first_seen_and_starts_over_after_a_restart():
    from flows.run.live_view import Eta, format_seconds

    eta = Eta()
    assert eta.observe("t", 0, 1000, now=-30.0) is None  # starting up: not part of its pace
    assert eta.observe("t", 100, 1000, now=0.0) is None  # one reading: no rate yet
    assert eta.observe("t", 100, 1000, now=5.0) is None  # no step made yet
    assert eta.observe("t", 200, 1000, now=10.0) == 80.0  # 100 steps in 10 s, 800 left
    assert eta.observe("t", 50, 1000, now=11.0) is None  # resumed from an earlier checkpoint: a new stretch
    assert eta.observe("t", 150, 1000, now=21.0) == 85.0
    assert [format_seconds(s) for s in (None, 42, 85, 3725)] == ["-", "42s", "1m25s", "1h02m"]


def test_the_flow_reports_metrics_as_words_not_dicts():
    from training.metrics import format_metrics

    assert format_metrics({"lr": 0.0, "train_loss": 0.08123, "val_accuracy": 0.97222, "step_time_s": 0.01}) == \
        "train_loss 0.0812, val_accuracy 0.9722"
    assert format_metrics({"grad_noise_scale": 2.5e-06, "samples": 123456.0, "val_loss": 0.0}) == \
        "grad_noise_scale 2.5e-06, samples 1.235e+05, val_loss 0.0000"


@pytest.mark.slow
def test_launch_shows_trials_live_and_sends_prefect_chatter_to_a_file(tmp_path, digits_npz):
    import yaml

    (tmp_path / "params.yaml").write_text(yaml.safe_dump({
        "campaign": {"name": "live"}, "data": {"path": str(digits_npz)}, "model": {"name": "mlp", "width": 8},
        "training": {"steps": 20, "batch_size": 32, "lr": 0.1, "eval_every": 10, "checkpoint_every": 10}, "grid": {"training.lr": [0.05, 0.1]},
        "cluster": {"cpu_slots": 2}, "tracking": {"mlflow_uri": f"sqlite:///{tmp_path}/mlflow.db", "runs_dir": "runs"},
    }))
    done = campaign_cli("launch", "params.yaml", "--live", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    ids = [t["id"] for t in json.loads((tmp_path / "runs" / "live" / "campaign.json").read_text())["trials"]]
    for trial in ids:  # an event line when each starts and ends, its row in the final table
        assert f"trial {trial} (lr=" in out and f"trial {trial} finished: " in out, out
        assert any(line.startswith(f"│{trial}") and "finished" in line and "20/20" in line for line in out.splitlines()), out
    assert "val_accuracy 0." in out and "{'" not in out  # metrics in words
    assert "2/2 trials ended" in out and "finished 2/2 trials" in out
    assert "`campaign ui`" in out  # no UI serves this campaign: the view says how to get one (and its links)
    chatter = ("Beginning flow run", "Finished in state", "temporary server", "Created task run")
    assert not any(c in out or c in done.stderr for c in chatter), (out, done.stderr)
    log = (tmp_path / "runs" / "live" / "campaign.log").read_text()
    assert "Beginning flow run" in log and "Finished in state" in log  # Prefect's own lines: kept, in the file


def test_the_summary_links_each_trial_to_its_mlflow_run_when_a_ui_is_known(tmp_path):
    from flows.servers.ui import STATE, mlflow_ui
    from tasks.summary import summary_markdown
    from training.files import write_json_atomic

    assert mlflow_ui("sqlite:///mlflow.db", tmp_path) is None  # no UI known: plain run ids
    write_json_atomic(tmp_path / STATE, {"mlflow_url": "http://127.0.0.1:5001"})
    assert mlflow_ui("sqlite:///mlflow.db", tmp_path) == "http://127.0.0.1:5001"
    assert mlflow_ui("http://tracking:5000", tmp_path) == "http://tracking:5000"  # a tracking server is its own UI
    summary = {"trials": 1, "finished": 1, "failed": 0, "per_trial": {}}
    trial = type("T", (), {"id": "t1", "label": "lr=0.1"})()
    plain = summary_markdown("c", summary, [trial], {"t1": "finished"}, {"t1": "abc"})
    linked = summary_markdown("c", summary, [trial], {"t1": "finished"}, {"t1": "abc"}, "http://127.0.0.1:5001", "7")
    assert "| abc |" in plain and "| [abc](http://127.0.0.1:5001/#/experiments/7/runs/abc) |" in linked


def test_the_live_view_links_the_flow_run_and_the_campaigns_trials_in_mlflow_when_uis_serve_them():
    from dataclasses import replace

    from flows.run.live_view import campaign_links
    from tasks.records import CampaignRecord

    record = CampaignRecord(name="c", prefect_api="http://127.0.0.1:4200/api", flow_run_id="f-1", mlflow_ui="http://127.0.0.1:5000/",
                            mlflow_experiment_id="7", mlflow_run_id="r-9")
    assert campaign_links(record) == ["Prefect  http://127.0.0.1:4200/runs/flow-run/f-1",
                                      "MLflow   http://127.0.0.1:5000/#/experiments/7/runs?viewStateShareKey=campaign-c&compareRunsMode=TABLE"]
    temporary = replace(record, prefect_api=None, mlflow_ui=None)  # Prefect's temporary API, no MLflow UI
    assert len(campaign_links(temporary)) == 1 and "`campaign ui`" in campaign_links(temporary)[0]


def test_the_trials_table_fits_80_columns_without_cutting_a_value():
    """At 80 columns the state read "finis…": values stay whole, ids and devices fold."""
    from rich.console import Console

    from flows.run.live_view import trials_table
    from tasks.records import TrialStatus

    rows = [TrialStatus(f"lr=0.05-width=16-{i}a3f9c2", "lr=0.05", state, 1200, 1500, ["vm/cpu0", "vm/cpu1"],
                        {"val_accuracy": 0.98333, "train_loss": 0.04121}, "/runs/t/checkpoints/step-00001200")
            for i, state in enumerate(["finished", "interrupted", "running"])]
    console = Console(width=80, record=True)
    console.print(trials_table("digits-cnn", rows, {r.trial_id: 3960.0 for r in rows}))
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= 80
    assert all(word in text for word in ("finished", "interrupted", "running", "1200/1500", "0.9833", "0.0412", "1h06m"))
    assert "…" not in text
