"""The identity header of a disk-tier block file, and the checks that refuse foreign ones.

A block file is:

    offset 0   MAGIC                b"KVTOOLKV"                      8 bytes
           8   header_len           u32 little-endian                4 bytes
          12   header_digest        blake3(header_json)[:16]        16 bytes
          28   header_json          msgspec JSON of KVBlockHeader   header_len bytes
               zero padding         up to the next 4096-byte boundary
           P   payload              the block's KV bytes            payload_bytes bytes

P = align_up(28 + header_len, 4096), so the payload can be read with O_DIRECT into an
aligned (pinned) buffer; one 4 KiB read covers prefix and header of any usual block.
Every format version keeps the magic, this prefix and a JSON header holding
`format_version`, so that a reader recognises a newer file and refuses it by name.

The header carries the writer's whole identity (KVIdentity: model, config, weights, dtype,
geometry, layout, hash chain, parallelism, format) plus the block's own fields (block hash,
token count, payload length, payload checksum). A reader refuses the file unless every
compared identity field equals its own; the refusal names every field that differs.
"""

from __future__ import annotations

import os
import struct
import sys
from typing import TYPE_CHECKING, Literal, Union

import blake3
import msgspec

from kvtool import __version__
from kvtool.engine.errors import ConfigError, KVRefused

if TYPE_CHECKING:  # kv_pages imports torch, which `kvtool inspect` does not need
    from kvtool.engine.kv.pages import KVGeometry

FORMAT_VERSION = 1
MAGIC = b"KVTOOLKV"
# magic, header length, first 16 bytes of blake3(header_json)
HEADER_PREFIX = struct.Struct("<8sI16s")
MAX_HEADER_BYTES = 64 * 1024
PAYLOAD_ALIGN = 4096
CHECKSUM_ALGORITHM = "blake3"
# Digest bytes of the block-hash functions vLLM names (vllm/utils/hashing.py).
BLOCK_HASH_BYTES = {"sha256": 32, "sha256_cbor": 32, "xxhash": 16, "xxhash_cbor": 16}
# Above this, blake3 hashes with several threads (it releases the GIL).
_PARALLEL_HASH_BYTES = 1 << 20

# Recorded in every header but not compared: the engine id names the writer, so that several
# engines sharing one root_dir reuse each other's blocks; the writer version lets a kvtool
# upgrade that keeps FORMAT_VERSION keep its tier. format_version governs the bytes.
PROVENANCE_FIELDS = ("writer_version", "engine_id")

FieldValue = Union[str, int, None]

# What is wrong with a tier file; `TierFileRefused.problem` and the inspect report use these.
BlockProblem = Literal[
    "foreign_format",  # not a kvtool block file (bad magic), or an unsupported older format
    "future_format",  # written by a newer kvtool format this one cannot read
    "corrupt",  # header digest, header JSON, header length or trailing bytes wrong
    "truncated",  # shorter than its header says
    "torn",  # payload checksum fails
    "misplaced",  # header's block hash or identity does not match the file's path
    "foreign_identity",  # written under a different engine config
    "size_mismatch",  # payload length differs from the destination buffer
    "missing",  # the file vanished (evicted by another process)
    "not_regular",  # a symbolic link, directory, FIFO, socket or device where a file belongs
    "unreadable",  # permission denied (or another I/O error) opening or reading it
    "sparse",  # has holes: its size claims bytes that were never written
]


class TierFileRefused(KVRefused):
    """A tier file failed a check; `problem` says which kind of failure (a BlockProblem)."""

    def __init__(self, problem: BlockProblem, message: str) -> None:
        super().__init__(message)
        self.problem: BlockProblem = problem

    def __reduce__(self) -> tuple:
        # Survives pickling, should a worker half report it from another process.
        return (type(self), (self.problem, str(self)))


class KVIdentity(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Everything that decides whether KV bytes written by one engine are valid in another.

    Shared by every block an engine config writes. All fields but PROVENANCE_FIELDS are
    compared on every read; see `identity_differences`.
    """

    # -- format
    format_version: int  # layout of the file itself; a newer one is refused as future format
    writer_version: str  # kvtool.__version__ of the writer (provenance, not compared)
    checksum_algorithm: str  # of payload_checksum; "blake3"
    # -- model
    model_name: str  # the --model string
    config_digest: str  # digest of the model's config.json
    weights_digest: str  # digest of the weights (or of the dummy-weight seed)
    architecture: str  # e.g. "Qwen3ForCausalLM"
    weight_quantization: str  # "none" or the scheme's name
    rope_digest: str  # digest of rope theta and scaling: positions baked into K
    sliding_window: int | None  # None: full attention
    # -- KV bytes
    kv_dtype: str  # the pages': "float32" | "bfloat16" | "float16" | "float8_e4m3fn" | "float8_e5m2"
    kv_quantization: str  # "none" or the scheme's name
    num_layers: int  # layers this rank stores (its pipeline stage)
    num_kv_heads: int  # KV heads this rank stores (its tensor-parallel shard)
    head_dim: int
    element_size: int  # bytes per element
    byte_layout: str  # "block_major": [k, 2, L, block_size, H, D] for k = offload/block_size
    byte_order: str  # "little" | "big": element byte order of the writer
    block_size: int  # engine page tokens
    offload_block_tokens: int  # tokens per tier block (a multiple of block_size)
    # -- keys
    hash_algorithm: str  # block-hash function, e.g. "sha256_cbor"
    none_hash_seed: str  # seed string of the hash chain (NONE_HASH = hash(seed))
    # -- parallelism
    tp_size: int
    tp_rank: int
    pp_size: int
    pp_rank: int
    # -- writer
    engine_id: str  # kv_transfer_config.engine_id of the writer (provenance, not compared)

    @property
    def offload_block_bytes(self) -> int:
        """Payload bytes of one full tier block under this identity's geometry."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.element_size * self.offload_block_tokens


class KVBlockHeader(KVIdentity, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The header of one block file: the writer's identity plus this block's own fields."""

    block_hash: str  # hex of the block hash (the file name, checked on read)
    num_tokens: int  # tokens of KV in the payload
    payload_bytes: int  # length of the payload that follows the header
    payload_checksum: str  # blake3 hex of the payload

    def tier_identity(self) -> KVIdentity:
        """The per-tier part of this header (drops the per-block fields)."""
        return KVIdentity(**{f: getattr(self, f) for f in KVIdentity.__struct_fields__})


class FieldDiff(msgspec.Struct, frozen=True):
    """One identity field on which a file disagrees with the engine."""

    field: str
    expected: FieldValue
    found: FieldValue


class _FormatProbe(msgspec.Struct):
    """Reads only format_version, so a future header is recognised whatever else it holds."""

    format_version: int


COMPARED_FIELDS: tuple[str, ...] = tuple(f for f in KVIdentity.__struct_fields__ if f not in PROVENANCE_FIELDS)
BLOCK_FIELDS: tuple[str, ...] = tuple(
    f for f in KVBlockHeader.__struct_fields__ if f not in KVIdentity.__struct_fields__
)


def make_identity(
    *,
    model_name: str,
    config_digest: str,
    weights_digest: str,
    architecture: str,
    geometry: KVGeometry,
    offload_block_tokens: int,
    none_hash_seed: str,
    rope_digest: str,
    engine_id: str,
    hash_algorithm: str = "sha256_cbor",
    sliding_window: int | None = None,
    weight_quantization: str = "none",
    kv_quantization: str = "none",
    byte_layout: str = "block_major",
    tp_size: int = 1,
    tp_rank: int = 0,
    pp_size: int = 1,
    pp_rank: int = 0,
    writer_version: str | None = None,
) -> KVIdentity:
    """Build the running engine's identity; called once when the engine creates its disk tier.

    `geometry` is this rank's page geometry (its layers and KV-head shard). Raises ConfigError
    when the values cannot describe a tier (offload block not a multiple of the block size,
    rank outside its group size, empty names).
    """
    if offload_block_tokens <= 0 or offload_block_tokens % geometry.block_size:
        raise ConfigError(
            f"offload block of {offload_block_tokens} tokens is not a positive multiple "
            f"of the block size {geometry.block_size}"
        )
    if not 0 <= tp_rank < tp_size:
        raise ConfigError(f"tensor-parallel rank {tp_rank} is outside size {tp_size}")
    if not 0 <= pp_rank < pp_size:
        raise ConfigError(f"pipeline-parallel rank {pp_rank} is outside size {pp_size}")
    for name, value in (("model_name", model_name), ("hash_algorithm", hash_algorithm), ("engine_id", engine_id)):
        if not value:
            raise ConfigError(f"disk tier identity needs a non-empty {name}")
    identity = KVIdentity(
        format_version=FORMAT_VERSION,
        writer_version=writer_version if writer_version is not None else __version__,
        checksum_algorithm=CHECKSUM_ALGORITHM,
        model_name=model_name,
        config_digest=config_digest,
        weights_digest=weights_digest,
        architecture=architecture,
        weight_quantization=weight_quantization,
        rope_digest=rope_digest,
        sliding_window=sliding_window,
        kv_dtype=geometry.dtype,
        kv_quantization=kv_quantization,
        num_layers=geometry.num_layers,
        num_kv_heads=geometry.num_kv_heads,
        head_dim=geometry.head_dim,
        element_size=geometry.element_size,
        byte_layout=byte_layout,
        byte_order=sys.byteorder,
        block_size=geometry.block_size,
        offload_block_tokens=offload_block_tokens,
        hash_algorithm=hash_algorithm,
        none_hash_seed=none_hash_seed,
        tp_size=tp_size,
        tp_rank=tp_rank,
        pp_size=pp_size,
        pp_rank=pp_rank,
        engine_id=engine_id,
    )
    # The header also holds the block hash and checksums: half the limit leaves room for them,
    # so that whatever this engine writes, it can read back.
    num_bytes = len(msgspec.json.encode(identity))
    if num_bytes > MAX_HEADER_BYTES // 2:
        raise ConfigError(
            f"disk tier identity is {num_bytes} bytes, more than a block header holds ({MAX_HEADER_BYTES // 2}); "
            "shorten engine_id or the --model string"
        )
    return identity


def make_digest(value: object) -> str:
    """blake3 hex of `value` as canonical JSON (sorted keys): for config, rope and weight digests."""
    return blake3.blake3(msgspec.json.encode(value, order="sorted")).hexdigest()


def tier_digest(identity: KVIdentity) -> str:
    """Short digest of the compared identity fields; names the identity's directory in the tier.

    Two configs never share a file name, and engines differing only in provenance fields do.
    The header, not this digest, is what a read trusts.
    """
    compared = {f: getattr(identity, f) for f in COMPARED_FIELDS}
    return make_digest(compared)[:16]


def identity_differences(expected: KVIdentity, found: KVIdentity) -> list[FieldDiff]:
    """Every compared identity field on which `found` disagrees with `expected`, in field order."""
    return [
        FieldDiff(f, getattr(expected, f), getattr(found, f))
        for f in COMPARED_FIELDS
        if getattr(expected, f) != getattr(found, f)
    ]


def count_fields(n: int) -> str:
    """`1 identity field differs` / `3 identity fields differ`."""
    return f"{n} identity field differs" if n == 1 else f"{n} identity fields differ"


def describe_differences(diffs: list[FieldDiff]) -> str:
    """`kv_dtype (expected 'bfloat16', found 'float32'), block_size (expected 16, found 32)`."""
    return ", ".join(f"{d.field} (expected {d.expected!r}, found {d.found!r})" for d in diffs)


def refuse_foreign_header(expected: KVIdentity, found: KVIdentity, what: str = "disk tier block") -> None:
    """Raise TierFileRefused("foreign_identity") naming every differing field with both values.

    Called on every read before any payload byte is handed out; returns None when they agree.
    """
    diffs = identity_differences(expected, found)
    if diffs:
        raise TierFileRefused(
            "foreign_identity",
            f"{what} refused: written under a different engine config; {count_fields(len(diffs))}: "
            f"{describe_differences(diffs)}",
        )


def payload_checksum(data: bytes | memoryview) -> str:
    """blake3 hex of a payload, multi-threaded for large blocks."""
    if len(data) >= _PARALLEL_HASH_BYTES:
        return blake3.blake3(data, max_threads=blake3.blake3.AUTO).hexdigest()
    return blake3.blake3(data).hexdigest()


def make_block_header(
    identity: KVIdentity, block_hash_hex: str, num_tokens: int, payload_bytes: int, checksum: str
) -> KVBlockHeader:
    """The header for one block written under `identity`."""
    fields = {f: getattr(identity, f) for f in KVIdentity.__struct_fields__}
    return KVBlockHeader(
        **fields,
        block_hash=block_hash_hex,
        num_tokens=num_tokens,
        payload_bytes=payload_bytes,
        payload_checksum=checksum,
    )


def payload_offset_for(header_len: int) -> int:
    """Where the payload starts after a header of `header_len` bytes (a PAYLOAD_ALIGN multiple)."""
    return -(-(HEADER_PREFIX.size + header_len) // PAYLOAD_ALIGN) * PAYLOAD_ALIGN


def encode_header(header: KVBlockHeader) -> bytes:
    """Prefix, header JSON and padding: the bytes that precede the payload in a block file."""
    body = msgspec.json.encode(header)
    prefix = HEADER_PREFIX.pack(MAGIC, len(body), blake3.blake3(body).digest()[:16])
    return prefix + body + bytes(payload_offset_for(len(body)) - HEADER_PREFIX.size - len(body))


_HEADER_DECODER = msgspec.json.Decoder(KVBlockHeader)
_PROBE_DECODER = msgspec.json.Decoder(_FormatProbe)


def parse_prefix(buf: bytes, file_bytes: int, where: str) -> int:
    """Check the fixed prefix at the start of `buf`; return the payload offset (after header and padding).

    `file_bytes` is the whole file's size. Raises TierFileRefused: foreign_format (bad magic),
    truncated (file ends inside the prefix or header), corrupt (absurd header length).
    """
    if len(buf) < HEADER_PREFIX.size:
        if MAGIC.startswith(bytes(buf[: len(MAGIC)])):
            raise TierFileRefused("truncated", f"{where}: truncated inside the header prefix ({file_bytes} bytes)")
        raise TierFileRefused("foreign_format", f"{where}: not a kvtool block file (bad magic)")
    magic, header_len, _ = HEADER_PREFIX.unpack_from(buf)
    if magic != MAGIC:
        raise TierFileRefused("foreign_format", f"{where}: not a kvtool block file (bad magic {magic!r})")
    if header_len > MAX_HEADER_BYTES:
        raise TierFileRefused("corrupt", f"{where}: header length {header_len} exceeds {MAX_HEADER_BYTES}")
    payload_offset = payload_offset_for(header_len)
    if file_bytes < payload_offset:
        raise TierFileRefused(
            "truncated", f"{where}: truncated inside the header ({file_bytes} of at least {payload_offset} bytes)"
        )
    return payload_offset


def parse_header(buf: bytes, file_bytes: int, where: str) -> tuple[KVBlockHeader, int]:
    """Decode the header from `buf`, the first bytes of a file of `file_bytes` bytes.

    `buf` must hold the whole header (`parse_prefix` says how long it is). Checks magic,
    header digest, format version, strict field types, and that the file is exactly header +
    payload long. Returns (header, payload_offset). Raises TierFileRefused with the problem
    kind; `where` names the file in messages.
    """
    payload_offset = parse_prefix(buf, file_bytes, where)
    if len(buf) < payload_offset:
        raise TierFileRefused("truncated", f"{where}: header cut short ({len(buf)} of {payload_offset} bytes)")
    _, header_len, digest = HEADER_PREFIX.unpack_from(buf)
    body_end = HEADER_PREFIX.size + header_len
    body = bytes(buf[HEADER_PREFIX.size : body_end])
    if blake3.blake3(body).digest()[:16] != digest:
        raise TierFileRefused("corrupt", f"{where}: header checksum mismatch (corrupt header)")
    if buf[body_end:payload_offset].count(0) != payload_offset - body_end:
        raise TierFileRefused("corrupt", f"{where}: non-zero bytes in the header padding")
    try:
        version = _PROBE_DECODER.decode(body).format_version
    except msgspec.DecodeError as e:
        raise TierFileRefused("corrupt", f"{where}: unreadable header ({e})") from None
    if version > FORMAT_VERSION:
        raise TierFileRefused(
            "future_format",
            f"{where}: future format version {version}; this kvtool reads format {FORMAT_VERSION} "
            "(upgrade kvtool to use it)",
        )
    if version != FORMAT_VERSION:
        raise TierFileRefused("foreign_format", f"{where}: unsupported format version {version}")
    try:
        header = _HEADER_DECODER.decode(body)
    except msgspec.DecodeError as e:
        raise TierFileRefused("corrupt", f"{where}: invalid header ({e})") from None
    expected_bytes = payload_offset + header.payload_bytes
    if file_bytes < expected_bytes:
        raise TierFileRefused("truncated", f"{where}: truncated ({file_bytes} of {expected_bytes} bytes)")
    if file_bytes > expected_bytes:
        raise TierFileRefused("corrupt", f"{where}: {file_bytes - expected_bytes} trailing bytes after the payload")
    return header, payload_offset


def read_header_fd(fd: int, file_bytes: int, where: str) -> tuple[KVBlockHeader, int]:
    """Read and check the header of an open block file of `file_bytes` bytes (see `parse_header`).

    One pread covers the usual header; a longer one costs a second. Raises TierFileRefused.
    """
    buf = os.pread(fd, PAYLOAD_ALIGN, 0)
    payload_offset = parse_prefix(buf, file_bytes, where)
    if len(buf) < payload_offset:
        buf = os.pread(fd, payload_offset, 0)
    return parse_header(buf, file_bytes, where)
