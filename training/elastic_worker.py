"""One process of an elastic trial: trains through successive generations of its group.

Started by training/elastic.py, one per device. It builds its Trainer (imports, data,
model) *before* saying it is ready, so that a joining process costs the running trial no
time. Then, for each assignment the agent gives it:

    init the process group of generation g -> get the state (from the durable checkpoint,
    or in memory from rank 0 by broadcast) -> train until the agent asks to stop -> let go

Every `control_every` steps rank 0 looks for the agent's stop file and, when it is there,
names the step to stop at (two control steps on); every rank stops at that same step
boundary (StopFlag). A
process that is not in the next generation exits; the others keep their model, optimizer
and step in memory.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from training.config import TrialConfig
from training.failure import failures_recorded, targets_of, user_packages
from training.elastic_host import stop_key
from training.fence import stops_when_fenced, watch_lease
from training.files import read_json, write_json_atomic
from training.metrics import result_line
from training.process import die_with_parent, dump_stacks_on_request, skip_final_collection
from training.train import pick_device
from training.trainer import DistEnv, Trainer
from training.resize_log import ResizeEvent, append_resize

STORE_TIMEOUT = timedelta(days=7)  # a worker may wait a whole training generation for its next assignment


def comm_device(trainer: Trainer) -> torch.device:
    return trainer.device if trainer.device.type == "cuda" else torch.device("cpu")


def share_state(trainer: Trainer, rank: int, joiner: bool) -> None:
    """Rank 0 hands the whole training state to the joiners, through memory (collective)."""
    device = comm_device(trainer)
    payload = trainer.state_bytes() if rank == 0 else b""
    size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    dist.broadcast(size, src=0)
    if rank == 0:
        buffer = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
    else:
        buffer = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(buffer, src=0)
    if joiner:
        trainer.load_state_bytes(buffer.cpu().numpy().tobytes())


class StopFlag:
    """Turns the agent's stop file into one step at which every rank stops, with no
    collective and no round trip to another process.

    Rank 0 looks for the agent's file at each control step; when it finds it at control
    step c it writes "stop at c + 2 * control_every" next to it. The other ranks look for
    that file at their control steps, and every one has seen it by then:

    - A rank's step s ends with the gradient all-reduce of step s, which needs rank 0's
      part of step s, given after rank 0's check at every control step up to s.
    - On CPU (gloo) the host waits for that all-reduce, so any later check follows it.
    - On a GPU (NCCL) the host runs ahead of the device, so a rank other than 0 first waits
      for an event it recorded at its previous control step c + control_every: that event
      completes after the all-reduce of step c + control_every - 1, hence after rank 0's
      check at c. The event is one interval old, so the wait is free: the device finished
      that work long ago, and nothing drains the GPU's queue.

    On one node a file is the cheapest signal there is (a failed open, a few µs). What it
    replaces, rank 0's answer broadcast and waited for, cost every control step a round trip
    between the ranks: ~0.3 ms on this 2-core host (bench/control_cost.py), ~0.9 % of a 3.4 ms
    step, and on a GPU a host-device sync. A generation across nodes (`store`) reads the same
    two signals as keys of the agent's store: one round trip to the agent's node per control
    step and rank, and still no collective, so the ranks never wait on one another for it.
    """

    def __init__(self, path: Path, rank: int, control_every: int, device: torch.device, store: dist.Store | None = None):
        self.path, self.rank, self.lead = Path(path), rank, 2 * control_every
        self.at_path = self.path.with_name(self.path.name + ".at")
        # A generation across nodes: the same two signals as keys of the agent's store (stop_key),
        # one round trip per control step, since the other nodes do not see the agent's files.
        self.store = store
        self.on_gpu = device.type == "cuda"
        self.fence: torch.cuda.Event | None = None  # a rank other than 0 on a GPU: recorded at its previous check
        self.stop_at: int | None = None

    def __call__(self, step: int) -> bool:
        if self.stop_at is None:
            if self.rank == 0:
                if self.requested():
                    self.stop_at = step + self.lead
                    if self.store is not None:
                        self.store.set(stop_key(self.at_path), str(self.stop_at))
                    else:
                        write_json_atomic(self.at_path, self.stop_at, durable=False)
            else:
                if self.fence is not None:
                    self.fence.synchronize()
                self.stop_at = self._named_step()
                if self.on_gpu:
                    self.fence = torch.cuda.Event()
                    self.fence.record()
        return self.stop_at is not None and step >= self.stop_at

    def _named_step(self) -> int | None:
        if self.store is None:
            return read_json(self.at_path)
        key = stop_key(self.at_path)
        return int(self.store.get(key)) if self.store.check([key]) else None

    def requested(self) -> bool:
        """The agent has asked this generation to stop (a held trainer goes on to its stop step)."""
        if self.store is not None:
            return self.store.check([stop_key(self.path)])
        return self.path.exists()

    def request(self) -> dict:
        """What the agent asked (`{"save": bool}`), once it has asked."""
        if self.store is not None:
            return json.loads(self.store.get(stop_key(self.path)))
        return read_json(self.path)


def pause_breakdown(marks: dict[str, float]) -> dict[str, float]:
    """Where the pause went: the time up to each mark, for the marks after the last old step.

    The order differs by path: the fast resize starts joiners before the last step, the naive
    restart starts every process after it ("ready").
    """
    ordered = sorted((t, name) for name, t in marks.items() if t >= marks["last_step"])
    return {name: t - prev for (prev, _), (t, name) in zip(ordered, ordered[1:])}


def record_resize(trainer: Trainer, assignment: dict, timings: dict) -> None:
    """Rank 0 of a new generation: the event, in the trial's record and its MLflow run.

    A test that holds the trial at its control steps (hold_at_step) holds it at the new
    generation's first step too, until its next command: that wait is the test's, not the
    resize's, so it is left out of the pause and the latency and shown as `held`."""
    request = assignment.get("request")
    now = time.time()
    held = trainer.held_s - timings["held_before"]
    trained_at = now - held  # when the first step would have ended without the test's hold
    world = len(assignment["members"])
    trainer.metrics.log(trainer.progress_step, world_size=world)
    if not request:
        return
    marks = {
        "requested": request["requested_at"], "ready": request["ready_at"], "last_step": request["last_step_at"],
        "stopped": request["stopped_at"], "assigned": timings["assigned"], "process_group": timings["attached"],
        "state": timings["state"], "first_step": trained_at,
    }
    event = ResizeEvent(
        time=now, step=trainer.step, seq=request["seq"], mode=request["mode"],
        before=tuple(request["from"]), after=tuple(request["to"]),
        pause_s=trained_at - request["last_step_at"], latency_s=trained_at - request["requested_at"],
        # What the new size trains with: the same batch (reproducible), or its own (goodput).
        batch_size=trainer.phase.batch_size, lr=trainer.start_lr, samples_seen=trainer.phase.samples,
        goodput=trainer.cfg.goodput, pause_breakdown_s=pause_breakdown(marks) | ({"held": held} if held > 0 else {}))
    append_resize(trainer.cfg.trial_dir, event)
    trainer.metrics.log(trainer.progress_step, resize_pause_s=event.pause_s, resize_latency_s=event.latency_s)
    # Readable on the run's page; every figure is in resizes.jsonl and the metrics above.
    trainer.metrics.tag(f"resize.{request['seq']}", event.line())
    print(f"trial {trainer.cfg.trial_id}: {event.line()}", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="One process of an elastic trial (started by training.elastic).")
    parser.add_argument("--config", required=True)
    args = parser.parse_args(argv)
    die_with_parent()
    skip_final_collection()  # a trial's end is seen when its processes have exited
    dump_stacks_on_request()  # a stalled trial's stacks, to its log (tasks/watchdog.py)
    cfg = TrialConfig.from_file(args.config)
    watch_lease(cfg.lease)  # a stalled campaign's lease ends this worker (training.fence)
    wid = os.environ["CAMPAIGN_WORKER_ID"]
    # The agent's store: on its node's address when the trial may span nodes (training.elastic_host).
    store = dist.TCPStore(os.environ.get("CAMPAIGN_STORE_ADDR", "127.0.0.1"), int(os.environ["CAMPAIGN_STORE_PORT"]),
                          is_master=False, timeout=STORE_TIMEOUT)
    if cfg.function is not None:  # the user's own loop: resized by restart (the agent sends no state through memory)
        from training.function import FunctionTrial

        trainer = FunctionTrial(cfg, pick_device(0))
        serve = _serve_function
    else:
        trainer, serve = Trainer(cfg, pick_device(0)), _serve
    backend = "nccl" if trainer.device.type == "cuda" else "gloo"
    store.set(f"ready/{wid}", str(time.time()))
    try:
        # Whose failure it is, for the campaign's retry, before its traceback reaches the log (training.failure).
        with stops_when_fenced(), failures_recorded(cfg.trial_dir, None, user_packages(targets_of(cfg))):
            serve(cfg, wid, store, trainer, backend)
    finally:
        trainer.close()


def _serve_function(cfg: TrialConfig, wid: str, store: dist.TCPStore, trial, backend: str) -> None:
    """A function trial's generation: its function runs until it returns; when it returned
    because the agent asked for a stop (ctx.should_stop), it saved, and the next generation
    (new processes: the agent restarts function trials) loads that save."""
    assignment = _assignment(store, wid, 0)
    if assignment.get("exit"):
        return
    timings = {"assigned": time.time()}
    gen, members = assignment["gen"], assignment["members"]
    rank = _join_generation(assignment, wid, store, backend)
    stop = StopFlag(Path(assignment["stop_path"]), rank, cfg.control_every, torch.device("cpu"), _stop_store(assignment, store))
    trial.attach(rank, len(members), 0, stop_requested=stop.requested)
    timings["attached"] = timings["state"] = time.time()
    if rank == 0:
        print(f"trial {cfg.trial_id}: generation {gen} on {len(members)} device(s) ({', '.join(members)}), "
              f"calling {cfg.function['target']}", flush=True)
    report = (lambda: record_resize(trial, assignment, timings)) if rank == 0 else None
    timings["held_before"] = trial.held_s
    # After a resize (a generation other than the agent's first) the start is the resize's.
    result = trial.train(after_first_step=report, starting="resizing" if gen > 0 else "running")
    if rank == 0:
        if result is not None:
            print(result_line(cfg.trial_id, result), flush=True)
        else:
            print(f"trial {cfg.trial_id}: returned at step {trial.step} for a resize", flush=True)
            trial.write_progress("resizing")
            # Its save is durable (train waited for it): the next generation may start while this
            # one sends its last metrics and lets go.
            store.set(f"stopped/{gen}", json.dumps({"step": trial.step, "last_step_at": trial.last_step_at or time.time(), "time": time.time()}))
    trial.detach()
    dist.destroy_process_group()
    if result is None:  # the agent dismisses this worker: wait for its word, then go
        _assignment(store, wid, 1)


def _assignment(store: dist.TCPStore, wid: str, k: int) -> dict:
    """The agent's k-th assignment to this worker, once it is given."""
    key = f"assign/{wid}/{k}"
    store.wait([key])
    return json.loads(store.get(key))


def _stop_store(assignment: dict, store: dist.Store) -> dist.Store | None:
    """Where the generation's stop signals are: the agent's store when it spans nodes, else its files."""
    return store if assignment.get("spans_nodes") else None


def _join_generation(assignment: dict, wid: str, store: dist.TCPStore, backend: str) -> int:
    """Join the assignment's generation as the default process group; this worker's rank there."""
    members = assignment["members"]
    rank = members.index(wid)
    dist.init_process_group(backend, store=dist.PrefixStore(f"gen{assignment['gen']}/", store), rank=rank, world_size=len(members))
    return rank


def _serve(cfg: TrialConfig, wid: str, store: dist.TCPStore, trainer: Trainer, backend: str) -> None:
    """Train each generation the agent assigns this worker, until it says exit or the trial ends."""
    for k in range(10**9):
        assignment = _assignment(store, wid, k)
        if assignment.get("exit"):
            return
        timings = {"assigned": time.time()}
        gen, members = assignment["gen"], assignment["members"]
        rank = _join_generation(assignment, wid, store, backend)
        trainer.attach(DistEnv(rank, len(members), 0), trace_name=f"{wid}-gen{gen}")
        timings["attached"] = time.time()
        if assignment["source"] == "disk":
            trainer.resume()
        else:
            share_state(trainer, rank, joiner=wid in assignment["joiners"])
        timings["state"] = time.time()
        if rank == 0:  # the trial's log says what happened to it (train.log, like a torchrun trial's)
            print(f"trial {cfg.trial_id}: generation {gen} on {len(members)} device(s) ({', '.join(members)}), "
                  f"step {trainer.step}, state from {assignment['source']}", flush=True)
        report = (lambda: record_resize(trainer, assignment, timings)) if rank == 0 else None
        should_stop = StopFlag(Path(assignment["stop_path"]), rank, cfg.control_every, trainer.device, _stop_store(assignment, store))
        timings["held_before"] = trainer.held_s
        result = trainer.train(should_stop, after_first_step=report, starting="resizing" if gen > 0 else "running")
        if result is not None:  # finished: the result is written, nothing more to do
            if rank == 0:
                print(result_line(cfg.trial_id, result), flush=True)
            trainer.detach()
            dist.destroy_process_group()
            return
        stop = should_stop.request()
        if stop["save"]:
            trainer.save_checkpoint(blocking=True)
        trainer.detach()
        if rank == 0:
            print(f"trial {cfg.trial_id}: stopped at step {trainer.step} for a resize" + (" (checkpoint saved)" if stop["save"] else ""), flush=True)
            trainer.write_progress("resizing")
            store.set(f"stopped/{gen}", json.dumps({"step": trainer.step, "last_step_at": trainer.last_step_at, "time": time.time()}))
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
