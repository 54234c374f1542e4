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

from dataclasses import dataclass
from pathlib import Path

LATEST = "latest"


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

    def trial(self, trial_id: str) -> TrialFiles:
        return TrialFiles(self.root / trial_id)


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
FILE_NAMES = ("trial.json", "train.log", "record.json", "progress.json", "result.json", "batch.json", "resizes.jsonl",
              "state.json", "request.json", "request-result.json", "campaign.json", "allocations.jsonl", "agent-store.json")
