"""lm:// headers byte for byte, as LMCache's `lmcache/v1/protocol.py` packs them; reply checks."""

from __future__ import annotations

import pytest
import torch

from kvtool.engine.connectors.lmcache.stores import protocol
from kvtool.engine.connectors.lmcache.stores.protocol import ChunkHeader, Command, MemoryFormat
from kvtool.engine.errors import ConfigError, KVRefused, PeerError

KEY = "Qwen/Qwen3-0.6B@1@0@31375f4bc7c57397@bfloat16"
KEY_FIELD = KEY.encode().hex() + "20" * 105
FULL_CHUNK = (2, 28, 256, 1024)

# docs 7.5: serialisations produced by LMCache's own ClientMetaMessage / ServerMetaMessage.
CLIENT_PUT = "010000000000c001010000000300000000000000020000001c0000000001000000040000" + KEY_FIELD
CLIENT_GET = "020000000000000001000000020000000000000000000000000000000000000000000000" + KEY_FIELD
CLIENT_EXIST = "030000000000000001000000020000000000000000000000000000000000000000000000" + KEY_FIELD
CLIENT_HEALTH = "050000000000000001000000020000000000000000000000000000000000000000000000" + KEY_FIELD
SERVER_GET_OK = "c80000000000c0010100000003000000020000001c000000000100000004000000000000"
SERVER_FAIL = "900100000000000001000000020000000000000000000000000000000000000000000000"


def test_struct_sizes():
    assert protocol.REQUEST.size == 186
    assert protocol.RESPONSE.size == 36


def test_health_request_matches_dump_7_1():
    expected = bytes.fromhex(
        "05000000" "00000000" "01000000" "02000000" "00000000" "00000000" "00000000" "00000000" "00000000"
    ) + b"health@1@0@0@half" + b" " * (150 - 17)
    assert protocol.pack_request(Command.HEALTH, protocol.HEALTH_KEY) == expected
    assert len(expected) == 186


@pytest.mark.parametrize(
    ("command", "vector"),
    [(Command.GET, CLIENT_GET), (Command.EXIST, CLIENT_EXIST), (Command.HEALTH, CLIENT_HEALTH)],
)
def test_keyed_requests_match_lmcache_client(command, vector):
    assert protocol.pack_request(command, KEY).hex() == vector


def test_full_chunk_put_matches_lmcache_client():
    header = protocol.kv_chunk_header(FULL_CHUNK, torch.bfloat16)
    assert header.length == 29_360_128
    packed = protocol.pack_request(Command.PUT, KEY, header.length, header.fmt, header.dtype_code, header.shape)
    assert packed.hex() == CLIENT_PUT


def test_small_put_header_matches_dump_7_4():
    packed = protocol.pack_request(Command.PUT, KEY, 256, MemoryFormat.KV_2LTD, 3, (2, 2, 4, 8))
    assert packed[:36] == bytes.fromhex(
        "01000000" "00010000" "01000000" "03000000" "00000000" "02000000" "02000000" "04000000" "08000000"
    )
    assert packed[36:] == KEY.encode() + b" " * 105  # spaces, never NULs


def test_shorter_shapes_pad_with_trailing_zeros():
    packed = protocol.pack_request(Command.PUT, KEY, 7, MemoryFormat.BINARY, 0, (7,))
    assert packed[20:36] == bytes.fromhex("07000000" "00000000" "00000000" "00000000")


def test_server_get_ok_decodes_to_the_full_chunk():
    reply = protocol.unpack_reply(bytes.fromhex(SERVER_GET_OK))
    assert reply == protocol.Reply(200, 29_360_128, 1, 3, FULL_CHUNK, 0)
    expected = protocol.kv_chunk_header(FULL_CHUNK, torch.bfloat16)
    assert protocol.refuse_reply(reply, capacity=expected.length, expected=expected) == expected


def test_server_fail_is_a_miss():
    reply = protocol.unpack_reply(bytes.fromhex(SERVER_FAIL))
    assert reply.code == 400 and reply.location == 0
    assert protocol.refuse_reply(reply, capacity=0, expected=None) is None


def _reply(code=200, length=256, fmt=1, dtype=3, dims=(2, 2, 4, 8)) -> protocol.Reply:
    return protocol.Reply(code, length, fmt, dtype, dims, 0)


@pytest.mark.parametrize(
    ("reply", "capacity", "message"),
    [
        (_reply(length=-1), 256, "negative length"),
        (_reply(length=2**31 - 1, fmt=4, dtype=0, dims=(2**31 - 1, 0, 0, 0)), 256, "buffer holds 256"),
        (_reply(length=512, dims=(2, 2, 8, 8)), 256, "buffer holds 256"),
        (_reply(length=300), 1024, "disagrees with shape"),
        (_reply(code=500), 256, "neither 200 nor 400"),
        (_reply(fmt=99), 256, "unknown memory format"),
        (_reply(dtype=42), 256, "unknown dtype code"),
        (_reply(dims=(2, -2, 4, 8)), 256, "negative shape"),
        (_reply(code=400, length=16), 256, "miss reply announces"),
    ],
)
def test_impossible_replies_are_refused(reply, capacity, message):
    with pytest.raises(PeerError, match=message):
        protocol.refuse_reply(reply, capacity, expected=None)


def test_reply_other_than_expected_names_the_field():
    expected = protocol.kv_chunk_header((2, 2, 4, 8), torch.bfloat16)
    with pytest.raises(KVRefused, match=r"dtype_code: expected 3, found 2"):
        protocol.refuse_reply(_reply(dtype=2), 256, expected)
    with pytest.raises(KVRefused, match=r"shape: expected \(2, 2, 4, 8\), found \(2, 4, 2, 8\)"):
        protocol.refuse_reply(_reply(dims=(2, 4, 2, 8)), 256, expected)


def test_shape_padding_is_stripped_except_for_binary():
    assert protocol.header_of(_reply(dims=(2, 28, 88, 1024))).shape == (2, 28, 88, 1024)
    assert protocol.header_of(_reply(fmt=2, dims=(16, 2, 1024, 0))).shape == (16, 2, 1024)
    assert protocol.header_of(_reply(fmt=4, dtype=0, length=5, dims=(5, 0, 0, 0))).shape == (5, 0, 0, 0)


def test_dtype_codes():
    assert protocol.dtype_code(torch.bfloat16) == 3
    assert protocol.dtype_code(torch.float16) == 2  # LMCache encodes half as 2, never 1
    assert protocol.dtype_code(torch.float32) == 4
    assert protocol.dtype_code(torch.uint8) == 6
    assert protocol.torch_dtype_from_code(1) is torch.float16  # accepted on receive
    assert protocol.torch_dtype_from_code(2) is torch.float16
    assert protocol.torch_dtype_from_code(3) is torch.bfloat16
    assert protocol.header_of(_reply(dtype=1, dims=(2, 2, 4, 8))).dtype_code == 2
    with pytest.raises(ConfigError):
        protocol.dtype_code(torch.int32)
    with pytest.raises(PeerError):
        protocol.torch_dtype_from_code(42)


def test_keys_longer_than_150_bytes_are_refused():
    protocol.encode_key("m" * 120 + "@1@0@31375f4bc7c57397@bfloat16")  # 150 bytes: fits
    with pytest.raises(ConfigError, match="151 bytes"):
        protocol.encode_key("m" * 121 + "@1@0@31375f4bc7c57397@bfloat16")
    with pytest.raises(ConfigError, match="151 bytes"):
        protocol.encode_key("é" * 50 + "x" * 51)  # counted in bytes, not characters


def test_never_packs_what_the_server_would_drop_the_connection_for():
    with pytest.raises(ConfigError):
        protocol.pack_request(Command.PUT, KEY, -1)
    with pytest.raises(ConfigError):
        protocol.pack_request(Command.PUT, KEY, 0, shape=(1, 1, 1, 1, 1))
    with pytest.raises(ConfigError):
        protocol.pack_request(Command.PUT, KEY, 4, fmt=99, dtype=3, shape=(4,))
    with pytest.raises(ConfigError):
        protocol.pack_request(Command.PUT, KEY, 4, fmt=1, dtype=42, shape=(4,))


def test_parse_lm_url():
    assert protocol.parse_lm_url("lm://localhost:65432") == ("localhost", 65432)
    assert protocol.parse_lm_url("lm://127.0.0.1:9000/ignored?x=1") == ("127.0.0.1", 9000)
    for bad in ("redis://h:1", "lm://h", "lm://:5", "lm://h:port"):
        with pytest.raises(ConfigError):
            protocol.parse_lm_url(bad)


def test_chunk_header_is_a_frozen_struct():
    header = ChunkHeader(1, 3, (2, 28, 16, 1024), 1_835_008)
    assert header == protocol.kv_chunk_header((2, 28, 16, 1024), torch.bfloat16)
    with pytest.raises(AttributeError):
        header.length = 0  # type: ignore[misc]
