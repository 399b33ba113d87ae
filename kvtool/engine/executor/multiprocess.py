"""The engine's side of tensor parallelism: N worker processes (rank_process.py), one rank each.

`MultiprocExecutor` is the Executor (executor.py) of a tensor-parallel size N > 1: the engine
drives it exactly as it drives the in-process one. Every step's SchedulerOutput is pickled
once and sent to every rank (a multiprocessing Pipe each); every rank runs the step and samples
from the full logits, so the ranks' batch state stays identical; rank 0's samples come back,
and the ranks' connector outputs are merged (kv_output_aggregator.py).

A worker that dies or fails makes every later call raise one WorkerError naming the rank; the
engine then closes the executor, which stops (or kills) what is left of the group. Workers
never outlive the engine process (rank_process.py says how).
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import socket
import time
from collections import deque
from multiprocessing.connection import Connection, wait

from kvtool.engine import errors
from kvtool.engine.core.messages import KVConnectorCompletions, ModelRunnerOutput, SchedulerOutput
from kvtool.engine.errors import KVToolError, WorkerError
from kvtool.engine.executor.kv_output_aggregator import KVOutputAggregator
from kvtool.engine.executor.rank_process import WorkerSpec, worker_main

# How long a worker may take to shut down cleanly (pending KV stores land) before it is killed.
SHUTDOWN_TIMEOUT_S = 120.0
# How long a terminated worker gets before SIGKILL.
KILL_GRACE_S = 5.0
# How long, once a rank reports a failure, the others get to report theirs (the first one is raised).
ROOT_CAUSE_WAIT_S = 0.5


def free_loopback_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for the process group's store)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "it stopped answering"
    if exitcode < 0:
        try:
            return f"signal {-exitcode}, {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"signal {-exitcode}"
    return f"exit status {exitcode}"


class _PendingStep:
    """A step sent to the workers; result() waits for every rank's reply to it."""

    def __init__(self, executor: MultiprocExecutor, ticket: int) -> None:
        self._executor = executor
        self._ticket = ticket
        self._output: ModelRunnerOutput | None = None

    def result(self) -> ModelRunnerOutput:
        if self._output is None:
            replies = self._executor._wait(self._ticket)
            self._output = self._executor._merge_step(replies)
        return self._output


class MultiprocExecutor:
    """N ranks in N processes, each a Worker (worker/worker.py) behind a pipe."""

    def __init__(self, specs: list[WorkerSpec]) -> None:
        """Start one process per spec (rank order) and wait until each has built its model.

        Raises the worker's own error (the same one-line error as in-process, e.g. a
        ModelError for a corrupt weight file) or a WorkerError naming the rank.
        """
        self.size = len(specs)
        self.aggregator = KVOutputAggregator(self.size)
        self._failure: KVToolError | None = None
        self._next_ticket = 0
        # Per rank: the tickets sent and not yet answered, in order; answers not yet asked for.
        self._expected: list[deque[int]] = [deque() for _ in specs]
        self._answers: dict[int, dict[int, object]] = {}
        self._closed = False
        # Set once close() asks the ranks to stop: a worker that answered and exited is then fine.
        self._stopping = False
        context = multiprocessing.get_context("spawn")
        self.conns: list[Connection] = []
        self.processes: list[multiprocessing.process.BaseProcess] = []
        try:
            for spec in specs:
                ours, theirs = context.Pipe(duplex=True)
                proc = context.Process(target=worker_main, args=(theirs, spec), name=f"kvtool-tp-rank{spec.rank}",
                                       daemon=True)
                proc.start()
                theirs.close()
                self.conns.append(ours)
                self.processes.append(proc)
            self._wait(self._expect_all(), starting=True)
        except BaseException as e:
            if self._failure is None:  # interrupted: nothing to save, stop them at once
                self._failure = WorkerError(f"tensor-parallel start-up interrupted: {type(e).__name__}")
            self.close()
            raise

    @property
    def failure(self) -> KVToolError | None:
        """The error that broke the group (every call raises it), or None while it is whole."""
        return self._failure

    @property
    def pids(self) -> list[int]:
        """The workers' process ids, rank order."""
        return [p.pid for p in self.processes]

    # ---- the Executor interface ---------------------------------------------------------------

    def determine_available_memory(self) -> list[int]:
        """Bytes each rank's KV pages may take, rank order."""
        return self._wait(self._send(("available_memory",)), starting=True)

    def init_cache(self, num_blocks: int) -> None:
        """Have every rank allocate its KV pages (num_blocks each) and build its runner."""
        self._wait(self._send(("init_cache", num_blocks)), starting=True)

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every rank and wait for it."""
        return self.execute_async(so).result()

    def execute_async(self, so: SchedulerOutput) -> _PendingStep:
        """Send one step to every rank; result() of the returned object waits for its replies."""
        return _PendingStep(self, self._send(("step", so)))

    @property
    def request_ids(self) -> list[str]:
        """The requests whose state the ranks hold (rank 0's; the ranks must agree)."""
        replies = self._wait(self._send(("request_ids",)))
        if any(r != replies[0] for r in replies):
            raise AssertionError(f"the tensor-parallel ranks hold different requests: {replies}")
        return replies[0]

    def flush_connector(self, take_completions: bool) -> KVConnectorCompletions | None:
        """Every rank's worker half flushes; with take_completions, the jobs done on every rank."""
        replies = self._wait(self._send(("flush", take_completions)))
        return self.aggregator.merge_completions(list(replies)) if take_completions else None

    # ---- messages -------------------------------------------------------------------------------

    def _send(self, message: tuple) -> int:
        self._check()
        ticket = self._expect_all()
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        for rank, conn in enumerate(self.conns):
            try:
                conn.send_bytes(data)
            except (OSError, EOFError):
                self.processes[rank].join(1.0)
                self._fail(rank, self.processes[rank].exitcode)
        return ticket

    def _expect_all(self) -> int:
        ticket = self._next_ticket
        self._next_ticket += 1
        for expected in self._expected:
            expected.append(ticket)
        self._answers[ticket] = {}
        return ticket

    def _wait(self, ticket: int, starting: bool = False) -> list:
        """Every rank's answer to `ticket`, rank order, reading (and keeping) earlier answers first.

        Watches every worker at once: one that dies while another waits in a collective
        operation for it is noticed at once.
        """
        answers = self._answers[ticket]
        while len(answers) < self.size:
            self._check()
            sentinels = {p.sentinel: rank for rank, p in enumerate(self.processes)}
            pending = {self.conns[rank]: rank for rank in range(self.size) if self._expected[rank]}
            ready = wait([*pending, *sentinels])
            # A death first: the other ranks' errors (a collective that lost its peer) follow from it.
            for obj in ready:
                if obj in sentinels:
                    rank = sentinels[obj]
                    conn = self.conns[rank]
                    while self._expected[rank] and conn.poll():  # its last words first
                        self._read(rank, starting)
                    if self._expected[rank] or not self._stopping:
                        self.processes[rank].join(1.0)
                        self._fail(rank, self.processes[rank].exitcode)
            for obj in ready:
                if obj in pending:
                    self._read(pending[obj], starting)
        del self._answers[ticket]
        return [answers[r] for r in range(self.size)]

    def _read(self, rank: int, starting: bool) -> None:
        try:
            reply = self.conns[rank].recv()
        except (EOFError, OSError):
            self.processes[rank].join(1.0)
            self._fail(rank, self.processes[rank].exitcode)
        ticket = self._expected[rank].popleft()
        if reply[0] == "error":
            self._fail_from_error(rank, reply, starting)
        self._answers[ticket][rank] = reply[1]

    def _fail_from_error(self, rank: int, reply: tuple, starting: bool) -> None:
        """Raise the group's first failure: a rank that fails in a collective operation often
        fails because another rank failed (or died) first, so look at the others a moment."""
        _, kind, message, at = reply
        first = (at, rank, kind, message)
        deadline = time.monotonic() + ROOT_CAUSE_WAIT_S
        while time.monotonic() < deadline:
            for other in range(self.size):
                if other == rank or not self._expected[other]:
                    continue
                conn, proc = self.conns[other], self.processes[other]
                while self._expected[other] and conn.poll():
                    try:
                        answer = conn.recv()
                    except (EOFError, OSError):
                        break
                    ticket = self._expected[other].popleft()
                    if answer[0] == "error":
                        first = min(first, (answer[3], other, answer[1], answer[2]))
                    else:
                        self._answers[ticket][other] = answer[1]
                if self._expected[other] and not proc.is_alive() and not conn.poll():
                    proc.join(1.0)
                    self._fail(other, proc.exitcode)
            time.sleep(0.05)
        _, rank, kind, message = first
        self._fail(rank, None, kind, message, starting)

    def _fail(self, rank: int, exitcode: int | None, kind: str = "", message: str = "",
              starting: bool = False) -> None:
        """Record the group as broken by `rank` and raise the error every later call raises too."""
        if self._failure is None:
            if message and starting:
                # A start-up error of the engine's own kinds reads as it would in-process.
                cls = getattr(errors, kind, None) if kind else None
                if isinstance(cls, type) and issubclass(cls, KVToolError):
                    self._failure = cls(message)
                else:
                    self._failure = WorkerError(f"tensor-parallel worker rank {rank} failed to start: {message}")
            elif message:
                self._failure = WorkerError(f"tensor-parallel worker rank {rank} failed: {message}")
            else:
                self._failure = WorkerError(f"tensor-parallel worker rank {rank} died ({_describe_exit(exitcode)})")
        raise self._failure

    def _check(self) -> None:
        if self._failure is not None:
            raise self._failure
        if self._closed:
            raise WorkerError("the tensor-parallel workers are shut down")

    def _merge_step(self, replies: list[ModelRunnerOutput]) -> ModelRunnerOutput:
        first = replies[0]
        conn_out = self.aggregator.aggregate([r.connector_output for r in replies])
        return ModelRunnerOutput(sampled=first.sampled, logprobs=first.logprobs, connector_output=conn_out)

    # ---- shutdown ---------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop every worker: cleanly (their worker halves write pending stores) while the group
        is whole, else by SIGTERM then SIGKILL. Idempotent; never leaves a process behind."""
        if self._closed:
            return
        if self._failure is None and self.processes and all(p.is_alive() for p in self.processes):
            self._stopping = True
            try:
                self._wait(self._send(("shutdown",)))
            except KVToolError:
                pass
        self._closed = True
        for proc in self.processes:
            proc.join(SHUTDOWN_TIMEOUT_S if self._failure is None else 0.5)
        for proc in self.processes:
            if proc.is_alive():
                proc.terminate()
        for proc in self.processes:
            proc.join(KILL_GRACE_S)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()


def start_multiproc_executor(params, model_path, device, dtype, max_model_len: int, identity,
                             none_hash: bytes) -> MultiprocExecutor:
    """Start params.tensor_parallel_size ranks for an engine (see executor.build_executor) and
    wait until each has built its model; raises their start-up errors as one line."""
    from kvtool.engine.kv.pages import DTYPE_NAMES

    size = params.tensor_parallel_size
    init_method = f"tcp://127.0.0.1:{free_loopback_port()}"
    specs = [
        WorkerSpec(params=params, model_path=str(model_path), device_type=device.type, dtype_name=DTYPE_NAMES[dtype],
                   tp_size=size, rank=rank, init_method=init_method, max_model_len=max_model_len,
                   identity=identity, none_hash=none_hash, parent_pid=os.getpid())
        for rank in range(size)
    ]
    return MultiprocExecutor(specs)
