"""The lm:// wire: LMCache's protocol (protocol.py) and kvtool's client of it (client.py).

One import point for both: `from kvtool.engine.connectors.lmcache.wire import LMClient, ...`.
"""

from kvtool.engine.connectors.lmcache.client import DEFAULT_BACKOFF_S, PIPELINE_DEPTH, LMClient
from kvtool.engine.connectors.lmcache.protocol import (
    HEALTH_KEY,
    MAX_KEY_BYTES,
    MAX_LENGTH,
    REQUEST,
    RESPONSE,
    Buffer,
    ChunkHeader,
    Command,
    MemoryFormat,
    Reply,
    ReplyCode,
    dtype_code,
    encode_key,
    exist_code,
    header_of,
    kv_chunk_header,
    pack_request,
    parse_lm_url,
    refuse_reply,
    tensor_buffer,
    torch_dtype_from_code,
    unpack_reply,
)

__all__ = [
    "DEFAULT_BACKOFF_S", "HEALTH_KEY", "MAX_KEY_BYTES", "MAX_LENGTH", "PIPELINE_DEPTH", "REQUEST", "RESPONSE",
    "Buffer", "ChunkHeader", "Command", "LMClient", "MemoryFormat", "Reply", "ReplyCode", "dtype_code",
    "encode_key", "exist_code", "header_of", "kv_chunk_header", "pack_request", "parse_lm_url", "refuse_reply",
    "tensor_buffer", "torch_dtype_from_code", "unpack_reply",
]
