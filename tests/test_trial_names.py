"""A trial's folder is named from its grid point, and no value leads a path out of its campaign.

Grid and search values become trial ids (tasks/grid.py), and trial ids become folders under
`<runs_dir>/<campaign>/`. Whatever the value ('../../../x', 'a/b', unicode, 300 characters),
every path the trial writes stays in its campaign's folder, each name within the 255 bytes a
filesystem allows; the value itself reaches the trial's spec unchanged. A value no store can
hold (a NUL byte) is refused by the spec, naming the field.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tasks.grid import expand_grid
from training.layout import NAME_MAX_BYTES, PORTABLE_NAME, TrialFiles, campaign_files, of_node
from training.spec import SpecError, parse_spec

CAMPAIGN = "names"
KEY = "training.kwargs.tag"  # a function trial's keyword argument: any value the user's code takes


def spec_with(values: list) -> dict:
    return {"campaign": {"name": CAMPAIGN},
            "training": {"target": "mylab.loop:fit", "steps": 10, "batch_size": 4, "lr": 0.1, "kwargs": {"tag": "x"}},
            "grid": {KEY: values}}


def written_paths(trial_dir: TrialFiles) -> list[Path]:
    """Every file and folder the campaign, the trainer, an agent or a pool node writes for a trial (training/layout.py)."""
    names = [name for name in dir(TrialFiles) if isinstance(getattr(TrialFiles, name), property)]
    return ([trial_dir.root] + [getattr(trial_dir, name) for name in names]
            + [trial_dir.host_status("node-b"), trial_dir.rendezvous(3), trial_dir.stop("attempt"), of_node(trial_dir.config, "node-b")])


def assert_inside(path: Path, folder: Path) -> None:
    resolved, inside = os.path.realpath(path), os.path.realpath(folder)
    assert resolved.startswith(inside + os.sep), f"{path} leaves {folder}"
    for part in Path(resolved).relative_to(inside).parts:
        assert len(os.fsencode(part)) <= NAME_MAX_BYTES, f"{part!r} is longer than a file name may be"


# Text that means something to a path or a filesystem, mixed with any unicode text, or very long.
FRAGMENTS = st.sampled_from(["/", "..", ".", "\0", "\\", "-", " ", "~", "'", "é", "名", "\U0001f600", "\n", "\ud800", "a" * 120])
VALUES = st.one_of(
    st.lists(st.one_of(FRAGMENTS, st.text(max_size=12)), max_size=12).map("".join),
    st.text(min_size=200, max_size=400),
    st.text(alphabet=st.sampled_from("./"), min_size=1, max_size=30),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(VALUES, min_size=1, max_size=4, unique=True))
def test_any_grid_value_keeps_every_path_of_its_trial_inside_the_campaign(values):
    untextual = [v for v in values if "\0" in v or re.search("[\ud800-\udfff]", v)]
    if untextual:  # no process argument, file name or tracking database holds it: the spec says where it is
        message = str(pytest.raises(SpecError, parse_spec, spec_with(values)).value)
        assert f"grid.{KEY}[{values.index(untextual[0])}]" in message and ("NUL" in message or "surrogate" in message)
        return
    trials = expand_grid(parse_spec(spec_with(values)))
    assert [t.spec.training.kwargs["tag"] for t in trials] == values  # the value itself, as written, for the trial
    assert len({t.id for t in trials}) == len(values)
    with tempfile.TemporaryDirectory() as folder:
        runs = Path(folder) / "runs"
        campaign = campaign_files(runs / CAMPAIGN)
        for trial in trials:
            assert PORTABLE_NAME.fullmatch(trial.id) and trial.id not in (".", "..")
            for path in written_paths(campaign.trial(trial.id)):
                assert_inside(path, campaign.root)
            trial_dir = campaign.trial(trial.id)  # and the filesystem takes it (no ENAMETOOLONG, no stray folder)
            trial_dir.control.mkdir(parents=True)
            trial_dir.config.write_text("{}")
        assert sorted(p.name for p in campaign.root.iterdir()) == sorted(t.id for t in trials)


def test_safe_values_keep_the_ids_existing_campaigns_have():
    """A grid of ordinary values is named as before this rule: existing trials' folders are found again."""
    raw = yaml.safe_load((Path(__file__).resolve().parent.parent / "params.yaml").read_text())
    ids = sorted(t.id for t in expand_grid(parse_spec(raw)))
    assert ids == ["lr0.02-width16-f3d4d2da", "lr0.02-width8-198637bd", "lr0.1-width16-1d6bd000", "lr0.1-width8-ab2b9459"]
    long_but_safe = "v" * 100
    (trial,) = expand_grid(parse_spec(spec_with([long_but_safe])))
    assert trial.id.startswith(f"tag{long_but_safe}-")


def test_path_like_values_are_named_apart_and_kept_whole(tmp_path):
    trials = expand_grid(parse_spec(spec_with(["../../../x", "a/b", "a_b", "x" * 300, ".."])))
    ids = [t.id for t in trials]
    assert all(PORTABLE_NAME.fullmatch(i) and len(i) <= 100 for i in ids) and len(set(ids)) == 5, ids
    assert ids[1].startswith("taga_b-") and ids[2].startswith("taga_b-")  # slugged alike, told apart by the hash
    assert [t.spec.training.kwargs["tag"] for t in trials][:2] == ["../../../x", "a/b"]
    assert trials[3].label.endswith("…") and len(trials[3].label) < 80  # the label shows a long value cut


USER_LOOP = "def fit(ctx, tag=''):\n    pass\n"


def test_plan_with_path_values_names_folders_inside_the_runs_folder(tmp_path):
    """`campaign plan` on a spec whose grid holds '../../../x' and 'a/b': the trials it shows are
    portable names, and every file their trials would write lies in the campaign's folder."""
    from conftest import campaign_cli
    from training.spec import load_spec

    (tmp_path / "mylab").mkdir()
    (tmp_path / "mylab" / "__init__.py").write_text("")
    (tmp_path / "mylab" / "loop.py").write_text(USER_LOOP)
    project, runs = tmp_path / "project", tmp_path / "project" / "runs"
    raw = spec_with(["../../../x", "a/b"])
    raw.update(resources={"devices": 1}, cluster={"cpu_slots": 2},
               tracking={"mlflow_uri": f"sqlite:///{project}/mlflow.db", "runs_dir": str(runs), "summary": str(project / "s.json")})
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    result = campaign_cli("plan", "params.yaml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    trials = expand_grid(load_spec(tmp_path / "params.yaml"))
    for trial in trials:
        assert trial.id in result.stdout and PORTABLE_NAME.fullmatch(trial.id)
        for path in written_paths(campaign_files(runs / CAMPAIGN).trial(trial.id)):
            assert_inside(path, runs / CAMPAIGN)
    assert not project.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["mylab", "params.yaml"]  # plan writes nothing

    raw["grid"][KEY] = ["fine", "a\0b"]  # YAML's "\0": no store holds it
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    refused = campaign_cli("plan", "params.yaml", cwd=tmp_path)
    output = " ".join((refused.stdout + refused.stderr).split())
    assert refused.returncode == 2 and f"grid.{KEY}[1]" in output and "NUL" in output and "Traceback" not in output, output


def test_keys_and_values_mlflow_cannot_log_are_refused_by_the_spec():
    """Every field of a trial is an MLflow parameter: a key or a value MLflow refuses would fail the
    campaign after its flow started; the spec names it instead."""
    raw = spec_with(["ok"])
    raw["training"]["kwargs"]["it's"] = 1
    assert "training.kwargs.it's" in str(pytest.raises(SpecError, parse_spec, raw).value)
    message = str(pytest.raises(SpecError, parse_spec, spec_with(["y" * 7000])).value)
    assert f"grid.{KEY}[0]" in message and "6000" in message
