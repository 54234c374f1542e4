"""The campaign's warden: cleans up after a `campaign launch` that was killed outright.

A SIGKILL (`kill -9`, the OOM killer) gives the campaign no chance to clean up. Its trials
die with it (PR_SET_PDEATHSIG, training/process.py), but Prefect's ephemeral API server, a
child it started, would go on listening for good, and the campaign's records and MLflow
runs would say "running" forever. The warden is a small process in a session of its own,
started by the CLI before anything else. It waits for the CLI to exit, then

- ends every process the CLI left behind: they carry its mark in their environment
  (metric sinks excepted: they end by themselves once they have sent what they hold);
- if the campaign did not end in order (its campaign.json still names the dead process as
  its running owner): marks the trials that process was running "interrupted" and the
  campaign's RUNNING MLflow runs KILLED.

Nothing here imports torch; MLflow only when there is something to mark.
"""

from __future__ import annotations

import argparse
import os
import secrets
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from training.process import end_processes, processes_marked
from tasks.records import ACTIVE, process_identity, read_campaign, read_trial_record, update_campaign, update_record

MARK = "CAMPAIGN_WARDEN_MARK"
GRACE_S = 10.0  # SIGTERM, then this long before SIGKILL


def start_warden(campaign_dir: Path, tracking_uri: str) -> subprocess.Popen:
    """Start this process's warden; every process started from here on carries its mark.

    It writes nothing until it has something to say (its `warden.log` in the campaign's
    folder), so it starts before the spec's last checks: a launch refused for bad input
    leaves nothing behind, and Prefect's server may start while those checks run."""
    token = secrets.token_hex(8)
    env = {k: v for k, v in os.environ.items() if k != MARK}  # the warden must not find itself
    root = str(Path(__file__).resolve().parents[2])  # importable from any working directory
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    proc = subprocess.Popen(
        [sys.executable, "-m", "flows.run.warden", "--owner", process_identity(), "--mark", token,
         "--campaign-dir", str(campaign_dir.resolve()), "--tracking-uri", tracking_uri],
        env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,  # a signal to the CLI's process group does not reach it
    )
    os.environ[MARK] = token
    return proc


def say(campaign_dir: Path, message: str) -> None:
    """A line in the campaign's warden.log (the folder made if the campaign never got to it)."""
    campaign_dir.mkdir(parents=True, exist_ok=True)
    with open(campaign_dir / "warden.log", "a") as log:
        log.write(f"{time.ctime()}: {message}\n")


def wait_for_exit(owner: str) -> None:
    pid = int(owner.rsplit(":", 2)[1])
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):  # no pidfd (old kernel) or already gone
        fd = None
    if process_identity(pid) != owner:
        return
    if fd is not None:
        select.select([fd], [], [])  # readable once the process has exited
        os.close(fd)
        return
    while process_identity(pid) == owner:
        time.sleep(0.5)


def marked_processes(token: str) -> dict[int, bytes]:
    """pid -> command line of every process whose environment carries the mark."""
    return processes_marked(MARK, token)


def end_leftovers(token: str, grace_s: float = GRACE_S) -> list[int]:
    """SIGTERM the marked processes, SIGKILL those still there after the grace; returns their pids."""
    left = [pid for pid, cmd in marked_processes(token).items() if b"training.metrics" not in cmd]
    end_processes(left, grace_s)
    return left


def settle_records(campaign_dir: Path, owner: str) -> list[str]:
    """The dead owner's active trials become 'interrupted'; returns MLflow run ids to mark KILLED."""
    record = read_campaign(campaign_dir.parent, campaign_dir.name)
    if record is None or record.owner != owner or record.state != "running":
        return []  # it ended in order, or it is another process's campaign now
    interrupted = []
    for trial in record.trials:
        trial_dir = campaign_dir / trial.id
        trial_record = read_trial_record(trial_dir)
        if trial_record.state in ACTIVE and trial_record.owner == owner:
            update_record(trial_dir, state="interrupted")
            interrupted.append(trial.id)
    update_campaign(campaign_dir.parent, campaign_dir.name, state="interrupted", ended=time.time())
    return [record.mlflow_run_id] if record.mlflow_run_id else []


def kill_runs(tracking_uri: str, parent_run_id: str) -> None:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    parent = client.get_run(parent_run_id)
    children = client.search_runs([parent.info.experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{parent_run_id}'")
    for run in [parent, *children]:
        if run.info.status == "RUNNING":
            client.set_terminated(run.info.run_id, status="KILLED")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Clean up after a campaign process once it exits.")
    parser.add_argument("--owner", required=True, help="the campaign process, as tasks.records.process_identity names it")
    parser.add_argument("--mark", required=True)
    parser.add_argument("--campaign-dir", type=Path, required=True)
    parser.add_argument("--tracking-uri", required=True)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C in the terminal is for the campaign
    wait_for_exit(args.owner)
    try:
        if ended := end_leftovers(args.mark):
            say(args.campaign_dir, f"ended {len(ended)} process(es) the campaign left behind: {ended}")
        for run_id in settle_records(args.campaign_dir, args.owner):
            kill_runs(args.tracking_uri, run_id)
            say(args.campaign_dir, "the campaign was killed; its running trials are marked interrupted, its MLflow runs KILLED")
    except Exception as e:  # nobody reads the warden's own output: its log says what went wrong
        say(args.campaign_dir, f"could not clean up after the campaign: {e.__class__.__name__}: {e}")
        raise


if __name__ == "__main__":
    main()
