"""A pass of a trace in a cold subprocess: `--restart process`.

The parent writes the engine parameters and the resolved requests to a spec file and runs
`python -m kvtool.workloads.cold_pass SPEC RESULT`; the child builds a fresh engine, runs the
pass, waits for its background stores and writes the PassResult. Nothing but what the arm keeps
outside the process (a disk tier, an LMCache server) is shared with the parent.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import msgspec

from kvtool.engine.errors import KVToolError
from kvtool.engine.params import EngineParams
from kvtool.workloads.trace_pass import PassRequest, PassResult


class ColdPassSpec(msgspec.Struct, kw_only=True):
    params: EngineParams
    requests: list[PassRequest]


class ColdPassError(KVToolError):
    """The cold process failed; carries its exit status and its one-line error."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def run_cold_pass(params: EngineParams, requests: list[PassRequest], timeout_s: float | None = None) -> PassResult:
    """Run one pass in a new Python process; its PassResult.

    Raises ColdPassError with the child's error line and exit status when it fails.
    """
    package_root = str(Path(__file__).resolve().parent.parent.parent)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    with tempfile.TemporaryDirectory(prefix="kvtool-cold-pass-") as tmp:
        spec_path, result_path = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec_path.write_bytes(msgspec.json.encode(ColdPassSpec(params=params, requests=requests)))
        proc = subprocess.run(
            [sys.executable, "-m", "kvtool.workloads.cold_pass", str(spec_path), str(result_path)],
            stdin=subprocess.DEVNULL, capture_output=True, text=True, env=env, timeout=timeout_s,
        )
        if proc.returncode != 0:
            lines = [line for line in proc.stderr.splitlines() if line.strip()]
            last = lines[-1] if lines else f"exit status {proc.returncode}"
            raise ColdPassError(f"the cold reuse process failed: {last.removeprefix('error: ')}", proc.returncode)
        return msgspec.json.decode(result_path.read_bytes(), type=PassResult)


def main(argv: list[str]) -> int:
    from kvtool.engine.engine import LLMEngine
    from kvtool.workloads.trace_pass import flush_connector, run_pass

    spec_path, result_path = argv
    spec = msgspec.json.decode(Path(spec_path).read_bytes(), type=ColdPassSpec)
    try:
        with LLMEngine(spec.params) as engine:
            result = run_pass(engine, spec.requests)
            flush_connector(engine)
    except KVToolError as e:
        if os.environ.get("KVTOOL_DEBUG") == "1":
            raise
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    Path(result_path).write_bytes(msgspec.json.encode(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
