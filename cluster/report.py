"""The `campaign cluster` table: every device, who leases it, and what is left on it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from rich.table import Table

from cluster.inventory import DeviceUsage
from cluster.leases import Lease
from cluster.types import Inventory

_NONE = "-"


def render_cluster(inventory: Inventory, leases: Sequence[Lease], usage: Mapping[str, DeviceUsage]) -> Table:
    """One row per device: its memory, its holders and their bytes, what is free, load.

    "Unleased" is what the lease store could still give out; "live free" and "util" are
    what NVML measures now, including processes that hold no lease. Leases on devices the
    inventory does not know (another campaign's declared cluster) get rows of their own,
    so nothing leased is hidden.
    """
    by_device: dict[str, list[Lease]] = {}
    for lease in leases:
        by_device.setdefault(lease.device_id, []).append(lease)

    table = Table(
        title=f"{len(inventory.devices)} devices on {len(inventory.nodes)} node(s), "
        f"{len({lease.holder for lease in leases})} holder(s)"
    )
    for header in ("node", "#", "device", "kind", "memory", "leased by", "unleased", "live free", "util"):
        justify = "right" if header in ("#", "memory", "unleased", "live free", "util") else "left"
        table.add_column(header, justify=justify, overflow="fold")

    for device in inventory.devices:
        held = by_device.pop(device.id, [])
        leased = sum(lease.memory_bytes for lease in held)
        live = usage.get(device.id)
        table.add_row(
            device.node,
            str(device.index),
            device.id,
            f"{device.kind} {device.name}",
            _size(device.memory_bytes),
            _holders(held),
            _size(max(device.memory_bytes - leased, 0)),
            _size(live.free_bytes) if live else _NONE,
            f"{live.utilization_pct}%" if live and live.utilization_pct is not None else _NONE,
        )
    for device_id, held in by_device.items():
        table.add_row("?", _NONE, device_id, "not in inventory", _NONE, _holders(held), _NONE, _NONE, _NONE)
    return table


def _holders(held: Sequence[Lease]) -> str:
    return (
        "\n".join(
            f"{lease.holder} ({_size(lease.memory_bytes)})"
            for lease in sorted(held, key=lambda lease: lease.holder)
        )
        or _NONE
    )


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"
