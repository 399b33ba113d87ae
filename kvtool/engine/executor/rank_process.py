"""One tensor-parallel rank in its own process: a Worker (worker/worker.py: its shard of the model, its
KV pages, its connector worker half and a ModelRunner), driven by the engine's per-step messages.

The engine process (multiprocess.py) starts it with multiprocessing's 'spawn' and talks to it
over one Pipe. Every message gets exactly one reply, in order:

    engine                               worker
    (start)                    ──>       torch.distributed init, build the rank's model
                               <──       ("ok", None)
    ("available_memory",)      ──>       bytes the rank's KV pages may take
    ("init_cache", num_blocks) ──>       KV pages, connector worker half, ModelRunner
                               <──       ("ok", None)
    ("step", SchedulerOutput)  ──>       worker.execute_async(...)
                               <──       ("ok", ModelRunnerOutput)   rank 0: sampled tokens too
    ("flush", take)            ──>       worker half flush (+ take_completions when `take`)
    ("request_ids",)           ──>       the runner's request ids
    ("shutdown",)              ──>       worker half shutdown, process group destroyed
                               <──       ("ok", None), then the process exits

A failure is the reply ("error", error class name, message, time) and the end of the process: the
group is broken once one rank is out of step. The worker never outlives the engine: the kernel
kills it when the engine process dies (PR_SET_PDEATHSIG), and it exits when the pipe closes.
It ignores SIGINT: Ctrl-C in a terminal reaches the whole process group, and the engine
process, not each worker, decides how to stop.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import signal
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

from kvtool.engine.connectors.base import EngineIdentity
from kvtool.engine.errors import KVToolError
from kvtool.engine.params import EngineParams

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15


@dataclass(frozen=True)
class WorkerSpec:
    """Everything one rank is built from (pickled into the spawned process)."""

    params: EngineParams
    model_path: str
    device_type: str  # "cpu" | "cuda"
    dtype_name: str
    tp_size: int
    rank: int
    init_method: str  # tcp://127.0.0.1:PORT of the process group's store
    max_model_len: int
    # The engine's identity (None without a connector); the rank derives its own from it.
    identity: EngineIdentity | None
    none_hash: bytes
    parent_pid: int


def worker_main(conn: Connection, spec: WorkerSpec) -> None:
    """The worker process's entry point (see the module docstring for the protocol)."""
    _die_with_parent(spec.parent_pid, f"kvtool-tp-rank{spec.rank}")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        rank = _RankProcess(conn, spec)
    except BaseException as e:  # noqa: BLE001 - reported to the engine, which raises it
        _reply_error(conn, e)
        return
    rank.serve()


def _die_with_parent(parent_pid: int, name: str) -> None:
    """Ask the kernel to SIGKILL this process when the engine process dies, and name it (what
    ps and top show) after its rank (Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        libc.prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the closed pipe still ends the worker
        pass
    if os.getppid() != parent_pid:  # the engine died before the request above took effect
        os._exit(1)


def _reply_error(conn: Connection, e: BaseException) -> None:
    kind = type(e).__name__
    message = str(e) if isinstance(e, KVToolError) else f"{kind}: {e}"
    try:
        conn.send(("error", kind if isinstance(e, KVToolError) else "", message, time.time()))
    except (OSError, EOFError):  # the engine is gone
        pass


class _RankProcess:
    """The process side of one rank: the process group, and the rank's Worker (worker/worker.py)."""

    def __init__(self, conn: Connection, spec: WorkerSpec) -> None:
        import torch

        from kvtool.engine.kv.pages import DTYPES
        from kvtool.engine.models.model_dir import open_model_dir
        from kvtool.engine.models.shard_layout import TPRank
        from kvtool.engine.worker.worker import build_worker

        self.conn = conn
        self.spec = spec
        if "OMP_NUM_THREADS" not in os.environ:
            # The ranks share the machine's cores (on CPU they do all the work).
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.tp_size))
        device = self._init_distributed()
        self.worker = build_worker(spec.params, open_model_dir(spec.model_path), device, DTYPES[spec.dtype_name],
                                   TPRank(spec.tp_size, spec.rank), spec.max_model_len, spec.identity,
                                   spec.none_hash)
        conn.send(("ok", None))

    def _init_distributed(self):
        import torch
        import torch.distributed as dist

        spec = self.spec
        if spec.device_type == "cuda":
            device = torch.device("cuda", spec.rank)
            torch.cuda.set_device(device)
            os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
            backend = "nccl"
        else:
            device = torch.device("cpu")
            # Loopback only: the ranks are processes of one machine.
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
            backend = "gloo"
        dist.init_process_group(backend, init_method=spec.init_method, world_size=spec.tp_size, rank=spec.rank)
        # One collective now: NCCL creates its communicator on the first one, which must not be
        # inside a CUDA graph capture; and every rank is known to be connected from here on.
        dist.all_reduce(torch.zeros(1, device=device))
        return device

    def _recv(self):
        """The next message, or None once the engine has closed its end."""
        try:
            return pickle.loads(self.conn.recv_bytes())
        except (EOFError, OSError):
            return None

    def serve(self) -> None:
        """Answer messages until shutdown, a failure, or the engine's end of the pipe closing."""
        from kvtool.engine.core.messages import ModelRunnerOutput

        try:
            while True:
                message = self._recv()
                if message is None:
                    return
                kind = message[0]
                if kind == "step":
                    out = self.worker.execute_async(message[1])
                    if self.spec.rank == 0:
                        reply = out.result()
                    else:  # only rank 0's samples are used; every rank's connector output is
                        reply = ModelRunnerOutput(connector_output=out.connector_output)
                elif kind == "available_memory":
                    reply = self.worker.determine_available_memory()
                elif kind == "init_cache":
                    self.worker.init_cache(message[1])
                    reply = None
                elif kind == "flush":
                    reply = self.worker.flush_connector(message[1])
                elif kind == "request_ids":
                    reply = self.worker.request_ids
                elif kind == "shutdown":
                    self._shutdown()
                    self.conn.send(("ok", None))
                    return
                else:
                    raise RuntimeError(f"unknown message {kind!r}")
                self.conn.send(("ok", reply))
        except BaseException as e:  # noqa: BLE001 - reported; the process then ends
            _reply_error(self.conn, e)

    def _shutdown(self) -> None:
        import torch.distributed as dist

        self.worker.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()
