"""Typed errors raised by the engine. The CLI maps each to one line and an exit code."""


class KVToolError(Exception):
    """Base of every error the engine raises on purpose."""

    exit_code = 2


class ConfigError(KVToolError):
    """A flag, config document or engine parameter is invalid."""


class ModelError(KVToolError):
    """A model directory cannot be used (missing, unsupported, corrupt, mismatched)."""


class InputError(KVToolError):
    """A request is invalid (empty prompt, too long, bad sampling values)."""


class KVRefused(KVToolError):
    """External KV bytes failed an identity, geometry or checksum check."""

    exit_code = 1


class PeerError(KVToolError):
    """A remote peer (LMCache server) misbehaved or could not be reached."""

    exit_code = 1


class KVLoadError(KVToolError):
    """A request ended because its external KV failed to load under the `fail` policy."""

    exit_code = 1


class WorkerError(KVToolError):
    """A tensor-parallel worker process died or failed; the engine cannot go on."""

    exit_code = 1
