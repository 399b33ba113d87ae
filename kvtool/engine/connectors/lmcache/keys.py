"""LMCache cache keys and chunk hashes, byte-identical with LMCache 0.5.6's `ChunkedTokenDatabase`.

The key strings and the key settings live here; the chunk hash functions in chunk_hashes.py, and
CPython's `hash()` (the `builtin` mode) in cpython_hash.py.

A *key* is the string LMCache's `CacheEngineKey.to_string()` produces and the lm:// wire carries:

    {model}@{world_size}@{worker_id}@{chunk_hash:x}@{dtype_str}[@{layer_id}][@{tag}%{value}]...

The hash is `format(h, "x")`: lower case, no `0x`, no zero padding, a leading `-` for the
negative hashes of builtin mode. `dtype_str` is LMCache's name for the KV torch dtype
(float16 -> `half`, float32 -> `float`, table `_TORCH_TO_LMCACHE_DTYPE`).

A *chunk* is LMCache's unit: chunk i covers tokens [i*cs, min((i+1)*cs, n)). The chain always
starts at token 0 and carries a 64-bit int (the *fold*: the first 8 bytes of a digest, big-endian):

    h[-1] = NONE_HASH
    h[i]  = fold(H((h[i-1], tuple(chunk_i), ())))

| hash_algo            | H                              | NONE_HASH                          |
|----------------------|--------------------------------|------------------------------------|
| `vllm`/`sha256_cbor` | SHA-256 over canonical CBOR    | fold(SHA-256(cbor(seed)))          |
| `sha256`             | SHA-256 over pickle protocol 5 | fold(SHA-256(pickle(seed)))        |
| `builtin`            | CPython 3.11 `hash()`, signed, | `hash(seed)` under PYTHONHASHSEED= |
|                      | never folded                   | seed; 0 for a peer without vLLM    |
| `blake3`             | BLAKE3 over canonical CBOR     | fold(BLAKE3(cbor(seed))), or with  |
|                      |                                | an identity digest d:              |
|                      |                                | fold(BLAKE3(cbor((seed, d))))      |

`seed` is `none_hash_seed` (the peer's `PYTHONHASHSEED`) when given, else `"vllm-none-hash"`
(vLLM >= 0.29; a peer on vLLM <= 0.28 with `PYTHONHASHSEED` unset has a random chain start and
cannot be matched). `blake3` is kvtool's own mode for when kvtool is the only writer: LMCache
has no such function (its `blake3` name falls back to the builtin hash), so its keys never
match a peer's; the connector folds the writer's identity digest (identity_digest.py) into its
chain start, so another checkpoint under the same model name has other keys. `sha256` reproduces CPython's pickle stream and so works only from CPython.
"""

from __future__ import annotations

import hashlib
import operator
import pickle
import re
from collections.abc import Mapping, Sequence

import blake3
import msgspec

from kvtool.engine.connectors.lmcache.chunk_hashes import (  # noqa: F401 (the key module's public names)
    _CHUNK_HASH_FNS,
    HASH_ALGOS,
    HashAlgo,
    _cbor,
    _fold,
    canonical_hash_algo,
    make_chunk_hash,
)
from kvtool.engine.connectors.lmcache.cpython_hash import _str_hash, cpython_hash  # noqa: F401
from kvtool.engine.errors import ConfigError, InputError

MAX_KEY_BYTES = 150  # the key field of an lm:// request header
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"  # vLLM >= 0.29 with PYTHONHASHSEED unset
TAG_CONFIG_PREFIX = "lmcache.tag."  # request_configs entries that become key tags


# torch dtype name (and torch's own aliases) -> LMCache dtype string (lmcache/utils.py).
_TORCH_TO_LMCACHE_DTYPE = {
    "float16": "half",
    "half": "half",
    "bfloat16": "bfloat16",
    "float32": "float",
    "float": "float",
    "float64": "double",
    "double": "double",
    "int8": "int8",
    "uint8": "uint8",
    "int16": "int16",
    "int32": "int32",
    "int64": "int64",
    "bool": "bool",
    "float8_e4m3fn": "fp8_e4m3fn",
    "float8_e4m3fnuz": "fp8_e4m3fnuz",
    "float8_e5m2": "fp8_e5m2",
    "float8_e5m2fnuz": "fp8_e5m2fnuz",
}
LMCACHE_DTYPE_STRS = frozenset(_TORCH_TO_LMCACHE_DTYPE.values())
# vLLM --kv-cache-dtype names: LMCache sees the uint8 tensor vLLM allocates for them.
_VLLM_FP8_CACHE_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla")

_DECIMAL = re.compile(r"[0-9]+")
_HEX = re.compile(r"-?[0-9a-fA-F]+")
_MASK64 = (1 << 64) - 1


def lmcache_dtype_str(dtype: object) -> str:
    """LMCache's dtype string for a torch dtype or its name (`torch.float16`, `"float16"`: `half`).

    Raises ConfigError for a dtype LMCache has no string for.
    """
    name = str(dtype).removeprefix("torch.")
    if name in _TORCH_TO_LMCACHE_DTYPE:
        return _TORCH_TO_LMCACHE_DTYPE[name]
    if name in _VLLM_FP8_CACHE_DTYPES:
        raise ConfigError(
            f"KV dtype {name!r} is a vLLM cache dtype: LMCache keys of fp8 caches say 'uint8' "
            "(use kv_dtype 'uint8')"
        )
    raise ConfigError(
        f"KV dtype {name!r} has no LMCache dtype string; use one of "
        f"{', '.join(sorted(_TORCH_TO_LMCACHE_DTYPE))}"
    )


def format_chunk_hash(chunk_hash: int) -> str:
    """LMCache's hex rule: lower case, no `0x`, no zero padding, `-` before a negative hash."""
    return format(chunk_hash, "x")


# ----------------------------------------------------------------------------- key strings


class LMCacheKey(msgspec.Struct, frozen=True, kw_only=True):
    """The fields of one LMCache key (`CacheEngineKey`, or `LayerCacheEngineKey` with a layer)."""

    model_name: str  # vLLM's --model string as given; never contains '@'
    world_size: int  # PP x TP x PCP of the writer
    worker_id: int  # the writer's global rank
    chunk_hash: int  # signed in builtin mode, else an unsigned 64-bit fold
    dtype_str: str  # LMCache's dtype string (`half`, `bfloat16`, ...)
    layer_id: int | None = None  # set only for layerwise keys
    tags: tuple[tuple[str, str], ...] = ()  # (tag, value) in the writer's order

    def to_string(self) -> str:
        """The key string, checked as `format_key` checks it."""
        return format_key(
            self.model_name,
            self.world_size,
            self.worker_id,
            self.chunk_hash,
            self.dtype_str,
            layer_id=self.layer_id,
            tags=self.tags,
        )


def _refuse_bad_key_parts(model_name: str, dtype_str: str, tags: Sequence[tuple[str, str]]) -> None:
    """Refuse the fields a peer would split wrongly, strip, or fail to parse."""
    if not model_name:
        raise ConfigError("LMCache key: model name is empty")
    if "@" in model_name:
        raise ConfigError(f"LMCache key: model name {model_name!r} contains '@'")
    # The server strips the padded key field, so edge whitespace would not survive the wire.
    if model_name != model_name.strip():
        raise ConfigError(f"LMCache key: model name {model_name!r} has edge whitespace")
    if dtype_str not in LMCACHE_DTYPE_STRS:
        raise ConfigError(
            f"LMCache key: dtype string {dtype_str!r} is not one of "
            f"{', '.join(sorted(LMCACHE_DTYPE_STRS))}"
        )
    for tag, value in tags:
        if not tag or "@" in tag or "%" in tag:
            raise ConfigError(f"LMCache key: tag name {tag!r} is empty or contains '@' or '%'")
        if "@" in value or value != value.strip():
            raise ConfigError(
                f"LMCache key: tag {tag!r} value {value!r} contains '@' or edge whitespace"
            )


def _refuse_long_key(key: str) -> None:
    num_bytes = len(key.encode("utf-8"))
    if num_bytes > MAX_KEY_BYTES:
        raise ConfigError(
            f"LMCache key is {num_bytes} bytes, over the {MAX_KEY_BYTES}-byte wire limit: "
            f"{key[:60]!r}..."
        )


def _key_head_tail(
    model_name: str,
    world_size: int,
    worker_id: int,
    dtype_str: str,
    layer_id: int | None,
    tags: Mapping[str, str] | Sequence[tuple[str, str]],
) -> tuple[str, str]:
    """The checked text before and after the hash field of a key."""
    tag_items = list(tags.items()) if isinstance(tags, Mapping) else list(tags)
    tag_items = [(str(tag), str(value)) for tag, value in tag_items]
    _refuse_bad_key_parts(model_name, dtype_str, tag_items)
    head = f"{model_name}@{world_size}@{worker_id}@"
    tail = f"@{dtype_str}" if layer_id is None else f"@{dtype_str}@{layer_id}"
    tail += "".join(f"@{tag}%{value}" for tag, value in tag_items)
    return head, tail


def format_key(
    model_name: str,
    world_size: int,
    worker_id: int,
    chunk_hash: int,
    dtype_str: str,
    *,
    layer_id: int | None = None,
    tags: Mapping[str, str] | Sequence[tuple[str, str]] = (),
) -> str:
    """One key string exactly as LMCache's `to_string()` writes it.

    `tags` are tag names without the `lmcache.tag.` prefix, in order (a mapping keeps its
    insertion order). Raises ConfigError for a model name with '@' or edge whitespace, an
    unknown dtype string, a tag the peer would misparse, or a key over 150 UTF-8 bytes.
    """
    head, tail = _key_head_tail(model_name, world_size, worker_id, dtype_str, layer_id, tags)
    key = f"{head}{format_chunk_hash(chunk_hash)}{tail}"
    _refuse_long_key(key)
    return key


def key_for_worker(key: str, worker_id: int) -> str:
    """The same chunk's key as rank `worker_id` of the writer's group writes it (only that field differs).

    A model name never holds `@` (refused when keys are made), so the third field is the worker id.
    """
    model, world_size, _, rest = key.split("@", 3)
    return f"{model}@{world_size}@{worker_id}@{rest}"


def parse_key(text: str) -> LMCacheKey:
    """Parse a key string as LMCache's `parse_cache_key` does, for inspection.

    Surrounding whitespace (the wire's space padding) is stripped. The hash may carry upper
    case or leading zeros, which the peer treats as the same key; `to_string()` of the result
    gives the canonical spelling. A sixth field of digits is a layer id; every further field is
    `tag%value`. Raises ConfigError (one line) for a key over 150 bytes, a model name with '@',
    a non-decimal world size or worker id, a bad hash, an unknown dtype string or a bad tag.
    """
    key = text.strip()
    _refuse_long_key(key)
    parts = key.split("@")
    if len(parts) < 5:
        raise ConfigError(f"LMCache key {key!r} has {len(parts)} '@' fields, at least 5 expected")
    if not _DECIMAL.fullmatch(parts[1]):
        at = _find_key_fields(parts)
        if at is not None:
            model = "@".join(parts[:at])
            raise ConfigError(f"LMCache key {key!r}: model name {model!r} contains '@'")
        raise ConfigError(f"LMCache key {key!r}: world size {parts[1]!r} is not a decimal integer")
    if not _DECIMAL.fullmatch(parts[2]):
        raise ConfigError(f"LMCache key {key!r}: worker id {parts[2]!r} is not a decimal integer")
    if not _HEX.fullmatch(parts[3]):
        raise ConfigError(f"LMCache key {key!r}: chunk hash {parts[3]!r} is not hexadecimal")
    if parts[4] not in LMCACHE_DTYPE_STRS:
        raise ConfigError(
            f"LMCache key {key!r}: dtype string {parts[4]!r} is not one of "
            f"{', '.join(sorted(LMCACHE_DTYPE_STRS))}"
        )
    rest = parts[5:]
    layer_id = None
    if rest and _DECIMAL.fullmatch(rest[0]):
        layer_id = int(rest[0])
        rest = rest[1:]
    tags = []
    for field in rest:
        tag, sep, value = field.partition("%")
        if not sep:
            raise ConfigError(
                f"LMCache key {key!r}: field {field!r} is neither a layer id nor tag%value"
            )
        tags.append((tag, value))
    return LMCacheKey(
        model_name=parts[0],
        world_size=int(parts[1]),
        worker_id=int(parts[2]),
        chunk_hash=int(parts[3], 16),
        dtype_str=parts[4],
        layer_id=layer_id,
        tags=tuple(tags),
    )


def _find_key_fields(parts: list[str]) -> int | None:
    """Index where `world@worker@hash@dtype` starts, if a model name with '@' pushed it right."""
    for at in range(2, len(parts) - 3):
        if (
            _DECIMAL.fullmatch(parts[at])
            and _DECIMAL.fullmatch(parts[at + 1])
            and _HEX.fullmatch(parts[at + 2])
            and parts[at + 3] in LMCACHE_DTYPE_STRS
        ):
            return at
    return None


def tags_from_request_configs(request_configs: Mapping[str, object] | None) -> dict[str, str]:
    """The key tags LMCache derives from a request's configs: `lmcache.tag.*` entries, in order."""
    if not request_configs:
        return {}
    return {
        k[len(TAG_CONFIG_PREFIX) :]: str(v)
        for k, v in request_configs.items()
        if k.startswith(TAG_CONFIG_PREFIX)
    }


def check_request_tags(tags: Mapping[str, str], settings: LMCacheKeySettings) -> None:
    """Refuse, as bad input, tags that LMCache's key format cannot carry.

    LMCache splits a key on '@' and each tag on its first '%' (lmcache/utils.py), and its
    server reads a 150-byte key field: a tag name must be non-empty without '@' or '%', a
    value without '@', neither with edge whitespace or control characters, and the longest key
    the settings' hash mode can produce with these tags must fit 150 UTF-8 bytes.

    Raises InputError (one line) naming the tag.
    """
    for tag, value in tags.items():
        for text in (tag, value):
            if any(ord(c) < 32 or ord(c) == 127 for c in text):
                raise InputError(f"LMCache tag {tag[:40]!r}: control characters are not allowed")
    try:
        head, tail = _key_head_tail(
            settings.model_name, settings.world_size, settings.worker_id, settings.dtype_str, None, tags
        )
        worst = f"{head}{format_chunk_hash(_worst_case_hash(canonical_hash_algo(settings.hash_algo)))}{tail}"
        num_bytes = len(worst.encode("utf-8"))
        if num_bytes > MAX_KEY_BYTES:
            room = MAX_KEY_BYTES - (num_bytes - len(tail.encode("utf-8")))
            raise InputError(
                f"LMCache tags make a {num_bytes}-byte key, the limit is {MAX_KEY_BYTES}; "
                f"tags (\"@name%value\" each) may take {max(room, 0)} bytes with this model name"
            )
    except ConfigError as e:
        raise InputError(str(e)) from None


# ----------------------------------------------------------------------------- settings


class LMCacheKeySettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a peer's keys depend on. Invalid combinations are refused at construction.

    Raises ConfigError (one line) for: an unknown hash_algo or kv_dtype; a model name a key
    cannot carry; a worst-case key over 150 bytes; worker_id outside [0, world_size);
    chunk_tokens < 1; `builtin` with a vLLM peer and no none_hash_seed (the peer's chain
    start is then random per process); a none_hash_seed Python could not have used as
    PYTHONHASHSEED in `builtin` mode; peer_has_vllm=False with a mode other than `builtin`.
    """

    model_name: str  # vLLM's --model string exactly as the peer was given it
    world_size: int = 1  # PP x TP x PCP (data parallelism excluded)
    worker_id: int = 0  # global rank; each TP rank keys its own shard
    kv_dtype: str = "bfloat16"  # torch dtype of the KV cache (fp8 caches: "uint8")
    chunk_tokens: int = 256  # LMCache's chunk_size
    hash_algo: HashAlgo = "vllm"  # kvtool mode, table in the module docstring
    none_hash_seed: str | None = None  # the peer's PYTHONHASHSEED; None = unset
    save_unfull_chunk: bool = False  # also key a trailing partial chunk
    # False: LMCache runs without vLLM, so every name hashes with builtin hash() from 0.
    peer_has_vllm: bool = True
    # blake3 mode only: the writer's make_identity_digest (identity_digest.py), folded into the
    # chain start so that another checkpoint or config under the same model name misses.
    identity_digest: str | None = None

    def __post_init__(self) -> None:
        algo = canonical_hash_algo(self.hash_algo)
        lmcache_dtype_str(self.kv_dtype)
        if self.world_size < 1:
            raise ConfigError(f"LMCache world_size must be >= 1, got {self.world_size}")
        if not 0 <= self.worker_id < self.world_size:
            raise ConfigError(
                f"LMCache worker_id must be in [0, {self.world_size}), got {self.worker_id}"
            )
        if self.chunk_tokens < 1:
            raise ConfigError(f"LMCache chunk_tokens must be >= 1, got {self.chunk_tokens}")
        if self.identity_digest is not None:
            if algo != "blake3":
                raise ConfigError(
                    f"identity_digest is for kvtool's own blake3 keys; hash_algo {self.hash_algo!r} "
                    "keys must match the peer's byte for byte"
                )
            if not self.identity_digest:
                raise ConfigError("identity_digest is empty")
        if not self.peer_has_vllm:
            if algo != "builtin":
                raise ConfigError(
                    "peer_has_vllm=False: LMCache without vLLM hashes every chunk with CPython's "
                    f"builtin hash from NONE_HASH 0, so hash_algo must be 'builtin', "
                    f"not {self.hash_algo!r}"
                )
        elif algo == "builtin":
            if self.none_hash_seed is None:
                raise ConfigError(
                    "hash_algo 'builtin' with a vLLM peer needs none_hash_seed (the peer's "
                    "PYTHONHASHSEED): unset, the peer's chain start is random per process; "
                    "fix PYTHONHASHSEED on the peer or use hash_algo 'vllm'"
                )
            _python_hash_seed(self.none_hash_seed)
        # Refuse up front a model whose keys would overflow the wire for some hashes only.
        format_key(
            self.model_name, self.world_size, self.worker_id, _worst_case_hash(algo), self.dtype_str
        )

    @property
    def dtype_str(self) -> str:
        """LMCache's dtype string for `kv_dtype`."""
        return lmcache_dtype_str(self.kv_dtype)

    @property
    def none_hash_seed_str(self) -> str:
        """The string vLLM hashes for NONE_HASH (the seed, else "vllm-none-hash")."""
        return DEFAULT_NONE_HASH_SEED if self.none_hash_seed is None else self.none_hash_seed


def _worst_case_hash(algo: str) -> int:
    """The hash with the longest hex spelling a mode can produce (builtin: `-8000000000000000`)."""
    return -(1 << 63) if algo == "builtin" else _MASK64


def _python_hash_seed(seed: str) -> int:
    """The int key PYTHONHASHSEED=seed gives str hashing; ConfigError if Python would refuse it."""
    if seed == "":
        return 0  # Python treats it as unset (random key), but hash("") is 0 under any key
    if not _DECIMAL.fullmatch(seed) or int(seed) > 0xFFFFFFFF:
        raise ConfigError(
            f"none_hash_seed {seed!r} cannot be a PYTHONHASHSEED for builtin hashing; "
            "use a decimal integer in [0, 4294967295]"
        )
    return int(seed)


def make_none_hash_int(settings: LMCacheKeySettings) -> int:
    """The chain start LMCache uses for these settings (its folded NONE_HASH)."""
    algo = canonical_hash_algo(settings.hash_algo)
    seed = settings.none_hash_seed_str
    if algo == "vllm":
        return _fold(hashlib.sha256(_cbor(seed)).digest())
    if algo == "sha256":
        return _fold(hashlib.sha256(pickle.dumps(seed, protocol=5)).digest())
    if algo == "blake3":
        if settings.identity_digest is not None:
            return _fold(blake3.blake3(_cbor((seed, settings.identity_digest))).digest())
        return _fold(blake3.blake3(_cbor(seed)).digest())
    if not settings.peer_has_vllm:
        return 0
    return _str_hash(seed, _python_hash_seed(seed))


class ChunkKey(msgspec.Struct, frozen=True):
    """One chunk of a token sequence and its LMCache key (what `process_tokens` yields)."""

    start: int  # first token of the chunk
    end: int  # one past its last token
    chunk_hash: int  # the chain value; signed in builtin mode
    key: str  # the LMCache key string


def _token_list(tokens: Sequence[int]) -> list[int]:
    """Tokens as a list of non-negative Python ints; a tensor or array is read with `tolist()`."""
    if hasattr(tokens, "tolist"):
        tokens = tokens.tolist()
    try:
        token_ids = list(map(operator.index, tokens))
    except TypeError as e:
        raise InputError(f"token ids must be integers: {e}") from None
    if token_ids and min(token_ids) < 0:
        raise InputError(f"token ids must be >= 0, found {min(token_ids)}")
    return token_ids


def make_chunk_keys(
    tokens: Sequence[int],
    settings: LMCacheKeySettings,
    *,
    tags: Mapping[str, str] | None = None,
) -> list[ChunkKey]:
    """The keys a peer with these settings gives `tokens`, from token 0, in chunk order.

    Only full chunks get keys unless `settings.save_unfull_chunk`; then a trailing partial
    chunk is hashed over its real length. `tokens` may be a list, a tuple or a 1-D tensor.
    `tags` are tag names without the `lmcache.tag.` prefix (`tags_from_request_configs`).
    Pure: no state is kept. Raises InputError for non-integer or negative token ids and
    ConfigError for tags a key cannot carry.
    """
    s = settings
    token_ids = _token_list(tokens)
    algo = canonical_hash_algo(s.hash_algo)
    chunk_hash_fn = _CHUNK_HASH_FNS[algo]
    cs = s.chunk_tokens
    n = len(token_ids)
    num_hashed = n if s.save_unfull_chunk else n - n % cs

    # The fixed parts are built once; the longest hash the mode can produce must still fit.
    fixed = (s.model_name, s.world_size, s.worker_id, s.dtype_str)
    head, tail = _key_head_tail(*fixed, None, tags or {})
    _refuse_long_key(f"{head}{format_chunk_hash(_worst_case_hash(algo))}{tail}")

    result = []
    prefix = make_none_hash_int(s)
    for start in range(0, num_hashed, cs):
        prefix = chunk_hash_fn(prefix, token_ids[start : start + cs])
        result.append(ChunkKey(start, min(start + cs, n), prefix, f"{head}{prefix:x}{tail}"))
    return result
