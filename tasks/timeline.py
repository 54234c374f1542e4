"""The device timeline of a campaign: who held which device when (a Gantt chart).

`intervals` is pure: it turns the allocation log (tasks.records.Allocation: one line per
start, resize, preemption and end) into one bar per device and holding. `draw` renders
them with matplotlib as PNG and as an HTML page (inline SVG), written next to the campaign
record and logged to the campaign's MLflow run.
"""

from __future__ import annotations

import io
import threading
from dataclasses import dataclass
from html import escape
from pathlib import Path
from typing import Any, Iterable

from tasks.hub_calls import in_hub
from tasks.records import Allocation, read_allocations


@dataclass(frozen=True)
class Bar:
    trial: str
    device: str
    start: float
    end: float
    ended_by: str  # the event that closed it: end, resize, preempted, failed, lease lost (or "running")


def intervals(events: Iterable[Allocation], now: float | None = None) -> list[Bar]:
    """One bar per device a trial held, from when it got it to the event that took it away."""
    holding: dict[str, tuple[float, list[str]]] = {}  # trial -> (since, devices)
    bars: list[Bar] = []
    last = 0.0
    for event in sorted(events, key=lambda e: e.time):
        trial, at, devices = event.trial, float(event.time), list(event.devices)
        last = max(last, at)
        since, held = holding.pop(trial, (at, []))
        # Every event closes the trial's bars (one kept through a resize goes on as the next bar, same colour).
        bars += [Bar(trial, device, since, at, event.reason) for device in held]
        if devices:
            holding[trial] = (at, devices)
    for trial, (since, held) in holding.items():  # still running when the log was read
        bars += [Bar(trial, device, since, max(last, now or last), "running") for device in held]
    return bars


# zlib's fastest level for the pictures' PNGs: drawn after the campaign's last trial, while
# its user waits; a 32-trial figure saved in 154-167 ms against 223-248 ms, 8 % larger.
FAST_PNG = {"compress_level": 1}


def import_matplotlib():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


@in_hub
def import_drawing_early() -> None:
    """Import matplotlib (~0.4 s here) on a thread while the trials train, where the pictures
    will be drawn: a campaign draws them after its last trial ends, and the user waits for
    that. (A campaign's hub has it imported before its first call, tasks/tracking_hub.py: this
    is for a campaign without one, a pool's.)"""
    threading.Thread(target=import_matplotlib, name="import-matplotlib", daemon=True).start()


LEGEND_ROW_IN = 0.19  # one legend line at fontsize "small", in inches
LEGEND_ROWS = 16  # a column of the legend holds this many trials before another starts


def figure(bars: list[Bar], title: str):
    """The chart, its legend beside it in as many columns as its trials need and the figure
    as tall as the longest column: every trial's name inside the picture, however many."""
    plt = import_matplotlib()

    devices = sorted({b.device for b in bars})
    trials = list(dict.fromkeys(b.trial for b in sorted(bars, key=lambda b: b.start)))
    colors = {t: plt.get_cmap("tab20")(i % 20) for i, t in enumerate(trials)}
    origin = min((b.start for b in bars), default=0.0)
    columns = max(1, -(-len(trials) // LEGEND_ROWS))
    rows = -(-len(trials) // columns) if trials else 0
    height = max(1.2 + 0.5 * max(1, len(devices)), 1.0 + LEGEND_ROW_IN * rows)
    longest = max((len(t) for t in trials), default=0)
    legend_width = columns * (0.6 + 0.075 * longest)  # inches: a swatch and the name
    fig, ax = plt.subplots(figsize=(8 + legend_width, height))
    for b in bars:
        row = devices.index(b.device)
        ax.broken_barh([(b.start - origin, max(b.end - b.start, 1e-3))], (row - 0.4, 0.8), facecolors=colors[b.trial], edgecolor="black", linewidth=0.3)
        if b.ended_by in ("preempted", "failed", "lease lost"):
            ax.plot(b.end - origin, row, marker="x", color="black")
    ax.set_yticks(range(len(devices)), devices)
    ax.set_xlabel("seconds since the first start")
    ax.set_title(title)
    fig.tight_layout(rect=(0, 0, 8 / (8 + legend_width), 1))  # the legend's room kept on the right
    if trials:
        handles = [plt.Rectangle((0, 0), 1, 1, color=colors[t]) for t in trials]
        fig.legend(handles, trials, loc="upper right", ncols=columns, fontsize="small", title="trial", frameon=False)
    return fig


def draw(bars: list[Bar], title: str, png: Path, html: Path) -> None:
    plt = import_matplotlib()
    fig = figure(bars, title)
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120, pil_kwargs=FAST_PNG)
    svg = io.StringIO()
    fig.savefig(svg, format="svg")
    plt.close(fig)
    html.write_text(f"<!doctype html><html><head><meta charset='utf-8'><title>{escape(title)}</title></head><body>"
                    f"<h1>{escape(title)}</h1>{svg.getvalue()[svg.getvalue().index('<svg'):]}</body></html>")


def timeline_rows(bars: list[Bar]) -> list[dict[str, Any]]:
    """The bars as table rows (the Prefect artifact): seconds since the first start, in start order."""
    origin = min((b.start for b in bars), default=0.0)
    return [{"trial": b.trial, "device": b.device, "from_s": round(b.start - origin, 1), "to_s": round(b.end - origin, 1),
             "held_s": round(b.end - b.start, 1), "ended_by": b.ended_by}
            for b in sorted(bars, key=lambda b: (b.start, b.device))]


@in_hub
def write_timeline(campaign_dir: Path | str, title: str) -> tuple[Path, Path] | None:
    """timeline.png and timeline.html in the campaign's folder, from its allocation log; None
    if nothing ran. Drawn in the campaign's hub when it has one (paths as strings then)."""
    campaign_dir = Path(campaign_dir)
    bars = intervals(read_allocations(campaign_dir))
    if not bars:
        return None
    png, html = campaign_dir / "timeline.png", campaign_dir / "timeline.html"
    draw(bars, title, png, html)
    return png, html
