"""The lm:// client: LMCache's TCP protocol, spoken byte for byte (docs/lmcache-interop.md 1-3).

One request is a 186-byte header (`<9i150s`: command, length, fmt, dtype, location, shape[4], key
right-padded with ASCII spaces), followed by `length` payload bytes for a PUT. One reply is a
36-byte header (`<9i`: code, length, fmt, dtype, shape[4], location *last*), followed by `length`
payload bytes after a GET hit. Requests on one connection are answered strictly in order; PUT gets
no reply at all and LIST never gets one, so this client never sends LIST and confirms every PUT with
an EXIST on the same connection.

Reads go straight into a caller-provided buffer with exact-length `recv_into`: a reply is checked
against the buffer (and against the expected geometry, when given) before one payload byte is read,
so a malformed or oversized reply allocates nothing. The server closes the socket on any bad input
and keeps no per-connection state, so a failed request closes its connection and the next use of
that pool slot reconnects.

Threading: an `LMClient` is safe to share between threads. It holds `connections` sockets; each
call checks one out for its whole request/reply exchange, and the `*_many` calls stripe items over
all of them.
"""

from __future__ import annotations

import logging
import math
import queue
import socket
import struct
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from enum import IntEnum
from typing import TypeVar, Union
from urllib.parse import urlparse

import msgspec
import torch

from kvtool.engine.errors import ConfigError, KVRefused, KVToolError, PeerError

logger = logging.getLogger(__name__)

REQUEST = struct.Struct("<9i150s")  # command, length, fmt, dtype, location, shape[4], key
RESPONSE = struct.Struct("<9i")  # code, length, fmt, dtype, shape[4], location
MAX_KEY_BYTES = 150
MAX_LENGTH = 2**31 - 1  # `length` is a signed int32 on the wire
HEALTH_KEY = "health@1@0@0@half"  # the server parses the key even for HEALTH, so it must be valid
# Requests per write when pipelining: keeps both directions' socket buffers far from full, so
# neither side can block on send while the other does.
PIPELINE_DEPTH = 256

Buffer = Union[bytes, bytearray, memoryview]
T = TypeVar("T")
ItemT = TypeVar("ItemT")
ResultT = TypeVar("ResultT")


class Command(IntEnum):
    PUT = 1
    GET = 2
    EXIST = 3
    LIST = 4  # the server never answers it; listed only so that it is never reused
    HEALTH = 5


class ReplyCode(IntEnum):
    SUCCESS = 200
    FAIL = 400


class MemoryFormat(IntEnum):
    """LMCache's `MemoryFormat` codes (docs 1.5)."""

    UNDEFINED = 0
    KV_2LTD = 1  # [2, num_layers, num_tokens, hidden]: what LMCache inside vLLM writes
    KV_T2D = 2
    KV_2TD = 3
    BINARY = 4
    BINARY_BUFFER = 5
    KV_MLA_FMT = 6
    EC_TD = 7
    HS_TD = 8


_BINARY_FORMATS = (MemoryFormat.BINARY, MemoryFormat.BINARY_BUFFER)
_FORMAT_CODES = frozenset(int(m) for m in MemoryFormat)

# dtype code -> torch dtype (docs 1.4). Code 1 is float16 too: LMCache decodes it but encodes 2.
_CODE_TO_DTYPE: dict[int, torch.dtype | None] = {
    0: None,
    1: torch.float16,
    2: torch.float16,
    3: torch.bfloat16,
    4: torch.float32,
    5: torch.float64,
    6: torch.uint8,
    7: torch.float8_e4m3fn,
    8: torch.float8_e5m2,
}
_DTYPE_TO_CODE: dict[torch.dtype, int] = {
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.float32: 4,
    torch.float64: 5,
    torch.uint8: 6,
    torch.float8_e4m3fn: 7,
    torch.float8_e5m2: 8,
}
_CODE_ITEMSIZE: dict[int, int] = {1: 2, 2: 2, 3: 2, 4: 4, 5: 8, 6: 1, 7: 1, 8: 1}


def dtype_code(dtype: torch.dtype) -> int:
    """The wire code of a torch dtype; float16 encodes as 2, as LMCache does.

    Raises:
        ConfigError: the dtype has no code (int8/16/32/64, bool, the `*fnuz` fp8 types).
    """
    try:
        return _DTYPE_TO_CODE[dtype]
    except KeyError:
        raise ConfigError(f"dtype {dtype} has no lm:// code; LMCache cannot store it") from None


def torch_dtype_from_code(code: int) -> torch.dtype:
    """The torch dtype of a received wire code (1 and 2 both mean float16).

    Raises:
        PeerError: the code is unknown or 0 (untyped BINARY data).
    """
    dtype = _CODE_TO_DTYPE.get(code)
    if dtype is None:
        raise PeerError(f"lm:// dtype code {code} is not a KV dtype")
    return dtype


class ChunkHeader(msgspec.Struct, frozen=True):
    """What the server reports about a stored object (and what a PUT announces)."""

    fmt: int  # MemoryFormat code
    dtype_code: int  # wire dtype code (float16 as 2)
    shape: tuple[int, ...]  # logical shape, trailing zero padding stripped (kept for BINARY)
    length: int  # payload bytes


def kv_chunk_header(shape: Sequence[int], dtype: torch.dtype, fmt: int = MemoryFormat.KV_2LTD) -> ChunkHeader:
    """The header of a KV chunk of `shape` and `dtype`: what a PUT sends and a GET must report."""
    code = dtype_code(dtype)
    return ChunkHeader(int(fmt), code, tuple(int(d) for d in shape), math.prod(shape) * _CODE_ITEMSIZE[code])


def tensor_buffer(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's storage (pinned memory included).

    The view aliases the tensor: a `get_into` on it fills the tensor in place, with no copy.
    """
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("tensor_buffer needs a contiguous CPU tensor")
    return memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy()).cast("B")


def parse_lm_url(url: str) -> tuple[str, int]:
    """`lm://HOST:PORT` -> (host, port). Any path or query is ignored, as LMCache does.

    Raises:
        ConfigError: not an lm:// URL, or the host or port is missing or invalid.
    """
    shown = url if len(url) <= 60 else url[:57] + "..."
    try:
        parsed = urlparse(url)
        host, port = parsed.hostname, parsed.port
    except ValueError:  # a bad IPv6 literal, a port out of range or not a number
        host = port = None
    if parsed_scheme(url) != "lm" or not host or port is None or not 1 <= port <= 65535:
        raise ConfigError(f"{shown!r} is not an lm://HOST:PORT URL (port 1 to 65535)")
    return host, port


def parsed_scheme(url: str) -> str:
    return url.split("://", 1)[0] if "://" in url else ""


def encode_key(key: str) -> bytes:
    """The 150-byte key field: UTF-8, right-padded with spaces (NUL padding breaks the server).

    Raises:
        ConfigError: the key is longer than 150 bytes or would change under the server's strip().
    """
    raw = key.encode("utf-8")
    if len(raw) > MAX_KEY_BYTES:
        raise ConfigError(f"lm:// key is {len(raw)} bytes, the limit is {MAX_KEY_BYTES}: {key[:60]}...")
    if key != key.strip():
        raise ConfigError(f"lm:// key {key!r} has leading or trailing whitespace")
    return raw.ljust(MAX_KEY_BYTES, b" ")


def pack_request(
    command: Command,
    key: str,
    length: int = 0,
    fmt: int = MemoryFormat.KV_2LTD,
    dtype: int = 2,
    shape: Sequence[int] = (),
) -> bytes:
    """One 186-byte request header. The defaults are what LMCache's client sends for GET/EXIST.

    Raises:
        ConfigError: a key, length, shape, fmt or dtype code the server would not accept.
    """
    if len(shape) > 4 or any(d < 0 for d in shape):
        raise ConfigError(f"lm:// shape {tuple(shape)} must have at most 4 non-negative dims")
    if not 0 <= length <= MAX_LENGTH:
        raise ConfigError(f"lm:// payload of {length} bytes does not fit a signed int32")
    # The server drops the connection on an unknown code; refuse it here with a reason instead.
    if int(fmt) not in _FORMAT_CODES or dtype not in _CODE_TO_DTYPE:
        raise ConfigError(f"lm:// fmt {int(fmt)} / dtype code {dtype} is not one LMCache knows")
    padded = list(shape) + [0] * (4 - len(shape))  # trailing zeros, as LMCache pads
    return REQUEST.pack(int(command), length, int(fmt), dtype, 0, *padded, encode_key(key))


class Reply(msgspec.Struct, frozen=True):
    """A decoded 36-byte reply header."""

    code: int
    length: int
    fmt: int
    dtype_code: int
    dims: tuple[int, int, int, int]  # the four shape ints as sent
    location: int


def unpack_reply(data: Buffer) -> Reply:
    """Decode a 36-byte reply header; nothing is validated here (see `refuse_reply`)."""
    code, length, fmt, dtype, d0, d1, d2, d3, location = RESPONSE.unpack(data)
    return Reply(code, length, fmt, dtype, (d0, d1, d2, d3), location)


def header_of(reply: Reply) -> ChunkHeader:
    """The chunk header a GET hit describes, shape padding stripped as LMCache strips it."""
    dims = list(reply.dims)
    if reply.fmt not in _BINARY_FORMATS:
        while len(dims) > 1 and dims[-1] == 0:
            dims.pop()
    code = 2 if reply.dtype_code == 1 else reply.dtype_code
    return ChunkHeader(reply.fmt, code, tuple(dims), reply.length)


def refuse_reply(reply: Reply, capacity: int, expected: ChunkHeader | None) -> ChunkHeader | None:
    """Check a GET reply before any payload byte is read; None on a miss.

    Raises:
        PeerError: the header is malformed: unknown code, fmt or dtype, negative dims, a length
            that is negative, disagrees with its own shape, or exceeds `capacity`.
        KVRefused: it is well formed but is not the `expected` chunk (names the field).
    """
    if reply.code == ReplyCode.FAIL:
        if reply.length != 0:
            raise PeerError(f"lm:// miss reply announces {reply.length} payload bytes")
        return None
    if reply.code != ReplyCode.SUCCESS:
        raise PeerError(f"lm:// reply code {reply.code} is neither 200 nor 400")
    if reply.length < 0:
        raise PeerError(f"lm:// reply announces a negative length {reply.length}")
    if reply.fmt not in _FORMAT_CODES:
        raise PeerError(f"lm:// reply has unknown memory format {reply.fmt}")
    if reply.dtype_code not in _CODE_TO_DTYPE:
        raise PeerError(f"lm:// reply has unknown dtype code {reply.dtype_code}")
    if any(d < 0 for d in reply.dims):
        raise PeerError(f"lm:// reply has negative shape {reply.dims}")
    header = header_of(reply)
    if reply.fmt not in _BINARY_FORMATS and reply.dtype_code != 0:
        want = math.prod(header.shape) * _CODE_ITEMSIZE[reply.dtype_code]
        if want != reply.length:
            raise PeerError(
                f"lm:// reply length {reply.length} disagrees with shape {header.shape} "
                f"dtype code {reply.dtype_code} ({want} bytes)"
            )
    if reply.length > capacity:
        raise PeerError(f"lm:// reply announces {reply.length} bytes, the buffer holds {capacity}")
    if expected is not None:
        for field in ("fmt", "dtype_code", "shape", "length"):
            want_v, got_v = getattr(expected, field), getattr(header, field)
            if want_v != got_v:
                raise KVRefused(f"lm:// chunk {field}: expected {want_v}, found {got_v}")
    return header


class _Connection:
    """One pool slot: a socket (connected lazily) and a reusable reply buffer."""

    def __init__(self, host: str, port: int, timeout_s: float):
        self.host, self.port, self.timeout_s = host, port, timeout_s
        self.sock: socket.socket | None = None
        self.reply_buf = bytearray(RESPONSE.size)
        self.num_requests = 0  # since connect; 0 means a failure cannot be a stale socket

    def ensure(self) -> socket.socket:
        if self.sock is None:
            sock = socket.create_connection((self.host, self.port), timeout=self.timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # headers are tiny
            self.sock, self.num_requests = sock, 0
        return self.sock

    def drop(self) -> None:
        """Close after a failure: the stream position is unknown, so the socket is useless."""
        if self.sock is not None:
            try:
                self.sock.close()
            except OSError:
                pass
            self.sock = None

    def send(self, *parts: Buffer) -> None:
        sock = self.ensure()
        if len(parts) > 1 and sum(memoryview(p).nbytes for p in parts) <= 65536:
            sock.sendall(b"".join(parts))  # one segment for small messages
        else:
            for part in parts:
                sock.sendall(part)
        self.num_requests += 1

    def recv_into(self, view: memoryview) -> None:
        """Fill `view` exactly; a closed stream is an error."""
        sock = self.sock
        if sock is None:
            raise ConnectionError("not connected")
        got, n = 0, len(view)
        while got < n:
            k = sock.recv_into(view[got:], n - got)
            if k == 0:
                raise ConnectionError("connection closed by the server")
            got += k

    def recv_reply(self) -> Reply:
        self.recv_into(memoryview(self.reply_buf))
        return unpack_reply(self.reply_buf)


class LMClient:
    """A client of one LMCache `lm://` server, with a pool of `connections` sockets.

    Args:
        host, port: the server (see `parse_lm_url`).
        connections: pool size; `put_many` / `get_many_into` split their items into this many
            stripes, each on its own connection and thread.
        timeout_s: limit for connecting and for each blocking socket operation.

    Every call that talks to the server raises `PeerError` (one line) when the server cannot be
    reached, closes the connection or replies with something malformed. A request that fails on
    a connection that already served requests is retried once on a fresh one: the server may
    have been restarted since. Nothing is connected until the first request.
    """

    def __init__(self, host: str, port: int, connections: int = 4, timeout_s: float = 10.0):
        if connections < 1:
            raise ConfigError(f"lm:// connections must be >= 1, got {connections}")
        self.host, self.port = host, port
        self.num_connections = connections
        self.timeout_s = timeout_s
        # FIFO: consecutive checkouts rotate through the pool, so stripes land on distinct sockets.
        self._pool: queue.Queue[_Connection] = queue.Queue()
        self._all = [_Connection(host, port, timeout_s) for _ in range(connections)]
        for conn in self._all:
            self._pool.put(conn)
        self._executor: ThreadPoolExecutor | None = None
        self._executor_lock = threading.Lock()
        self._closed = False

    @classmethod
    def from_url(cls, url: str, connections: int = 4, timeout_s: float = 10.0) -> LMClient:
        """An `LMClient` for `lm://HOST:PORT`."""
        host, port = parse_lm_url(url)
        return cls(host, port, connections=connections, timeout_s=timeout_s)

    @property
    def url(self) -> str:
        return f"lm://{self.host}:{self.port}"

    def num_open_connections(self) -> int:
        """How many pool sockets are connected right now (for stats and tests)."""
        return sum(conn.sock is not None for conn in self._all)

    # -- plumbing: checkout, one exchange with retry, stripes ------------------------------------

    def _checkout(self) -> _Connection:
        if self._closed:
            raise PeerError(f"{self.url}: client is closed")
        return self._pool.get()

    def _exchange(self, conn: _Connection, what: str, exchange: Callable[[_Connection], T]) -> T:
        """Run one request/reply `exchange` on `conn`; reconnect and retry once if `conn` was stale."""
        for attempt in (0, 1):
            reused = conn.sock is not None and conn.num_requests > 0
            try:
                return exchange(conn)
            except KVToolError:
                conn.drop()  # a refused reply leaves its body unread: the stream is unusable
                raise
            except OSError as e:  # timeouts, resets, refused connects, ConnectionError
                conn.drop()
                # A reset or EOF on a socket that served requests before may only mean that the
                # server restarted since; a timeout says nothing of the kind, so it is not retried.
                if attempt == 0 and reused and not isinstance(e, socket.timeout):
                    continue
                raise PeerError(f"{self.url}: {what} failed: {_describe(e)}") from None
        raise AssertionError("unreachable")

    def _run(self, what: str, exchange: Callable[[_Connection], T]) -> T:
        conn = self._checkout()
        try:
            return self._exchange(conn, what, exchange)
        finally:
            self._pool.put(conn)

    def _striped(
        self,
        items: Sequence[ItemT],
        one: Callable[[_Connection, ItemT], ResultT],
        on_result: Callable[[int, ResultT], None] | None = None,
        before_item: Callable[[int], None] | None = None,
    ) -> list[ResultT]:
        """`one(conn, item)` for every item: stripe g holds items g, g+N, ... on one connection.

        `before_item(i)`, if given, is called from the stripe's thread before item i starts (it
        may block, e.g. until the item's buffer is free); `on_result(i, result)` as each ends.
        """
        results: list[ResultT] = [None] * len(items)  # type: ignore[list-item]
        num_stripes = min(self.num_connections, len(items))

        def run_stripe(g: int) -> None:
            conn = self._checkout()
            try:
                for i in range(g, len(items), num_stripes):
                    if before_item is not None:
                        before_item(i)
                    results[i] = one(conn, items[i])
                    if on_result is not None:
                        on_result(i, results[i])
            finally:
                self._pool.put(conn)

        if num_stripes <= 1:
            if items:
                run_stripe(0)
            return results
        with self._executor_lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self.num_connections, thread_name_prefix="lm-wire")
            executor = self._executor
        for future in [executor.submit(run_stripe, g) for g in range(num_stripes)]:
            future.result()
        return results

    # -- requests ---------------------------------------------------------------------------------

    def health(self) -> bool:
        """True when the server answers HEALTH with 200; False when it is unreachable or unhealthy."""

        def exchange(conn: _Connection) -> bool:
            conn.send(pack_request(Command.HEALTH, HEALTH_KEY))
            return conn.recv_reply().code == ReplyCode.SUCCESS

        try:
            return self._run("HEALTH", exchange)
        except PeerError:
            return False

    def exists(self, key: str) -> bool:
        """Whether the server holds `key` (one EXIST). Raises PeerError on failure."""
        return self.exist_many([key])[0]

    def exist_many(self, keys: Sequence[str]) -> list[bool]:
        """EXIST for each key, pipelined on one connection; answers in the order of `keys`.

        Raises PeerError on failure (no partial answer is returned).
        """
        requests = [pack_request(Command.EXIST, k) for k in keys]

        def exchange(conn: _Connection) -> list[bool]:
            found: list[bool] = []
            for i in range(0, len(requests), PIPELINE_DEPTH):
                batch = requests[i : i + PIPELINE_DEPTH]
                conn.send(b"".join(batch))
                for _ in batch:
                    found.append(_exist_code(conn.recv_reply()))
            return found

        return self._run("EXIST", exchange) if requests else []

    def put(self, key: str, payload: Buffer, fmt: int, dtype_code: int, shape: Sequence[int]) -> None:
        """Store `payload` under `key`; return only once the server confirms it holds the key.

        PUT has no reply, so an EXIST on the same connection follows it: the server handles one
        connection's requests in order, so its 200 proves that this PUT was stored.

        Args:
            payload: the chunk bytes, any C-contiguous buffer (see `tensor_buffer`); not copied.
            fmt, dtype_code, shape: announced as given; the server does not check them.

        Raises:
            PeerError: the transfer failed or the EXIST did not find the key.
        """
        conn = self._checkout()
        try:
            self._put_on(conn, key, payload, fmt, dtype_code, shape)
        finally:
            self._pool.put(conn)

    def _put_on(
        self, conn: _Connection, key: str, payload: Buffer, fmt: int, dtype_code: int, shape: Sequence[int]
    ) -> None:
        view = memoryview(payload).cast("B")
        header = pack_request(Command.PUT, key, view.nbytes, fmt, dtype_code, shape)
        confirm = pack_request(Command.EXIST, key)

        def exchange(c: _Connection) -> bool:
            c.send(header, view, confirm)
            return _exist_code(c.recv_reply())

        if not self._exchange(conn, "PUT", exchange):
            raise PeerError(f"{self.url}: PUT of {key} was not stored")

    def put_many(self, items: Sequence[tuple[str, Buffer, ChunkHeader]]) -> list[bool]:
        """`put` each `(key, payload, header)`, striped over the pool; True where confirmed.

        A failed item is logged and reported as False; it does not stop the others.

        Raises:
            ConfigError: a payload's size differs from its `header.length` (checked up front).
        """
        for key, payload, header in items:
            if memoryview(payload).nbytes != header.length:
                num_bytes = memoryview(payload).nbytes
                raise ConfigError(f"payload of {key} is {num_bytes} bytes, its header says {header.length}")

        def put_one(conn: _Connection, item: tuple[str, Buffer, ChunkHeader]) -> bool:
            key, payload, header = item
            try:
                self._put_on(conn, key, payload, header.fmt, header.dtype_code, header.shape)
                return True
            except PeerError as e:
                logger.warning("%s", e)
                return False

        return self._striped(items, put_one)

    def get_into(self, key: str, buf: Buffer, expected: ChunkHeader | None = None) -> ChunkHeader | None:
        """GET `key` straight into `buf`; the chunk's header on a hit, None on a miss.

        Args:
            buf: a writable buffer, e.g. `tensor_buffer` of a (pinned) host tensor. The payload
                fills its first `header.length` bytes; nothing else is allocated.
            expected: if given, the reply must match it exactly (fmt, dtype, shape, length).

        Raises:
            PeerError: transfer failure, or a malformed reply or impossible length; then no
                payload byte is read and the connection is dropped.
            KVRefused: a well-formed reply that is not `expected`.
        """
        conn = self._checkout()
        try:
            return self._get_on(conn, key, buf, expected)
        finally:
            self._pool.put(conn)

    def _get_on(
        self, conn: _Connection, key: str, buf: Buffer, expected: ChunkHeader | None
    ) -> ChunkHeader | None:
        target = memoryview(buf).cast("B")
        if target.readonly:
            raise ValueError("get_into needs a writable buffer")
        request = pack_request(Command.GET, key)
        capacity = target.nbytes if expected is None else min(target.nbytes, expected.length)

        def exchange(c: _Connection) -> ChunkHeader | None:
            c.send(request)
            header = refuse_reply(c.recv_reply(), capacity, expected)
            if header is not None and header.length:
                c.recv_into(target[: header.length])
            return header

        return self._exchange(conn, "GET", exchange)

    def get_many_into(
        self,
        items: Sequence[tuple[str, Buffer, ChunkHeader | None]],
        on_result: Callable[[int, ChunkHeader | KVToolError | None], None] | None = None,
        before_item: Callable[[int], None] | None = None,
    ) -> list[ChunkHeader | KVToolError | None]:
        """`get_into` each `(key, buf, expected)`, striped over the pool.

        Returns, per item in order: its header on a hit, None on a miss, or the error (PeerError
        or KVRefused, returned, not raised) of an item that failed, so that one bad chunk leaves
        the others' results usable. `on_result(i, result)` is called as each item ends (from a
        stripe thread), so a caller can consume chunks while the rest are still arriving;
        `before_item(i)` before item i starts, so a caller can recycle a ring of buffers.
        """

        def get_one(
            conn: _Connection, item: tuple[str, Buffer, ChunkHeader | None]
        ) -> ChunkHeader | KVToolError | None:
            try:
                return self._get_on(conn, *item)
            except KVToolError as e:
                return e

        return self._striped(items, get_one, on_result, before_item)

    def close(self) -> None:
        """Close every connection and the stripe threads. Call it when no request is in flight."""
        self._closed = True
        with self._executor_lock:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
        for conn in self._all:
            conn.drop()

    def __enter__(self) -> LMClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _exist_code(reply: Reply) -> bool:
    if reply.code == ReplyCode.SUCCESS:
        found = True
    elif reply.code == ReplyCode.FAIL:
        found = False
    else:
        raise PeerError(f"lm:// EXIST reply code {reply.code} is neither 200 nor 400")
    if reply.length != 0:
        raise PeerError(f"lm:// EXIST reply announces {reply.length} payload bytes")
    return found


def _describe(e: OSError) -> str:
    if isinstance(e, socket.timeout):
        return "timed out"
    return str(e) or type(e).__name__
