"""The jobs a connector's scheduler half planned for each step still on the device, by step id.

Under async scheduling the engine schedules step N + 1 before it applies step N's output, so a
scheduler half has the jobs of two steps out at once. Each `KVConnectorOutput` names the step it
answers (`step_id`), and a half looks up that step's jobs here; a single "current step" field
would match step N's failures against step N + 1's jobs.
"""

from __future__ import annotations

from typing import Generic, TypeVar

from kvtool.engine.core.messages import KVConnectorOutput

M = TypeVar("M")


class StepsInFlight(Generic[M]):
    """What a scheduler half built for each step (its metadata), until the step's output is back."""

    def __init__(self) -> None:
        self._steps: dict[int, M] = {}

    def add(self, step_id: int, meta: M) -> None:
        """Record the metadata built for step `step_id` (by build_connector_meta)."""
        if step_id in self._steps:
            raise RuntimeError(f"step {step_id} was planned twice")
        self._steps[step_id] = meta

    def answered(self, output: KVConnectorOutput) -> M | None:
        """The metadata of the step `output` answers, taken out; None for a report between steps.

        Outputs come back in the order the steps ran, so a step older than the one answered was
        never answered (its forward raised) and is dropped too.
        """
        if output.step_id is None:
            return None
        for step_id in [s for s in self._steps if s < output.step_id]:
            del self._steps[step_id]
        return self._steps.pop(output.step_id, None)

    def __len__(self) -> int:
        return len(self._steps)
