"""A trial's folder on pool nodes that share no storage with the campaign
(`cluster.shared_storage: false`).

Each node keeps the trial in a folder of its own (`node_trial_dir`). Prefect artifacts carry
the trial's small files between those folders and the campaign's copy, through the Prefect
server every node already reaches; each is created once and updated in place:

- up, one artifact per segment (node → campaign): what the segment wrote since it began,
  whole (progress, result, record, an elastic agent's state, a relay's refusals, the host
  node's rendezvous endpoint; not its config, which names the node's paths), and what it
  added to its logs and resize log, appended to the campaign's copy after what earlier
  segments wrote;
- down, one artifact per attempt (campaign → every node of it): the files the campaign
  writes for the trial (the scheduler's batch, an elastic agent's commands, stop files, a
  test's hold file), whole, and deleted on the nodes when the campaign deletes them; the
  host's rendezvous endpoint, for the other nodes; an elastic agent's state, for the nodes
  that host its workers (a host ends when the state no longer names its node's devices);
  and the trial's record when the attempt began, which seeds the node's record before its launch.

Checkpoints do not travel here: the trainer pushes each verified one to `tracking.dvc_remote`
and a node resuming the trial pulls it (training/checkpoint_remote.py; across nodes rank 0
writes the whole checkpoint: training/checkpoint.py). Each side copies every `MIRROR_S`, so
the campaign sees a node's files about a second later than through a shared folder.
"""

from __future__ import annotations

import fnmatch
import os
import re
import threading
from pathlib import Path
from typing import Any

from training.files import write_atomic
from training.layout import COMMANDS_GLOB, of_node, trial_files

MIRROR_S = 1.0  # how often each side copies
MAX_FILE_BYTES = 256 * 1024  # a whole file larger than this is not copied (none of the trial's records is near it)
MAX_APPENDED_BYTES = 256 * 1024  # of a segment's log, the newest this many bytes travel
WORK_DIR_ENV = "CAMPAIGN_NODE_WORK_DIR"  # set by `campaign worker --work-dir`: where a node keeps its trials


def _names(root: Path) -> dict[str, str]:
    """The trial folder's files by role, as paths relative to its root (training.layout names them)."""
    files = trial_files(root)
    rel = lambda path: path.relative_to(root).as_posix()  # noqa: E731
    return {"log": rel(files.log), "resizes": rel(files.resizes), "record": rel(files.record), "batch": rel(files.batch),
            "config": rel(files.config), "hold": rel(files.hold), "control": rel(files.control),
            "checkpoints": rel(files.checkpoints), "rendezvous": rel(files.rendezvous(0)).replace("-0.", "-*.")}


def _down_patterns(root: Path) -> tuple[str, ...]:
    """What the campaign writes for the trial while it runs: the nodes only read these."""
    n = _names(root)
    return n["hold"], n["batch"], f"{n['control']}/{COMMANDS_GLOB}", f"{n['control']}/stop-*"


def _relayed_patterns(root: Path) -> tuple[str, ...]:
    """What one node writes for the others (the host node's rendezvous endpoint of a trial
    across nodes): up from it, then down to every node."""
    return (_names(root)["rendezvous"],)


def _hosted_patterns(root: Path) -> tuple[str, ...]:
    """What the agent's node writes for the nodes that host its workers (its state, whose
    devices tell a host when its node has no part left): up from it, then down to the hosts
    only. Never down to the agent's node, whose relay writes it there."""
    return (trial_files(root).agent_state.relative_to(root).as_posix(),)


def _appended_patterns(root: Path) -> tuple[str, ...]:
    """Files each segment appends to (the log, each other node's log of a trial across nodes,
    the resize log): only its part travels, after the earlier segments'."""
    n = _names(root)
    return n["log"], of_node(n["log"], "*").as_posix(), n["resizes"]


def _config_patterns(root: Path) -> tuple[str, ...]:
    """A node's config of the trial (`trial.json`, or `trial-<node>.json` on a node that is not
    the trial's first): its own paths and lease, never copied up."""
    config = _names(root)["config"]
    return config, of_node(config, "*").as_posix()


def _matches(rel: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(rel, pattern) for pattern in patterns)


def _small_files(root: Path) -> dict[str, Path]:
    """The folder's files a copy carries: not its checkpoints (the DVC remote's), not a relay's
    inner folder (`control/node-*`, the node's own), not a temporary file being written."""
    n = _names(root)
    skipped = {n["checkpoints"]}
    found = {}
    for folder, dirs, files in os.walk(root):
        here = Path(folder).relative_to(root).as_posix()
        prefix = "" if here == "." else here + "/"
        # Not walked into at all: a checkpoint folder holds many files, and this runs every second.
        dirs[:] = [d for d in dirs if prefix + d not in skipped and not (prefix + d).startswith(n["control"] + "/node-")]
        for name in files:
            if not name.startswith("."):
                found[prefix + name] = Path(folder) / name
    return found


def _read(path: Path, limit: int) -> str | None:
    try:
        if path.stat().st_size > limit:
            return None
        return path.read_bytes().decode("utf-8", errors="replace")
    except OSError:
        return None  # gone while listed


def _write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    if _read(path, MAX_FILE_BYTES * 4) == text:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, text.encode())


# --- the two copies (files only: no I/O with Prefect) ----------------------------------

def _stamp(path: Path) -> tuple[int, int, int] | None:
    """A file's inode, mtime and size (None: it is gone)."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


def file_stamps(root: Path) -> dict[str, tuple[int, int, int]]:
    """Each file's stamp when a segment begins. A file whose stamp is unchanged was not written
    by the segment. Compared, not timed: an mtime comes from the kernel's coarse clock and can
    read a few milliseconds before a `time.time()` taken ahead of the write."""
    return {rel: stamp for rel, path in _small_files(root).items() if (stamp := _stamp(path)) is not None}


def up_snapshot(root: Path, since: dict[str, int], before: dict[str, tuple[int, int, int]],
                hosting: bool = False) -> dict[str, Any]:
    """The node's side: what this segment wrote, for the campaign. Whole files changed since
    `before` (their stamps when it began: not another segment's left on this node, nor the
    record it was seeded with); of each appended file, what it added past its size when the
    segment began (`since`).
    `hosting`: the segment hosts workers of an agent on another node, whose state it was sent."""
    appended, down = _appended_patterns(root), _down_patterns(root) + (_hosted_patterns(root) if hosting else ())
    whole, added = {}, {}
    for rel, path in _small_files(root).items():
        if _matches(rel, appended):
            try:
                with open(path, "rb") as f:
                    start = since.get(rel, 0)
                    size = f.seek(0, os.SEEK_END)
                    if size <= start:
                        continue
                    f.seek(max(start, size - MAX_APPENDED_BYTES))
                    added[rel] = f.read().decode("utf-8", errors="replace")
            except OSError:
                continue
        elif not _matches(rel, down + _config_patterns(root)):
            if (stamp := _stamp(path)) is None or before.get(rel) == stamp:
                continue
            if (text := _read(path, MAX_FILE_BYTES)) is not None:
                whole[rel] = text
    return {"files": whole, "appended": added}


def apply_up(root: Path, snapshot: dict[str, Any], base: dict[str, int]) -> None:
    """The campaign's side: a node's files into its copy of the folder. `base`: each
    appended file's size here before that node's segment (what earlier segments wrote stays)."""
    for rel, text in snapshot.get("files", {}).items():
        if not _matches(rel, _down_patterns(root)):
            _write(root, rel, text)
    for rel, text in snapshot.get("appended", {}).items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "ab+") as f:  # what earlier segments wrote, then this one's part
            f.truncate(base.get(rel, 0))
            f.write(text.encode())


def down_snapshot(root: Path, seed: dict[str, str] | None = None) -> dict[str, Any]:
    """The campaign's side: the files it writes for the trial and those one node wrote for the
    others, and `seed` (the trial's record when the segment was sent, which the node's segment
    goes on from)."""
    patterns = _down_patterns(root) + _relayed_patterns(root) + _hosted_patterns(root)
    files = {rel: text for rel, path in _small_files(root).items()
             if _matches(rel, patterns) and (text := _read(path, MAX_FILE_BYTES)) is not None}
    return {"files": files, "seed": seed or {}}


def record_seed(root: Path) -> dict[str, str]:
    rel = _names(root)["record"]
    text = _read(root / rel, MAX_FILE_BYTES)
    return {rel: text} if text is not None else {}


def apply_down(root: Path, snapshot: dict[str, Any], seed: bool = False, hosting: bool = False) -> None:
    """The node's side: the campaign's files into the node's folder (`seed`: the record too,
    before the launch); one the campaign deleted goes here too. The agent's state only to a
    node that hosts its workers (`hosting`)."""
    hosted = () if hosting else _hosted_patterns(root)
    files = {rel: text for rel, text in snapshot.get("files", {}).items() if not _matches(rel, hosted)}
    for rel, text in {**(snapshot.get("seed", {}) if seed else {}), **files}.items():
        _write(root, rel, text)
    for rel, path in _small_files(root).items():
        if _matches(rel, _down_patterns(root)) and rel not in files:
            path.unlink(missing_ok=True)


def appended_sizes(root: Path) -> dict[str, int]:
    """Each appended file's size now (one not there yet starts at 0)."""
    sizes = {}
    for rel, path in _small_files(root).items():
        if _matches(rel, _appended_patterns(root)):
            try:
                sizes[rel] = path.stat().st_size
            except OSError:
                pass
    return sizes


# --- carried by Prefect artifacts --------------------------------------------------------

def artifact_key(attempt: str, direction: str) -> str:
    """An artifact key (lowercase letters, digits, dashes) for one attempt's copies."""
    return re.sub(r"[^a-z0-9-]", "-", f"trial-files-{attempt}-{direction}".lower())


class Channel:
    """One artifact, created on the first send (or found, when a run of the same segment made
    it before) and updated in place after it."""

    def __init__(self, key: str, description: str):
        self.key, self.description = key, description
        self._id = None
        self._last: Any = None

    def _find(self):
        from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

        from flows.pool.nodes import call

        found = call(lambda client: client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[self.key])), limit=1))
        return found[0] if found else None

    def send(self, data: dict[str, Any]) -> None:
        if data == self._last:
            return
        from prefect.client.schemas.actions import ArtifactCreate, ArtifactUpdate

        from flows.pool.nodes import call

        if self._id is None and (made := self._find()) is not None:
            self._id = made.id
        if self._id is None:
            made = call(lambda client: client.create_artifact(ArtifactCreate(
                key=self.key, type="campaign-files", description=self.description, data=data)))
            self._id = made.id
        else:
            call(lambda client: client.update_artifact(self._id, ArtifactUpdate(data=data)))
        self._last = data

    def receive(self) -> dict[str, Any] | None:
        found = self._find()
        return found.data if found is not None and isinstance(found.data, dict) else None


class NodeMirror:
    """A node's side, for one segment: the campaign's files down once before the launch,
    then both ways every MIRROR_S in a thread, and a last copy up when the segment ends."""

    def __init__(self, root: Path, keys: dict[str, str], trial: str, node: str, hosting: bool = False):
        """`keys`: the artifacts' keys the campaign chose for this segment ({"down", "up"}).
        `hosting`: the segment hosts workers of an agent on another node (it is sent its state)."""
        self.root, self.hosting = root, hosting
        self.down = Channel(keys["down"], f"trial {trial}: the campaign's files for its nodes")
        self.up = Channel(keys["up"], f"trial {trial}: node {node}'s files for the campaign")
        self.since: dict[str, int] = {}
        self.before: dict[str, tuple[int, int, int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trial-files", daemon=True)

    def __enter__(self) -> "NodeMirror":
        self.root.mkdir(parents=True, exist_ok=True)
        if (first := self.down.receive()) is not None:
            apply_down(self.root, first, seed=True, hosting=self.hosting)
        self.since, self.before = appended_sizes(self.root), file_stamps(self.root)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        self.up.send(self.snapshot())  # the segment's last word: its result, record and log

    def snapshot(self) -> dict[str, Any]:
        return up_snapshot(self.root, self.since, self.before, self.hosting)

    def _run(self) -> None:
        while not self._stop.wait(MIRROR_S):
            try:
                if (down := self.down.receive()) is not None:
                    apply_down(self.root, down, hosting=self.hosting)
                self.up.send(self.snapshot())
            except Exception as e:  # the server away a moment: the next copy catches up
                print(f"trial files: copy with the campaign failed ({e.__class__.__name__}: {e}); trying again", flush=True)


class CampaignMirror:
    """The campaign's side, for one attempt of a trial: `start` before its segments are sent
    (their files, with the record, are there when they begin), `add` each node it is sent to,
    `tick` while it runs, `pull` once it ended. `add` may come from another thread (the
    campaign's loop starts a host segment while the trial's task copies)."""

    def __init__(self, root: Path, attempt: str, trial: str):
        self.root, self.attempt, self.trial = root, attempt, trial
        self.down = Channel(artifact_key(attempt, "down"), f"trial {trial}: the campaign's files for its nodes")
        self.ups: dict[str, tuple[Channel, dict[str, int]]] = {}  # node -> its channel, and what was here before it
        self._lock = threading.Lock()
        self.applied: dict[str, dict[str, Any]] = {}  # node -> the copy last applied from it (not applied again)
        self.seed: dict[str, str] = {}

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.seed = record_seed(self.root)
        self.down.send(down_snapshot(self.root, self.seed))

    def add(self, node: str) -> dict[str, str]:
        """A segment sent to `node`: the keys it copies through. Sent again (a node taken back),
        it gets a channel of its own: what its earlier segment copied here stays, once."""
        with self._lock:
            sent = sum(key.startswith(f"{node}#") for key in self.ups)
            up = artifact_key(self.attempt, f"up-{node}-{sent}")
            self.ups[f"{node}#{sent}"] = (Channel(up, f"trial {self.trial}: node {node}'s files"), appended_sizes(self.root))
        return {"down": self.down.key, "up": up}

    def tick(self) -> None:
        self.down.send(down_snapshot(self.root, self.seed))
        self.pull()

    def pull(self) -> None:
        with self._lock:
            ups = list(self.ups.items())
        for node, (channel, base) in ups:
            if (up := channel.receive()) is not None and up != self.applied.get(node):
                apply_up(self.root, up, base)
                self.applied[node] = up


def node_trial_dir(campaign: str, trial_id: str) -> Path:
    """Where this node keeps a trial of a campaign whose folder it does not see."""
    work = os.environ.get(WORK_DIR_ENV) or str(Path.home() / ".campaign" / "work")
    return Path(work).expanduser() / campaign / trial_id
