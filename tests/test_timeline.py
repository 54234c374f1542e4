"""The device timeline's picture: every trial's name inside it, however many trials."""

from __future__ import annotations

import pytest

from tasks.timeline import Bar, figure


@pytest.mark.parametrize("trials", [1, 8, 32, 100])
def test_the_legend_names_every_trial_inside_the_picture_beside_the_chart(trials):
    bars = [Bar(f"lr{0.001 * i:.3f}-3fc758cc", f"vm/cpu{i % 2}", i, i + 1.5, "end") for i in range(trials)]
    fig = figure(bars, "a campaign")
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == [b.trial for b in bars]
    box, chart = legend.get_window_extent(renderer), fig.axes[0].get_tightbbox(renderer)
    assert box.x0 >= 0 and box.y0 >= 0 and box.x1 <= fig.bbox.x1 and box.y1 <= fig.bbox.y1  # not cut off
    assert chart.x1 <= box.x0  # nor over the bars
