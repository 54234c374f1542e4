"""What `campaign launch` shows while it runs: a table of trials redrawn in place, the
campaign's own events above it, and everything else (Prefect's and the libraries' logs) in a
file next to the campaign record.

The table is the one `campaign status` prints (built from the trial records, so it shows the
same thing whoever reads it); the events are what the flow says about trials (started,
resized, finished, pruned, failed), sent to the `campaign.events` logger as well as to the
flow run's Prefect log.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.style import Style
from rich.text import Text

from tasks.ranking import DEFAULT_OBJECTIVE, best_finished
from tasks.records import ENDED, CampaignRecord, TrialStatus, campaign_status, read_campaign

EVENTS = logging.getLogger("campaign.events")
EVENTS.propagate = False  # without a live view the flow's Prefect log already says it: said once
EVENTS.setLevel(logging.INFO)


class CampaignLog:
    """The flow's logger: each line goes to the flow run's Prefect log and to `campaign.events`."""

    def __init__(self, run_logger):
        self.run_logger = run_logger

    def info(self, message: str) -> None:
        self._say(logging.INFO, message)

    def warning(self, message: str) -> None:
        self._say(logging.WARNING, message)

    def error(self, message: str) -> None:
        self._say(logging.ERROR, message)

    def _say(self, level: int, message: str) -> None:
        self.run_logger.log(level, message)
        EVENTS.log(level, message)


@dataclass
class Eta:
    """Time left per trial, from the steps it made since this view first saw it running.

    Pure: fed (step, time) readings; a trial that restarted (its step went back) starts over,
    and the stretch starts at its first step, not at its start-up.
    """

    seen: dict[str, tuple[int, float]] = field(default_factory=dict)  # trial -> first (step, time) of this stretch

    def observe(self, trial_id: str, step: int, steps: int, now: float) -> float | None:
        if step == 0:
            return None  # still starting (imports, data, process group): no pace to read yet
        first = self.seen.get(trial_id)
        if first is None or step < first[0]:
            self.seen[trial_id] = (step, now)
            return None
        made, elapsed = step - first[0], now - first[1]
        if made <= 0 or elapsed <= 0:
            return None
        return max(0, steps - step) * elapsed / made


def format_seconds(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class _TrialsTable(Table):
    """A table whose first column (the trial id) is never cut: where the other values, each
    whole on one line, leave it too little room, they fold onto more lines instead."""

    def __rich_console__(self, console, options):
        from rich import box

        fits = lambda: self.__rich_measure__(console, options).minimum <= options.max_width
        self.box, self.show_edge, self.collapse_padding, self.padding = box.HEAVY_HEAD, True, False, (0, 1, 0, 1)
        for column in self.columns[1:]:
            column.no_wrap, column.overflow = column.header != "devices", "fold"
        if not fits():  # no borders between the columns: a space
            self.box, self.show_edge, self.collapse_padding = box.SIMPLE_HEAD, False, True
            self.padding = (0, 0, 0, 0)
        if not fits():
            for column in self.columns[1:]:
                column.no_wrap = False
        yield from super().__rich_console__(console, options)


COLUMN_NAMES = {"val_accuracy": "val acc", "val_loss": "val loss", "train_loss": "loss"}  # short headers; other metrics by name


def trials_table(name: str, rows: list[TrialStatus], etas: dict[str, float | None] | None = None,
                 objective: tuple[str, str] | None = None) -> Table:
    """The campaign's trials: state, progress, devices, latest metrics, checkpoint (and ETA when
    given). Its metric columns are the one the campaign ranks its trials by (`objective`: metric,
    min|max; validation accuracy where no objective is recorded) and the training loss; the
    best finished trial by the objective is in bold and named under the table."""
    metric, _ = objective or DEFAULT_OBJECTIVE
    shown = [metric] + (["train_loss"] if metric != "train_loss" else [])
    # Values are never cut (at 80 columns "finished" read "finis…"): the trial id stays whole on
    # one line (people copy it into `campaign logs`); where the terminal is too narrow for every
    # value on one line, the other cells fold onto more lines.
    table = _TrialsTable(title=f"campaign {name}", pad_edge=False)
    table.add_column("trial", no_wrap=True, min_width=max((len(r.trial_id) for r in rows), default=5))
    for col in ("state", "steps"):
        table.add_column(col, no_wrap=True)
    table.add_column("devices", overflow="fold")
    for col in [*(COLUMN_NAMES.get(m, m) for m in shown), "ckpt"]:
        table.add_column(col, no_wrap=True)
    if etas is not None:
        table.add_column("eta", justify="right", no_wrap=True)
    best = best_finished(rows, objective)
    if best is not None:
        table.caption = f"★ best: {best[0]}, {metric} {best[1]:.4f}"
        table.caption_justify = "left"
    for r in rows:
        fmt = lambda k: f"{r.metrics[k]:.4f}" if k in r.metrics else "-"
        checkpoint = str(int(Path(r.checkpoint).name.split("-")[1])) if r.checkpoint else "-"
        cells = [r.trial_id, r.state, f"{r.step}/{r.steps}", " ".join(r.devices) or "-", *map(fmt, shown), checkpoint]
        if etas is not None:
            cells.append(format_seconds(etas.get(r.trial_id)) if r.state == "running" else "-")
        table.add_row(*cells, style="bold" if best is not None and r.trial_id == best[0] else None)
    return table


_URL = re.compile(r"https?://\S+")


class _EventLines(logging.Handler):
    """Prints the campaign's events above the live table."""

    def __init__(self, console: Console):
        super().__init__(logging.INFO)
        self.console = console

    def emit(self, record: logging.LogRecord) -> None:
        style = {logging.WARNING: "yellow", logging.ERROR: "red"}.get(record.levelno, "")
        line = Text(time.strftime("%H:%M:%S ", time.localtime(record.created)), style="dim")
        line.append_text(linked(record.getMessage(), style))
        # soft_wrap: no hard line breaks; the terminal wraps a long line, so a URL copies whole.
        self.console.print(line, highlight=False, soft_wrap=True)


def linked(message: str, style: str = "") -> Text:
    """`message` with each URL in it a link (OSC 8 where the console is a terminal): one link
    however the terminal wraps it."""
    line, at = Text(), 0
    for url in _URL.finditer(message):
        line.append(message[at:url.start()], style=style)
        line.append(url.group(), style=Style.parse(style or "none") + Style(link=url.group()))
        at = url.end()
    line.append(message[at:], style=style)
    return line


def chatter_to_file(path: Path) -> None:
    """From now on, every console handler's output (Prefect's, uvicorn's, the libraries') and
    Python's warnings go to `path`, not the terminal. For the rest of the process: Prefect
    still logs as its temporary server stops, at exit."""
    path.parent.mkdir(parents=True, exist_ok=True)
    file_handler = logging.FileHandler(path)
    file_handler.setFormatter(logging.Formatter("%(asctime)s | %(levelname)-7s | %(name)s - %(message)s"))
    for logger in [logging.getLogger()] + [logging.getLogger(n) for n in list(logging.root.manager.loggerDict)]:
        streams = [h for h in logger.handlers if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)]
        for handler in streams:
            logger.removeHandler(handler)
        if streams:
            logger.addHandler(file_handler)
    if file_handler not in logging.getLogger().handlers:
        logging.getLogger().addHandler(file_handler)
    logging.captureWarnings(True)  # to the root logger's handlers: the file


def plain_console_logs() -> None:
    """The log lines Prefect's console handler prints to a stream that is no terminal (a file,
    a pipe: CI, a bench, `nohup`) go through a plain StreamHandler instead, the same text:
    Prefect's handler renders each line with rich (markup, highlighting, the console's
    measures), which took ~5 ms of the campaign's CPU per line, a few lines per trial."""
    from prefect.logging.handlers import PrefectConsoleHandler

    for logger in [logging.getLogger()] + [logging.getLogger(n) for n in list(logging.root.manager.loggerDict)]:
        for i, handler in enumerate(list(logger.handlers)):
            if not isinstance(handler, PrefectConsoleHandler) or _is_terminal(handler.stream):
                continue
            plain = logging.StreamHandler(handler.stream)
            plain.setLevel(handler.level)
            plain.setFormatter(handler.formatter)
            for kept in handler.filters:
                plain.addFilter(kept)
            logger.handlers[i] = plain


def _is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError, OSError):
        return False


def campaign_links(record: CampaignRecord) -> list[str]:
    """Where to look at a campaign from its record: its Prefect flow run (when it reports to a
    Prefect server with a UI, not the temporary API) and its trials in MLflow, a row each,
    best first (when an MLflow UI serves the store: `campaign ui`, or the spec's own server)."""
    from tasks.tracking import campaign_view_url

    links = []
    api, flow_run_id = record.prefect_api, record.flow_run_id
    if api and flow_run_id:
        links.append(f"Prefect  {api.rstrip('/').removesuffix('/api')}/runs/flow-run/{flow_run_id}")
    ui, experiment = record.mlflow_ui, record.mlflow_experiment_id
    if ui and experiment and record.mlflow_run_id:
        links.append(f"MLflow   {campaign_view_url(ui, experiment, record.name)}")
    if not links:
        links.append("`campaign ui` (in another terminal, before the launch) serves Prefect's and MLflow's UIs with links here")
    return links


class LiveView:
    """The table redrawn in place (every `interval` s) with the events printed above it."""

    def __init__(self, console: Console, runs_dir: Path, name: str, log_path: Path, interval: float = 1.0):
        self.console, self.runs_dir, self.name, self.log_path, self.interval = console, runs_dir, name, log_path, interval
        self.eta = Eta()
        self._stop = threading.Event()
        self._live = Live(self.render(), console=console, refresh_per_second=4, transient=False)
        self._events = _EventLines(console)
        self._thread = threading.Thread(target=self._run, name="live-view", daemon=True)

    def render(self):
        record = read_campaign(self.runs_dir, self.name) or CampaignRecord(name=self.name)
        rows = campaign_status(self.runs_dir, self.name, record)
        now = time.time()
        etas = {r.trial_id: self.eta.observe(r.trial_id, r.step, r.steps, now) for r in rows if r.state == "running"}
        ended = sum(r.state in ENDED for r in rows)
        footer = Text(f"{ended}/{len(rows)} trials ended · Prefect and library logs: {self.log_path}", style="dim")
        if record.state == "running" or rows:
            for link in campaign_links(record):
                footer.append("\n")
                footer.append_text(linked(link, "dim"))
        if not rows:
            return Group(Text(f"campaign {self.name}: starting (Prefect's API, the checks, the first trials)…"), footer)
        return Group(trials_table(self.name, rows, etas, record.objective), footer)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._live.update(self.render())
            except Exception:  # a record half-replaced between reads: the next redraw shows it
                continue

    def __enter__(self) -> "LiveView":
        EVENTS.addHandler(self._events)
        self._live.__enter__()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        try:
            self._live.update(self.render())
        finally:
            self._live.__exit__(*exc)
            EVENTS.removeHandler(self._events)
            if not self.console.is_terminal:  # the last frame, printed once, ends without a newline
                self.console.line()
