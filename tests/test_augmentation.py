"""A dataset that augments at random draws the same for each micro-batch however the trial
runs (training.batches.SeededFetch): at one process or several, in loader workers or in
the trainer's process, from the first step or resumed midway; and a fetch leaves the
trainer's own random streams (dropout's) where they were.

The feeds run in a process of their own, as a trainer's do: loader workers come from a
fork server, which imports the dataset's module by name (here a file in the test's folder)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import REPO

DATASET = textwrap.dedent("""
    import random

    import numpy as np
    import torch
    from torch.utils.data import Dataset


    class Augmenting(Dataset):
        '''Sample i, with noise from each of the three streams an augmentation may draw from.'''

        def __len__(self):
            return 40

        def __getitem__(self, i):
            noise = [torch.rand(()).item(), random.random(), float(np.random.rand())]
            return torch.tensor([float(i), *noise]), i % 3
""")

FEEDS = textwrap.dedent("""
    import json, sys

    import torch

    from augmenting import Augmenting
    from training.batches import LoaderFeed, local_spans
    from training.data import SampleOrder

    BATCH, LOGICAL = 8, 4


    def drawn(world, first, last, workers, max_device_batch):
        '''Each step's global batch as the `world` processes fetch it, rank after rank.'''
        steps = [[] for _ in range(first, last)]
        for rank in range(world):
            feed = LoaderFeed(Augmenting(), SampleOrder(40, seed=7), BATCH, torch.device("cpu"), workers)
            spans = local_spans(BATCH, LOGICAL, world, rank, max_device_batch)
            batches = feed.batches(first, last, spans)
            for k in range(last - first):
                for _ in spans:
                    x, _ = next(batches)
                    steps[k].extend(x.tolist())
            feed.close()
        return steps


    if __name__ == "__main__":
        out = {}
        for world in (1, 2, 4):
            out[f"world {world}"] = drawn(world, 0, 8, 0, None)
        out["micro-batches of 1"] = drawn(2, 0, 8, 0, 1)
        out["resumed at step 5"] = drawn(1, 5, 8, 0, None)
        out["two workers"] = drawn(2, 0, 8, 2, None)
        torch.manual_seed(3)
        untouched = torch.rand(4).tolist()
        torch.manual_seed(3)
        drawn(1, 0, 2, 0, None)
        out["streams after a fetch"] = [untouched, torch.rand(4).tolist()]
        json.dump(out, sys.stdout)
""")


@pytest.fixture(scope="module")
def draws(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("augmenting")
    (folder / "augmenting.py").write_text(DATASET)
    (folder / "feeds.py").write_text(FEEDS)
    done = subprocess.run([sys.executable, str(folder / "feeds.py")], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": f"{folder}{os.pathsep}{REPO}"})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_the_draws_do_not_depend_on_the_number_of_processes_or_micro_batches(draws):
    one = draws["world 1"]
    assert len(one) == 8 and all(len(step) == 8 for step in one)
    assert len({tuple(sample[1:]) for step in one for sample in step}) == 64  # noise indeed, fresh for each sample
    assert draws["world 2"] == one and draws["world 4"] == one
    # Micro-batches of one sample: each drawn under its own seed, so not the same noise as
    # whole shares; still the same samples in the same order.
    assert [[s[0] for s in step] for step in draws["micro-batches of 1"]] == [[s[0] for s in step] for step in one]


def test_a_resume_draws_what_the_run_from_the_start_drew(draws):
    assert draws["resumed at step 5"] == draws["world 1"][5:]


def test_loader_workers_draw_what_the_trainers_process_draws(draws):
    assert draws["two workers"] == draws["world 1"]


def test_a_fetch_leaves_the_trainers_streams_where_they_were(draws):
    untouched, after = draws["streams after a fetch"]
    assert after == untouched
