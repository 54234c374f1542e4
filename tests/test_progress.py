"""progress.json has one owner (training.progress): what both loops write, every reader takes."""

from __future__ import annotations

import json
import os

import pytest

from tasks.records import trial_status
from training.layout import trial_files
from training.progress import SCHEMA, progress_now, read_progress


def test_a_progress_record_reads_back_as_written(tmp_path):
    progress_now("running", 12, 100, 2, 64, {"train_loss": 0.5, "step_time_s": 0.01}, samples_seen=768).write(tmp_path)
    progress = read_progress(tmp_path)
    assert (progress.state, progress.step, progress.world_size, progress.samples_seen, progress.schema) == ("running", 12, 2, 768, SCHEMA)
    assert progress.metrics == {"train_loss": 0.5, "step_time_s": 0.01}
    assert trial_status(tmp_path, "t", "t", 100).step == 12


@pytest.mark.parametrize("content, why", [
    ({"state": "running", "step": 3}, "schema None, not 1"),
    ({"schema": SCHEMA + 1}, "written by another version"),
    ({"schema": SCHEMA, "state": "running", "step": "3", "steps": 9, "world_size": 1, "batch_size": 8, "samples_seen": 0,
      "metrics": {}, "updated": 0.0}, "step is not a whole number"),
    ({"schema": SCHEMA, "state": "running", "step": 3, "steps": 9, "world_size": 1, "batch_size": 8, "samples_seen": 0,
      "metrics": {"loss": "low"}, "updated": 0.0}, "metrics are not numbers"),
    ([1, 2], "not a JSON object"),
])
def test_a_file_that_is_not_a_progress_record_reads_as_none_and_says_why(tmp_path, content, why):
    trial_files(tmp_path).progress.write_text(json.dumps(content))
    with pytest.warns(UserWarning, match=why):
        assert read_progress(tmp_path) is None
    with pytest.warns(UserWarning):
        assert trial_status(tmp_path, "t", "t", 9).step == 0  # status goes on without it


def test_a_fifo_in_its_place_is_refused_without_blocking(tmp_path):
    os.mkfifo(trial_files(tmp_path).progress)
    with pytest.warns(UserWarning, match="FIFO"):
        assert read_progress(tmp_path) is None
