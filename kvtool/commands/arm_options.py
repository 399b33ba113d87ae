"""Engine flags for commands whose connectors come from arms (`replay`, `bench`).

The same flags as `with_engine_options`, taken from its signature, less `--kv-transfer-config`
and vLLM's `--kv-offloading-*` shortcuts: each arm brings its own KV transfer config.
"""

import functools
import inspect

from kvtool.commands.options import ENGINE_OPTION_NAMES, build_engine_params, with_engine_options

# The connector flags: an arm's own config takes their place.
_CONNECTOR_OPTIONS = {"kv_transfer_config": None, "kv_offloading_size": None, "kv_offloading_backend": "native"}
_ARM_ENGINE_OPTION_NAMES = [name for name in ENGINE_OPTION_NAMES if name not in _CONNECTOR_OPTIONS]


def _template(*, engine) -> None:
    """Only its signature is used: with_engine_options adds every engine flag to it."""


def with_arm_engine_options(fn):
    """Give a command every engine flag but the connector flags, as one `engine: EngineParams`
    argument (with no connector)."""
    template = inspect.signature(with_engine_options(_template))
    added = [p for p in template.parameters.values() if p.name in _ARM_ENGINE_OPTION_NAMES]
    sig = inspect.signature(fn, eval_str=True)
    own = [p for p in sig.parameters.values() if p.name != "engine"]

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        opts = {name: kwargs.pop(name) for name in _ARM_ENGINE_OPTION_NAMES}
        kwargs["engine"] = build_engine_params(**_CONNECTOR_OPTIONS, **opts)
        return fn(*args, **kwargs)

    wrapper.__signature__ = sig.replace(parameters=own + added)
    del wrapper.__wrapped__  # typer must read the new signature, not the wrapped one
    return wrapper
