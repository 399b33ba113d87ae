"""Which exceptions mean the engine itself is broken (/health 503) and which belong to one request."""

import pytest

from kvtool.engine.errors import InputError
from kvtool.server.engine_loop import is_engine_failure


@pytest.mark.parametrize("exc", [
    RuntimeError("CUDA error: an illegal memory access was encountered"),
    MemoryError(),
    SystemError("bad internal call"),
])
def test_engine_failures(exc):
    assert is_engine_failure(exc)


@pytest.mark.parametrize("exc", [
    ValueError("Overflow when unpacking long long"),
    RuntimeError("probability tensor contains either inf, nan or element < 0"),
    KeyError("req-7"),
    InputError("a bad tag"),
])
def test_request_failures(exc):
    assert not is_engine_failure(exc)
