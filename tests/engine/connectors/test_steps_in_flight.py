"""A scheduler half's per-step state: each output is matched to the step it answers."""

import pytest

from kvtool.engine.connectors.steps_in_flight import StepsInFlight
from kvtool.engine.core.messages import KVConnectorOutput


def test_an_output_takes_back_the_metadata_of_its_own_step_while_the_next_is_out():
    steps = StepsInFlight()
    steps.add(4, "jobs of step 4")
    steps.add(5, "jobs of step 5")  # async scheduling: step 5 is built before step 4 answers
    assert steps.answered(KVConnectorOutput(step_id=4)) == "jobs of step 4"
    assert len(steps) == 1
    assert steps.answered(KVConnectorOutput(step_id=5)) == "jobs of step 5"
    assert steps.answered(KVConnectorOutput(step_id=5)) is None and len(steps) == 0


def test_a_report_between_steps_answers_no_step():
    steps = StepsInFlight()
    steps.add(0, "jobs")
    assert steps.answered(KVConnectorOutput()) is None  # a flush's completions
    assert len(steps) == 1


def test_a_step_never_answered_is_dropped_by_the_next_answer():
    steps = StepsInFlight()
    for i in range(3):
        steps.add(i, f"jobs {i}")
    assert steps.answered(KVConnectorOutput(step_id=2)) == "jobs 2"
    assert len(steps) == 0


def test_a_step_planned_twice_is_an_error():
    steps = StepsInFlight()
    steps.add(1, "a")
    with pytest.raises(RuntimeError, match="planned twice"):
        steps.add(1, "b")
