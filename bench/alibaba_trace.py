"""The Alibaba GPU-sharing trace as an Inventory and a list of Requests, for the benches.

Source: Alibaba cluster-trace-gpu-v2023 (github.com/alibaba/clusterdata), from Weng et al.,
"Beware of Fragmentation: Scheduling GPU-Sharing Workloads with Fragmentation Gradient
Descent", USENIX ATC'23. Shipped gzip-compressed in data/traces/ (see its README.md).

Memory model: every GPU is 1000 units, the trace's own `gpu_milli` scale, whatever its model.
The trace states GPU demand only as a share of one GPU (no task names a GPU type), so
mapping it onto real per-model memory would invent numbers (the G2 and G3 models are not
public); 1000 units keeps the task mix exactly as the paper replays it. A task with
`num_gpu` n > 1 asks for n whole GPUs (its `gpu_milli` is 1000).
"""

from __future__ import annotations

import csv
import gzip
from dataclasses import dataclass
from pathlib import Path

from cluster.types import Device, Inventory, Request
from training.errors import CampaignError

TRACE_DIR = Path(__file__).resolve().parent.parent / "data" / "traces"
NODES_FILE = "openb_node_list_gpu_node.csv"
POD_LISTS = ("default", "gpushare100", "multigpu50")
GPU_UNITS = 1000  # memory of one GPU in this model: gpu_milli's thousandths of a GPU
CITATION = (
    "Trace: Alibaba cluster-trace-gpu-v2023 (github.com/alibaba/clusterdata), Weng et al., "
    "'Beware of Fragmentation: Scheduling GPU-Sharing Workloads with Fragmentation "
    "Gradient Descent', USENIX ATC'23."
)


@dataclass(frozen=True, slots=True)
class PodList:
    """The GPU tasks of one pod list in arrival order, and how many asked for no GPU."""

    name: str
    requests: tuple[Request, ...]
    cpu_only: int
    timed: bool  # False: the file has no creation_time, so `requests` is in file order


def _rows(path: Path, needed: tuple[str, ...]) -> list[dict[str, str]]:
    if not path.exists() and path.with_name(path.name + ".gz").exists():
        path = path.with_name(path.name + ".gz")  # the repository ships the traces compressed
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in needed if c not in (reader.fieldnames or ())]
        if missing:
            raise CampaignError(f"{path}: missing column(s) {missing}; is this a trace file?")
        return list(reader)


def _int(path: Path, line: int, row: dict[str, str], column: str) -> int:
    try:
        return int(row[column])
    except (TypeError, ValueError):
        raise CampaignError(
            f"{path}, line {line}: {column}={row[column]!r} is not an integer"
        ) from None


def load_nodes(trace_dir: Path = TRACE_DIR) -> Inventory:
    """One Device of GPU_UNITS per GPU of each node; no link data, so pairs default."""
    path = trace_dir / NODES_FILE
    devices = []
    for line, row in enumerate(_rows(path, ("sn", "gpu", "model")), start=2):
        for i in range(_int(path, line, row, "gpu")):
            devices.append(
                Device(f"{row['sn']}/gpu{i}", row["sn"], i, "gpu", row["model"], GPU_UNITS)
            )
    return Inventory(tuple(devices))


def load_pods(name: str = "default", trace_dir: Path = TRACE_DIR) -> PodList:
    """The GPU tasks of openb_pod_list_<name>.csv by creation_time (file order if absent)."""
    path = trace_dir / f"openb_pod_list_{name}.csv"
    rows = _rows(path, ("name", "num_gpu", "gpu_milli"))
    timed = bool(rows) and "creation_time" in rows[0]
    tasks: list[tuple[int, Request]] = []
    cpu_only = 0
    for line, row in enumerate(rows, start=2):
        gpus = _int(path, line, row, "num_gpu")
        milli = _int(path, line, row, "gpu_milli")
        if gpus == 0:
            cpu_only += 1
            continue
        if not 0 < milli <= GPU_UNITS or (gpus > 1 and milli != GPU_UNITS):
            raise CampaignError(
                f"{path}, line {line}: num_gpu={gpus} with gpu_milli={milli}; expected "
                f"1..{GPU_UNITS} for one GPU and {GPU_UNITS} for several"
            )
        arrival = _int(path, line, row, "creation_time") if timed else line
        tasks.append((arrival, Request(row["name"], gpus, milli)))
    tasks.sort(key=lambda t: t[0])  # stable: equal times keep file order
    return PodList(name, tuple(r for _, r in tasks), cpu_only, timed)
