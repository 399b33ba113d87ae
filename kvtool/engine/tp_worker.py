"""One tensor-parallel rank in its own process: its shard of the model, its KV pages, its
connector worker half and a ModelRunner, driven by the engine's per-step messages.

The engine process (tp_executor.py) starts it with multiprocessing's 'spawn' and talks to it
over one Pipe. Every message gets exactly one reply, in order:

    engine                               worker
    (start)                    ──>       torch.distributed init, build the rank's model
                               <──       ("ok", (free, total) device bytes on CUDA, else None)
    ("init_cache", num_blocks) ──>       KV pages, connector worker half, ModelRunner
                               <──       ("ok", None)
    ("step", SchedulerOutput)  ──>       runner.execute_async(...)
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
        worker = _Worker(conn, spec)
    except BaseException as e:  # noqa: BLE001 - reported to the engine, which raises it
        _reply_error(conn, e)
        return
    worker.serve()


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


class _Worker:
    def __init__(self, conn: Connection, spec: WorkerSpec) -> None:
        import torch

        self.conn = conn
        self.spec = spec
        self.runner = None
        self.connector = None
        self.kv_pages = None
        if "OMP_NUM_THREADS" not in os.environ:
            # The ranks share the machine's cores (on CPU they do all the work).
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.tp_size))
        self.device = self._init_distributed()
        self._build_model()
        free_total = torch.cuda.mem_get_info(self.device) if self.device.type == "cuda" else None
        conn.send(("ok", free_total))

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

    def _build_model(self) -> None:
        import torch

        from kvtool.engine.kv_pages import DTYPES
        from kvtool.engine.model_dir import open_model_dir
        from kvtool.engine.models import build_model
        from kvtool.engine.tp_layout import TPRank

        spec, p = self.spec, self.spec.params
        self.model_dir = open_model_dir(spec.model_path)
        self.dtype = DTYPES[spec.dtype_name]
        torch.manual_seed(p.seed)
        tp = TPRank(spec.tp_size, spec.rank)
        self.model = build_model(self.model_dir, self.device, self.dtype, p.load_format, p.seed, tp=tp)

    def _init_cache(self, num_blocks: int) -> None:
        from kvtool.engine.connectors.base import ConnectorContext
        from kvtool.engine.connectors.registry import resolve_connector
        from kvtool.engine.identity import rank_identity
        from kvtool.engine.kv_pages import DTYPE_NAMES, KVGeometry, KVPages
        from kvtool.engine.models.fast_paths import apply_fast_paths
        from kvtool.engine.runner import ModelRunner
        from kvtool.engine.tp_layout import TPRank, kv_head_range

        spec, p = self.spec, self.spec.params
        cfg = self.model_dir.config
        tp = TPRank(spec.tp_size, spec.rank)
        num_kv_heads = kv_head_range(cfg.num_kv_heads, tp)[1]
        geometry = KVGeometry(num_layers=cfg.num_layers, num_kv_heads=num_kv_heads, head_dim=cfg.head_dim,
                              block_size=p.block_size, dtype=DTYPE_NAMES[self.dtype])
        self.kv_pages = KVPages(geometry, num_blocks, self.device)
        ktc = p.kv_transfer_config
        if spec.identity is not None and ktc is not None and ktc.kv_connector is not None:
            ctx = ConnectorContext(config=ktc, identity=rank_identity(spec.identity, tp),
                                   none_hash=spec.none_hash)
            self.connector = resolve_connector(ktc).create_worker_half(ctx)
        # After the KV pages are sized and allocated, as the single-process runner applies them.
        fast_paths = apply_fast_paths(self.model, self.device, self.dtype, backend=p.attention_backend)
        self.runner = ModelRunner(
            self.model, self.kv_pages, self.device, self.connector, max_model_len=spec.max_model_len,
            use_cuda_graphs=not p.enforce_eager, backend=p.attention_backend,
            batch_invariant=p.batch_invariant, max_num_seqs=p.max_num_seqs, fast_paths=fast_paths,
        )

    def _recv(self):
        """The next message, or None once the engine has closed its end."""
        try:
            return pickle.loads(self.conn.recv_bytes())
        except (EOFError, OSError):
            return None

    def serve(self) -> None:
        """Answer messages until shutdown, a failure, or the engine's end of the pipe closing."""
        from kvtool.engine.messages import ModelRunnerOutput

        try:
            while True:
                message = self._recv()
                if message is None:
                    return
                kind = message[0]
                if kind == "step":
                    out = self.runner.execute_async(message[1])
                    if self.spec.rank == 0:
                        reply = out.result()
                    else:  # only rank 0's samples are used; every rank's connector output is
                        reply = ModelRunnerOutput(connector_output=out.connector_output)
                elif kind == "init_cache":
                    self._init_cache(message[1])
                    reply = None
                elif kind == "flush":
                    reply = None
                    if self.connector is not None:
                        self.connector.flush()
                        if message[1]:
                            reply = self.connector.take_completions()
                elif kind == "request_ids":
                    reply = self.runner.request_ids
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

        if self.connector is not None:
            self.connector.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()
