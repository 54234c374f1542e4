"""One owner for the names of a campaign's and a trial's files: training/layout.py.

Any other module of the product that spells one of them (as a string of its own, or the
end of a path in one) is reported with its file and line: it must ask training.layout
for the path instead, so that a file is renamed or moved in one place.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from training.layout import COMMAND_PREFIX, FILE_NAMES, REFUSAL_PREFIX, CampaignFiles, TrialFiles

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("flows", "tasks", "cluster", "training")
OWNER = REPO / "training" / "layout.py"
# The numbered files of a control folder: a name's head in an f-string, a glob, or a whole name.
NUMBERED = re.compile(rf"(^|/)({re.escape(COMMAND_PREFIX)}|{re.escape(REFUSAL_PREFIX)})($|\*|\d)")


def spelled_names(root: Path) -> list[str]:
    found = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            if path == OWNER:
                continue
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    text = node.value
                    if any(text == name or text.endswith("/" + name) for name in FILE_NAMES) or NUMBERED.search(text):
                        found.append(f"{path.relative_to(root)}:{node.lineno} spells {text!r}")
    return found


def test_no_module_but_the_layout_spells_a_record_file_name():
    assert spelled_names(REPO) == []


def test_the_check_sees_a_spelled_name(tmp_path):
    for package in PACKAGES:
        (tmp_path / package).mkdir()
    (tmp_path / "tasks" / "bad.py").write_text('"""Reads progress.json (a docstring may say so)."""\nPATH = "progress.json"\n'
                                             'NEXT = f"command-{seq:06d}.json"\nTHREAD = "command-relay"\n')
    assert spelled_names(tmp_path) == ["tasks/bad.py:2 spells 'progress.json'", "tasks/bad.py:3 spells 'command-'"]


def test_every_name_the_layout_hands_out_is_listed_and_distinct():
    trial, campaign = TrialFiles(Path("t")), CampaignFiles(Path("c"))
    paths = [getattr(trial, name) for name in dir(TrialFiles) if isinstance(getattr(TrialFiles, name), property)]
    paths += [getattr(campaign, name) for name in dir(CampaignFiles) if isinstance(getattr(CampaignFiles, name), property)]
    files = [p.name for p in paths if p.suffix]  # the folders (checkpoints, control) have none
    assert sorted(files) == sorted(FILE_NAMES) and len(set(paths)) == len(paths)
