"""Where the host's time goes in the engine's steps, by phase, since the engine started.

Under async scheduling a step schedules and queues the next batch, then waits for the batch
already on the device and takes its results; the device idles whenever the host's phases of a
step take longer than the device's batch. `wait_s` is the time the host spent blocked on the
device: a host that keeps the device busy spends most of a step there; one that does not spends
little, and the other phases say where its time went instead. Five clock readings a step; no
profiler needed.
"""

from __future__ import annotations

import msgspec


class StepTimes(msgspec.Struct, kw_only=True):
    """Host seconds of the engine's steps, by phase."""

    steps: int = 0
    schedule_s: float = 0.0  # the scheduler's message for the step (the connector's metadata with it)
    launch_s: float = 0.0  # the executor: the step's inputs to the device, its forward queued
    wait_s: float = 0.0  # blocked until the device had finished the step before
    update_s: float = 0.0  # the scheduler taking that step's results
    outputs_s: float = 0.0  # the output processor (detokenisation, stop strings), KV events
    # Of those steps, the ones that computed more than one token of some request (a prompt's
    # chunk, a hit's tail) and their launch seconds: a decode step replays a CUDA graph, such
    # a step queues every kernel from the host (the rest of launch_s is the decode steps').
    mixed_steps: int = 0
    mixed_launch_s: float = 0.0

    def add_launch(self, seconds: float, mixed: bool) -> None:
        self.launch_s += seconds
        if mixed:
            self.mixed_steps += 1
            self.mixed_launch_s += seconds

    def minus(self, earlier: StepTimes) -> StepTimes:
        """The times between `earlier` and this one (a run's share of an engine's totals)."""
        return StepTimes(**{f: getattr(self, f) - getattr(earlier, f) for f in self.__struct_fields__})
