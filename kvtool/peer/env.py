"""Where the peer environment lives and how to start processes in it.

The location rule is the one `scripts/peer-env` builds to: `$KVTOOL_PEER_VENV` if set, else
`${XDG_CACHE_HOME:-$HOME/.cache}/kvtool/peer-venv`. `$KVTOOL_PEER_PYTHON` names the interpreter
directly and wins over both (for a peer installed some other way).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

STAMP_NAME = ".kvtool-peer-stamp"  # written by scripts/peer-env after a complete build

# LMCache and vLLM report usage unless told not to; the peer must never phone home.
PEER_TELEMETRY_OFF: dict[str, str] = {
    "LMCACHE_TRACK_USAGE": "false",
    "DO_NOT_TRACK": "1",
    "VLLM_NO_USAGE_STATS": "1",
}


def peer_venv() -> Path:
    """The peer virtual environment's directory (it may not exist yet)."""
    explicit = os.environ.get("KVTOOL_PEER_VENV")
    if explicit:
        return Path(explicit)
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "kvtool" / "peer-venv"


def peer_python() -> Path:
    """The peer interpreter: `$KVTOOL_PEER_PYTHON`, else `bin/python` of `peer_venv()`.

    The path is returned whether or not it exists; callers check `.exists()` and point the
    user at `scripts/peer-env` when it does not.
    """
    explicit = os.environ.get("KVTOOL_PEER_PYTHON")
    if explicit:
        return Path(explicit)
    return peer_venv() / "bin" / "python"


def is_peer_ready() -> bool:
    """Whether the peer interpreter exists and, for a built environment, its build completed.

    `scripts/peer-env` writes its stamp file last, so an interrupted build reads as not ready.
    An interpreter named by `$KVTOOL_PEER_PYTHON` only has to exist.
    """
    if os.environ.get("KVTOOL_PEER_PYTHON"):
        return peer_python().exists()
    return peer_python().exists() and (peer_venv() / STAMP_NAME).exists()


def peer_script(name: str) -> Path:
    """The path of a peer-side script shipped in this package (`lmcache_keys.py`, ...)."""
    return Path(__file__).resolve().with_name(name)


def peer_env(base: Mapping[str, str] | None = None, **extra: str) -> dict[str, str]:
    """Environment for a peer subprocess: `base` (default: this process's), telemetry off, `extra`.

    `PYTHONPATH` is dropped so that the peer cannot pick up kvtool's own packages; callers that
    fix `PYTHONHASHSEED` pass it in `extra` (or in `base`).
    """
    env = dict(os.environ if base is None else base)
    env.pop("PYTHONPATH", None)
    env.update(PEER_TELEMETRY_OFF)
    env.update(extra)
    return env
