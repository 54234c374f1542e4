"""Where a campaign's and a trial's files live: the only module that knows their names.

Every other module asks for a path here (`trial_files(dir).progress`,
`campaign_files(dir).record`) and reads or writes it through training.files (bounded
reads, atomic writes); tests/test_layout.py fails if any other module names one of these
files. It sits in the lowest layer because the trainer writes some of them (progress,
result, resizes, the elastic agent's state) and every layer above reads them.

    <runs_dir>/latest                      the name of the campaign launched last
    <runs_dir>/<campaign>/campaign.json    the campaign record (tasks.records)
    <runs_dir>/<campaign>/allocations.jsonl  every device change of its trials
    <runs_dir>/<campaign>/<trial>/         one trial: see TrialFiles
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

LATEST = "latest"

# A name made from a user's values (a trial's grid point or search draw) becomes a folder: it
# must stay one path component inside its parent on every filesystem the runs folder may sit
# on. POSIX's portable filename characters only (no '/', NUL, quote, space or non-ASCII
# letter whose bytes or normal form differ between systems), never first a '-' (read as an
# option) or a '.' (hidden; '.' and '..' leave the folder), and far below NAME_MAX (255 bytes).
PORTABLE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")
NAME_MAX_BYTES = 255  # ext4, XFS, btrfs, APFS: the longest one path component may be
KEPT_NAME_CHARS = 160  # a portable text up to this long is its own name (every trial id made before this rule)
SLUG_CHARS = 48  # what is kept of a text that is not, before the hash of all of it


@dataclass(frozen=True)
class TrialFiles:
    """A trial's folder."""

    root: Path

    @property
    def config(self) -> Path:  # the TrialConfig its processes start from (training.config)
        return self.root / "trial.json"

    @property
    def log(self) -> Path:  # the trainer's output and errors
        return self.root / "train.log"

    @property
    def record(self) -> Path:  # the campaign's record of the trial (state, devices, MLflow run)
        return self.root / "record.json"

    @property
    def progress(self) -> Path:  # the trainer's latest step and metrics, once a second
        return self.root / "progress.json"

    @property
    def result(self) -> Path:  # written once, when the trial finished (training.result)
        return self.root / "result.json"

    @property
    def metrics_journal(self) -> Path:  # every metric the trial logged, the source MLflow is fed from (training.metrics_journal)
        return self.root / "metrics.jsonl"

    @property
    def failure(self) -> Path:  # how its segment's processes failed, the first failure kept (training.failure)
        return self.root / "failure.json"

    @property
    def batch(self) -> Path:  # the batch the scheduler chose for its size (goodput trials)
        return self.root / "batch.json"

    @property
    def resizes(self) -> Path:  # one line per resize an elastic trial went through
        return self.root / "resizes.jsonl"

    @property
    def checkpoints(self) -> Path:  # step-NNNNNNNN/ folders (training.manifest)
        return self.root / "checkpoints"

    @property
    def control(self) -> Path:  # commands to and answers from an elastic trial's agent
        return self.root / "control"

    @property
    def agent_state(self) -> Path:  # the elastic agent's devices and status
        return agent_state_in(self.control)

    @property
    def resize_request(self) -> Path:  # `campaign resize` asks here...
        return self.control / "request.json"

    @property
    def resize_answer(self) -> Path:  # ...and the campaign answers here
        return self.control / "request-result.json"

    @property
    def agent_store(self) -> Path:  # a pool trial's agent: where its store listens, for hosts on other nodes
        return self.control / "agent-store.json"

    def host_status(self, node: str) -> Path:  # a pool trial's host on another node: leased and started, or refused
        return self.control / f"{HOST_PREFIX}{node}.json"

    @property
    def hold(self) -> Path:  # tests: while it exists, the trainer waits at its hold step (CAMPAIGN_HOLD_AT_STEP)
        return self.root / "hold"

    def rendezvous(self, attempt: int) -> Path:  # a pool trial's rendezvous for one attempt
        return self.control / f"rendezvous-{attempt}.json"

    def stop(self, attempt: str) -> Path:  # asks one attempt of a pool trial across nodes to stop (training.train.StopFile)
        return self.control / f"stop-{attempt}"

    @property
    def launch(self) -> Path:  # the pool launch whose processes may write here (a shared folder): training.fence
        return self.root / "launch.json"


@dataclass(frozen=True)
class CampaignFiles:
    """A campaign's folder: its record, its allocation log and one folder per trial."""

    root: Path

    @property
    def record(self) -> Path:
        return self.root / "campaign.json"

    @property
    def allocations(self) -> Path:
        return self.root / "allocations.jsonl"

    @property
    def study(self) -> Path:
        """A search's Optuna study (tasks/search.py), a journal of its changes."""
        return self.root / "search.journal"

    @property
    def sqlite_study(self) -> Path:
        """Where a search's study was kept before the journal (SQLite): taken over once."""
        return self.root / "search.db"

    def trial(self, trial_id: str) -> TrialFiles:
        return TrialFiles(self.root / one_component(trial_id))


def portable_name(text: str) -> str:
    """A folder name for `text` (a trial's grid point, e.g. "lr0.1-width16").

    `text` itself when it is a portable name (PORTABLE_NAME) of at most KEPT_NAME_CHARS: the
    ids of trials made before this rule are unchanged, so their folders are found again.
    Anything else becomes a slug (each run of other characters one '_', no leading '.' or
    '-', at most SLUG_CHARS) and the first 8 hex digits of the SHA-256 of the whole text, so
    two texts that slug alike still get two names; never '.', '..', empty, or over 60 bytes.
    """
    if len(text) <= KEPT_NAME_CHARS and PORTABLE_NAME.fullmatch(text):
        return text
    # surrogatepass: a lone surrogate cannot be UTF-8, but it can still be hashed
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:8]
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", text)[:SLUG_CHARS].lstrip(".-")
    return f"{slug}-{digest}" if slug else digest


def one_component(name: str) -> str:
    """`name` when it names an entry inside a folder (no '/', NUL, '.', '..', at most
    NAME_MAX_BYTES); else ValueError: a trial id read from a record or typed by a user
    must never lead a path out of its campaign's folder."""
    if (not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name
            or len(name.encode("utf-8", "surrogatepass")) > NAME_MAX_BYTES):
        raise ValueError(f"{name!r} is not a trial id (one name of at most {NAME_MAX_BYTES} bytes, no '/')")
    return name


def trial_files(trial_dir: str | Path) -> TrialFiles:
    return TrialFiles(Path(trial_dir))


def campaign_files(campaign_dir: str | Path) -> CampaignFiles:
    return CampaignFiles(Path(campaign_dir))


def of_node(path: str | Path, node: str) -> Path:
    """A node's own copy of a trial's file (`trial-b.json`, `train-b.log`): a node other than the
    trial's first keeps its config (its own lease and folder) and its log under its name."""
    path = Path(path)
    return path.with_name(f"{path.stem}-{node}{path.suffix}")


def agent_state_in(control: str | Path) -> Path:
    """The elastic agent's state file in a control folder (a trial's, or a relay's inner one)."""
    return Path(control) / "state.json"


def command_in(control: str | Path, seq: int) -> Path:
    """Command `seq` to an elastic trial's agent (training.agent_commands): 0 starts it."""
    return Path(control) / f"{COMMAND_PREFIX}{seq:06d}.json"


def refusal_in(control: str | Path, seq: int) -> Path:
    """Where a pool node's relay or the agent says it did not apply command `seq`."""
    return Path(control) / f"{REFUSAL_PREFIX}{seq:06d}.json"


COMMAND_PREFIX, REFUSAL_PREFIX, HOST_PREFIX = "command-", "refused-", "host-"
COMMANDS_GLOB, REFUSALS_GLOB = f"{COMMAND_PREFIX}*.json", f"{REFUSAL_PREFIX}*.json"


def campaign_records(runs_dir: str | Path) -> list[Path]:
    """Every campaign's record under a runs folder, by name."""
    return sorted(Path(runs_dir).glob("*/campaign.json"))


def latest_pointer(runs_dir: str | Path) -> Path:
    return Path(runs_dir) / LATEST


# Every file name above: no other module may spell one (tests/test_layout.py).
FILE_NAMES = ("trial.json", "train.log", "record.json", "progress.json", "result.json", "metrics.jsonl", "failure.json", "batch.json", "resizes.jsonl",
              "state.json", "request.json", "request-result.json", "campaign.json", "allocations.jsonl", "agent-store.json",
              "search.journal", "search.db", "launch.json")
