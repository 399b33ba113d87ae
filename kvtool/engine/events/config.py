"""`--kv-events-config`: vLLM's KVEventsConfig JSON, read as vLLM 0.33 reads it (config/json_document.py).

The document is the one vLLM 0.33 takes (`vllm/config/kv_events.py`), field for field and with
vLLM's defaults. `publisher` left out means "zmq" when events are enabled, else "null".
"""

from __future__ import annotations

from typing import Literal

import msgspec

from kvtool.engine.config.json_document import convert_config, read_config_document
from kvtool.engine.errors import ConfigError

FLAG = "--kv-events-config"

_ENDPOINT_SCHEMES = ("tcp://", "ipc://", "inproc://")


class KVEventsConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The 8 fields of vLLM's KVEventsConfig; unknown keys are refused."""

    # Publish BlockStored / BlockRemoved / AllBlocksCleared for the engine's cache.
    enable_kv_cache_events: bool = False
    # None resolves to "zmq" when events are enabled, else "null" (vLLM's rule).
    publisher: Literal["null", "zmq"] | None = None
    # PUB socket: a wildcard host (`*`, `::`) or ipc:// / inproc:// binds, any other address connects.
    endpoint: str = "tcp://*:5557"
    # ROUTER socket serving missed batches from the replay buffer; None: no replay.
    replay_endpoint: str | None = None
    # How many past batches (engine steps with events) the replay buffer keeps.
    buffer_steps: int = 10_000
    # The PUB socket's send high-water mark: past it, zmq drops messages for a slow subscriber.
    hwm: int = 100_000
    # Batches queued between the engine thread and the publisher thread.
    max_queue_size: int = 100_000
    # The first frame of every published message; subscribers filter on it.
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None and not value.startswith(_ENDPOINT_SCHEMES):
                raise ConfigError(
                    f"invalid --kv-events-config: {name} {value!r} must start with tcp://, ipc:// or inproc://"
                )
        if self.buffer_steps < 1:
            raise ConfigError(f"invalid --kv-events-config: buffer_steps must be at least 1, got {self.buffer_steps}")
        if self.hwm < 0:
            raise ConfigError(f"invalid --kv-events-config: hwm must be >= 0 (0: no limit), got {self.hwm}")
        if self.max_queue_size < 1:
            raise ConfigError(
                f"invalid --kv-events-config: max_queue_size must be at least 1, got {self.max_queue_size}"
            )

    @property
    def publishes(self) -> bool:
        """Whether an engine with this config publishes anything at all."""
        return self.enable_kv_cache_events and self.publisher == "zmq"


def parse_kv_events_config(text: str | None) -> KVEventsConfig | None:
    """Parse the flag's JSON as vLLM 0.33 does (config/json_document.py): `None`, `""` and `"None"` mean
    no events; unquoted sizes such as `100k` are expanded; the int and bool fields take pydantic's
    lax forms (`"10000"`, `"true"`).

    Raises ConfigError with one line naming the problem: malformed JSON, a non-object document,
    an unknown key, a wrongly typed value, an endpoint that is not tcp/ipc/inproc.
    """
    doc = read_config_document(FLAG, text)
    if doc is None:
        return None
    if "publisher" in doc and doc["publisher"] is None:
        raise ConfigError(f"invalid {FLAG}: publisher must be 'null' or 'zmq', got None")
    return convert_config(FLAG, doc, KVEventsConfig, ints=("buffer_steps", "hwm", "max_queue_size"),
                          bools=("enable_kv_cache_events",))
