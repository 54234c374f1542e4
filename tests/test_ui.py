"""`campaign ui` in a real browser: headless Chromium (Debian's `chromium`, driven by
Playwright) loads the Prefect UI and the MLflow UI that `campaign ui` started, after a small
campaign reported to them. Screenshots are kept in test-artifacts/.

With CAMPAIGN_SCREENSHOTS=FOLDER (`make screenshots`: docs/images) it also writes the README's
pictures there, from this campaign: the live table, the Prefect artifact, its curves.png and the
MLflow view its link opens (`make test` leaves them as they are)."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest
import yaml

from conftest import campaign_cli, without_shared_prefect_server
from tasks.records import CampaignRecord, process_identity, write_campaign

pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
REPO = Path(__file__).resolve().parent.parent
SHOTS = REPO / "test-artifacts"
README_SHOTS = os.environ.get("CAMPAIGN_SCREENSHOTS")  # a folder (relative: to the repository) for the README's pictures
README_WIDTH = 1000
# The flags Chromium needs in a sandboxed, offline container (no background calls home).
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]


def start_ui(folder: Path) -> tuple[subprocess.Popen, dict[str, str]]:
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "ui", "params.yaml"], cwd=folder, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    urls, deadline = {}, time.time() + 180
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"`campaign ui` exited {proc.wait()}: {proc.stderr.read()}")
        if m := re.match(r"(Prefect UI|MLflow UI|MLflow runs)\s+(http://\S+)", line):
            urls[m.group(1).removesuffix(" UI")] = m.group(2)
        if "Ctrl-C" in line:
            return proc, urls
    proc.kill()
    raise AssertionError("`campaign ui` did not come up in 180 s")


def post(url: str, body: dict) -> object:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.load(response)


def listening(root_pid: int) -> set[tuple[str, int]]:
    root = psutil.Process(root_pid)
    pids = {root.pid} | {p.pid for p in root.children(recursive=True)}
    return {(c.laddr.ip, c.laddr.port) for c in psutil.net_connections("inet") if c.status == psutil.CONN_LISTEN and c.pid in pids}


@pytest.fixture
def browser():
    if CHROMIUM is None:
        pytest.skip("no Chromium on this machine: `apt-get install chromium` (as .ci/run does) to run the browser tests")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = chromium.new_page(viewport={"width": 1400, "height": 1000})
        # What the page did, for the message of a text that never showed: its console errors,
        # its failed requests, and the requests still unanswered.
        page.seen = {"console": [], "failed": [], "pending": {}}
        page.on("console", lambda m: m.type in ("error", "warning") and page.seen["console"].append(f"{m.type}: {m.text[:300]}"))
        page.on("request", lambda r: page.seen["pending"].__setitem__(r, (time.time(), r.method, r.url)))
        page.on("requestfinished", lambda r: page.seen["pending"].pop(r, None))
        page.on("requestfailed", lambda r: (page.seen["pending"].pop(r, None),
                                            page.seen["failed"].append(f"{r.method} {r.url}: {r.failure}")))
        page.on("response", lambda r: r.status >= 400 and page.seen["failed"].append(f"{r.request.method} {r.url}: HTTP {r.status}"))
        yield page
        chromium.close()


def see(page, url: str, *texts: str, shot: str) -> str:
    """Open `url`, wait until every text is on the page, keep a screenshot; the page's text."""
    page.goto(url)
    try:
        for text in texts:
            try:
                page.get_by_text(text).first.wait_for(timeout=60_000)
            except Exception as e:
                now = time.time()
                pending = [f"{method} {url} ({now - since:.0f} s)" for since, method, url in page.seen["pending"].values()]
                raise AssertionError(f"{text!r} not shown at {url} ({type(e).__name__}); the page: {page.inner_text('body')[:800]!r}; "
                                     f"console: {page.seen['console'][-10:]}; failed: {page.seen['failed'][-10:]}; "
                                     f"unanswered: {pending[-10:]}") from e
    finally:
        SHOTS.mkdir(exist_ok=True)
        page.screenshot(path=str(SHOTS / shot), full_page=True)
    return page.inner_text("body")


def for_readme(name: str, png: bytes) -> None:
    """Keep a picture for the README when CAMPAIGN_SCREENSHOTS names a folder: at most
    README_WIDTH pixels wide, 256 colours, optimized."""
    from PIL import Image

    if not README_SHOTS:
        return
    folder = REPO / README_SHOTS
    folder.mkdir(parents=True, exist_ok=True)
    image = Image.open(io.BytesIO(png)).convert("RGB")
    if image.width > README_WIDTH:
        image = image.resize((README_WIDTH, round(image.height * README_WIDTH / image.width)), Image.Resampling.LANCZOS)
    image.quantize(colors=256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE).save(folder / name, optimize=True)


# Prefect's own lines in a flow run's log, which a live view leaves to campaign.log: the rest are the campaign's events.
PREFECT_CHATTER = ("Beginning flow run", "Finished in state", "Created task run", "Executing", "View at")


def live_table_png(page, folder: Path, name: str, launch_out: str) -> bytes:
    """The end of `campaign launch`'s live view of this campaign, as a terminal shows it: the
    events its flow logged (from the launch's Prefect log lines), the table and links drawn by the live
    view's own code from the campaign's records, the last line; rendered by rich as SVG, then
    drawn by Chromium."""
    from rich.console import Console
    from rich.text import Text

    from flows.run.live_view import LiveView, linked

    console = Console(record=True, width=110, force_terminal=True, color_system="truecolor", file=io.StringIO())
    trials = len(json.loads((folder / "runs" / name / "campaign.json").read_text())["trials"])
    console.print(f"$ campaign launch params.yaml\ncampaign [bold]{name}[/]: {trials} trials, 1 device(s) each", highlight=False)
    for line in launch_out.splitlines():
        if (m := re.match(r"(\d\d:\d\d:\d\d)\.\d+ \| (INFO|WARNING)\s*\| Flow run '[^']*' - (.*)", line)) \
                and not m.group(3).startswith(PREFECT_CHATTER):
            line = Text(m.group(1) + " ", style="dim")  # as the live view prints an event (flows/run/live_view.py: _EventLines)
            line.append_text(linked(m.group(3), "yellow" if m.group(2) == "WARNING" else ""))
            console.print(line, highlight=False)  # wrapped here as a terminal wraps it (an SVG would cut it)
    console.print(LiveView(console, folder / "runs", name, Path("runs") / name / "campaign.log").render())
    console.print(next(line for line in launch_out.splitlines() if line.startswith("finished ")), highlight=False)
    page.set_content(f"<html><body style='margin:0;background:#fff'>{console.export_svg(title='campaign launch')}</body></html>")
    return page.locator("svg").first.screenshot()


def test_campaign_ui_shows_the_campaign_in_prefect_and_mlflow(tmp_path, digits_npz, browser, monkeypatch, prefect_database):
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect"))  # a fresh Prefect database: only this campaign
    prefect_database(tmp_path / "prefect")
    without_shared_prefect_server(monkeypatch)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({
        "campaign": {"name": "ui-test"}, "data": {"path": str(digits_npz)}, "model": {"name": "mlp", "width": 8},
        # For the README's pictures, long enough for curves that say something (the test: the shortest that has two points),
        # with as few log lines (a line each logged step) as the flow run's page shows before it pages them.
        "training": {"steps": 300, "batch_size": 32, "lr": 0.1, "log_every": 50, "eval_every": 50, "checkpoint_every": 100}
                    if README_SHOTS else
                    {"steps": 20, "batch_size": 32, "lr": 0.1, "eval_every": 10, "checkpoint_every": 10},
        "grid": {"training.lr": [0.05, 0.1]}, "cluster": {"cpu_slots": 2},
        "tracking": {"mlflow_uri": f"sqlite:///{tmp_path}/mlflow.db", "experiment": "ui-test", "runs_dir": "runs"},
    }))
    ui, urls = start_ui(tmp_path)
    try:
        assert set(urls) == {"Prefect", "MLflow", "MLflow runs"}
        assert {ip for ip, _ in listening(ui.pid)} == {"127.0.0.1"}  # both servers, loopback only
        done = campaign_cli("launch", "params.yaml", "--no-live", cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        assert f"reporting to the Prefect server of `campaign ui`: {urls['Prefect']}" in done.stdout

        (flow_run,) = post(urls["Prefect"] + "/api/flow_runs/filter", {})  # the launch reported to the UI's server
        assert flow_run["state_type"] == "COMPLETED"
        trials = [t["id"] for t in json.loads((tmp_path / "runs" / "ui-test" / "campaign.json").read_text())["trials"]]
        # The flow-run list tells campaigns apart by name (`<campaign> · launch <n>`), not by a random one.
        assert flow_run["name"] == "ui-test · launch 1"
        see(browser, f"{urls['Prefect']}/runs", flow_run["name"], shot="prefect-runs.png")
        text = see(browser, f"{urls['Prefect']}/runs/flow-run/{flow_run['id']}", flow_run["name"], *(f"{t} finished" for t in trials),
                   shot="prefect-flow-run.png")
        assert "Completed" in text and "2 Task runs" in text
        (summary,) = post(urls["Prefect"] + "/api/artifacts/filter", {"artifacts": {"key": {"any_": ["campaign-ui-test"]}}})
        text = see(browser, f"{urls['Prefect']}/artifacts/artifact/{summary['id']}", "best", *trials, shot="prefect-summary.png")
        assert text.count("finished") >= 2
        # Each trial's MLflow run is a link into the MLflow UI of `campaign ui`, and so is the campaign's view.
        assert browser.locator(f'a[href^="{urls["MLflow"]}/#/experiments/"][href*="/runs/"]').count() == 2
        assert browser.locator(f'a[href^="{urls["MLflow"]}/#/experiments/"][href*="viewStateShareKey"]').count() == 2
        for_readme("prefect-artifact.png", browser.screenshot())
        for_readme("curves.png", (tmp_path / "runs" / "ui-test" / "curves.png").read_bytes())  # the file the campaign wrote
        if README_SHOTS:
            for_readme("live-table.png", live_table_png(browser, tmp_path, "ui-test", done.stderr + done.stdout))  # Prefect logs to stderr

        with urllib.request.urlopen(f"{urls['MLflow']}/ajax-api/2.0/mlflow/experiments/get-by-name?experiment_name=ui-test") as r:
            experiment = json.load(r)["experiment"]["experiment_id"]
        runs = post(urls["MLflow"] + "/ajax-api/2.0/mlflow/runs/search", {"experiment_ids": [experiment]})["runs"]
        parent = next(r for r in runs if r["info"]["run_name"] == "ui-test")
        child = next(r for r in runs if r["info"]["run_name"] == "lr=0.1")
        see(browser, f"{urls['MLflow']}/#/experiments/{experiment}/runs", "ui-test", shot="mlflow-runs.png")
        # The link `campaign ui` printed opens the campaign's trials, a row each (not one folded
        # parent row), with the metric it ranks by and the grid's parameter as columns, best first.
        assert urls["MLflow runs"].startswith(f"{urls['MLflow']}/#/experiments/{experiment}/runs?")
        labels = [r["info"]["run_name"] for r in runs if r["info"]["run_name"] != "ui-test"]
        see(browser, urls["MLflow runs"], *labels, "2 matching runs", shot="mlflow-campaign.png")
        for column in ("val_accuracy", "training.lr"):
            assert browser.get_by_role("columnheader", name=column).first.is_visible(), column
        rows = [text for _, text in sorted((int(row.get_attribute("aria-rowindex") or 0), row.inner_text())  # as shown, not as in the DOM
                                           for row in browser.get_by_role("row").all())
                if any(label in text for label in labels)]
        best = max(runs, key=lambda r: next((m["value"] for m in r["data"].get("metrics", []) if m["key"] == "val_accuracy"), -1))
        assert len(rows) == 2 and best["info"]["run_name"] in rows[0], rows  # a row per trial, the best first
        if README_SHOTS:  # the view alone: MLflow's assistant, the shared view's banner and its sidebar folded away
            for button in ("Close", "Hide banner", "Toggle sidebar"):
                browser.get_by_role("button", name=button, exact=True).click()
            browser.set_viewport_size({"width": 1200, "height": 420})
            browser.get_by_role("columnheader", name="training.lr").first.wait_for()
            for_readme("mlflow-campaign.png", browser.screenshot())
            browser.set_viewport_size({"width": 1400, "height": 1000})
        # The campaign's end printed a link to their curves, the campaign's metric first (not CPU utilisation).
        (compare,) = re.findall(r"MLflow compare\s+(http://\S+)", done.stdout + done.stderr)
        text = see(browser, compare, "Model metrics", "val_accuracy", *labels, shot="mlflow-compare.png")
        charts = text[text.index("Model metrics"):]
        assert charts.index("val_accuracy") < min(charts.index(m) for m in ("train_loss", "step_time_s") if m in charts), charts[:600]
        see(browser, f"{urls['MLflow']}/#/experiments/{experiment}/runs/{child['info']['run_id']}", "lr=0.1", "final.val_accuracy",
            shot="mlflow-trial-run.png")
        assert parent["info"]["status"] == "FINISHED"

        # Stopping while a campaign's process still reports here would fail its end: the UI serves on until it exits.
        campaign_process = subprocess.Popen(["sleep", "600"])
        write_campaign(tmp_path / "runs", CampaignRecord(name="busy", state="ended", owner=process_identity(campaign_process.pid),
                                                         prefect_api=urls["Prefect"] + "/api"))
        os.killpg(ui.pid, signal.SIGTERM)
        told = ""
        while line := ui.stdout.readline():  # "" if it exited instead
            told += line
            if "still report" in line:
                break
        assert "campaign(s) busy still report to this Prefect server" in told, told
        assert ui.poll() is None and urllib.request.urlopen(urls["Prefect"] + "/api/health", timeout=5).status == 200
    finally:
        if "campaign_process" in locals():  # signalled already: it stops once that process has exited
            campaign_process.kill()
            campaign_process.wait()
        else:
            os.killpg(ui.pid, signal.SIGTERM)
        out, err = ui.communicate(timeout=60)
    assert ui.returncode == 0 and "stopped the Prefect server and the MLflow UI" in out, err
    assert not (tmp_path / ".campaign" / "ui.json").exists()
    for url in urls.values():  # both servers are gone with it
        with pytest.raises(OSError):
            urllib.request.urlopen(url, timeout=5)
