"""An elastic trial on a pool node: its node's lease follows its size, before the agent moves.

On one machine the campaign's lease file is the host's, and a grow is leased there before
the agent is told. On a pool node the campaign's leases are in its own file, on the head;
the node's file, which every campaign sharing the pool respects, is the segment's to keep.
So the agent reads its commands from a folder of its own (`control/node-<node>`), and the
segment relays them from the campaign's (`control`):

- a command that adds devices is forwarded only once the node's lease file gave them to
  this trial; if another campaign holds one, the command is not forwarded and the campaign
  finds `control/refused-<seq>.json` for it (`flows.run.live.serve_resizes` answers the
  request rejected and gives back what it leased);
- the agent's `state.json` is copied back, with the campaign's sequence numbers, and the
  devices a shrink or a preemption let go are released in the node's file after the agent
  says it let go of them.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

from cluster.leases import LeaseError, LeaseStore, LeaseStoreError
from cluster.types import WHOLE_DEVICE, claim_bytes
from training.agent_commands import clear_commands, read_command, refuse
from training.agent_state import read_agent_state

POLL_S = 0.05  # a resize waits for its joiners' start-up (seconds) anyway


class CommandRelay:
    def __init__(self, outer: Path, inner: Path, store: LeaseStore, holder: str, capacity: dict[str, int], held: list[str],
                 memory_bytes: int = WHOLE_DEVICE):
        self.outer, self.inner = outer, inner
        self.store, self.holder, self.capacity = store, holder, capacity
        self.memory_bytes = memory_bytes  # per device: what a grow leases of each new one (claim_bytes)
        self.held = set(held)  # devices this trial holds in the node's lease file
        self.next_outer, self.next_inner = 1, 1  # sequence 0 (the start) is the launch's, in both folders
        self.to_outer = {0: 0}  # the agent's sequence numbers -> the campaign's
        self.last_state: dict | None = None
        self._stop = threading.Event()
        self.rounds = 0  # relay rounds done: what a test waits on to see that nothing was relayed
        self._thread = threading.Thread(target=self._run, name="command-relay", daemon=True)

    def __enter__(self) -> "CommandRelay":
        # The agent's folder may hold an earlier segment's commands and state (shared storage):
        # a stale "running on <other devices>" would read as a shrink and release our lease.
        # The launch clears it too, but only after this thread has started reading it.
        clear_commands(self.inner)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.relay_state()  # the agent's last word (finished, preempted) reaches the campaign

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                self.relay_commands()
                self.relay_state()
            except Exception as e:  # the relay must outlive any one round: what failed is tried again next round
                print(f"command relay of {self.holder}: {e.__class__.__name__}: {e}; trying again", file=sys.stderr, flush=True)
            self.rounds += 1

    def relay_commands(self) -> None:
        while (command := read_command(self.outer, self.next_outer)) is not None:
            # This node's devices only: another node's are leased in its own file by its host's segment.
            new = [d for d in command.device_ids if d not in self.held and d in self.capacity]
            claims = {d: claim_bytes(self.memory_bytes, self.capacity[d]) for d in new}
            try:
                granted = not new or self.store.acquire(self.holder, claims, self.capacity)
                why = f"{', '.join(new)} held by another campaign"
            except (LeaseError, LeaseStoreError) as e:  # the file locked too long, or unusable: this grow waits for none
                granted, why = False, str(e)
            if not granted:
                # Not forwarded: the agent never sees it, and the campaign is told why.
                refuse(self.outer, self.next_outer, f"node lease file: {why}")
                self.next_outer += 1
                continue
            self.held.update(new)
            command.renumbered(self.next_inner).write(self.inner)
            self.to_outer[self.next_inner] = self.next_outer
            self.next_outer += 1
            self.next_inner += 1

    def relay_state(self) -> None:
        state = read_agent_state(self.inner)
        if state is None or state == self.last_state:
            return
        if state.status == "running":
            if left := [d for d in self.held if d not in state.devices]:  # a shrink the agent has applied
                self.store.release_devices(self.holder, left)  # if this fails, the state is relayed again next round
                self.held -= set(left)
        self.last_state = state
        state.renumbered(self.to_outer.get(state.seq, state.seq)).write(self.outer)
