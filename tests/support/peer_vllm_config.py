"""Runs in the peer environment: vLLM 0.33's own parsing of `--kv-transfer-config` and
`--kv-events-config`, for tests/engine/connectors/test_vllm_config_parsing.py to compare with kvtool's.

Reads one JSON object on stdin: {"expand": [text], "transfer": [text], "events": [text],
"argvs": [[arg]]}, and prints one JSON object with a result per input, in order:
  expand    vLLM's _expand_json_human_readable_numbers(text), or {"error": message}
  transfer  the KVTransferConfig vLLM's argparse type makes of the flag's value, or {"error": ...}
  events    the same for KVEventsConfig
  argvs     {"kv_transfer_config": ..., "kv_events_config": ...} from vLLM's FlexibleArgumentParser
"""

import argparse
import json
import sys
from dataclasses import dataclass

from vllm.config.kv_events import KVEventsConfig
from vllm.config.kv_transfer import KVTransferConfig
from vllm.engine.arg_utils import _compute_kwargs, _expand_json_human_readable_numbers
from vllm.utils.argparse_utils import FlexibleArgumentParser

TRANSFER_FIELDS = ("kv_connector", "kv_role", "kv_connector_extra_config", "kv_port", "enable_permute_local_kv",
                   "kv_load_failure_policy", "kv_connector_module_path")
EVENTS_FIELDS = ("enable_kv_cache_events", "publisher", "endpoint", "replay_endpoint", "buffer_steps", "hwm",
                 "max_queue_size", "topic")


@dataclass
class Flags:
    kv_transfer_config: KVTransferConfig | None = None
    kv_events_config: KVEventsConfig | None = None


KWARGS = _compute_kwargs(Flags)


def fields(config, names):
    return None if config is None else {n: getattr(config, n) for n in names}


def attempt(fn):
    try:
        return fn()
    except (argparse.ArgumentError, argparse.ArgumentTypeError, ValueError, TypeError, OverflowError, IndexError) as e:
        return {"error": str(e).splitlines()[0] if str(e) else type(e).__name__}


def parse_argv(argv):
    parser = FlexibleArgumentParser(exit_on_error=False)
    parser.add_argument("--kv-transfer-config", **KWARGS["kv_transfer_config"])
    parser.add_argument("--kv-events-config", **KWARGS["kv_events_config"])
    # argparse reports a bad value by exiting: make that an exception.
    parser.error = lambda message: (_ for _ in ()).throw(ValueError(message))
    ns = parser.parse_args(argv)
    return {"kv_transfer_config": fields(ns.kv_transfer_config, TRANSFER_FIELDS),
            "kv_events_config": fields(ns.kv_events_config, EVENTS_FIELDS)}


def main() -> None:
    cases = json.load(sys.stdin)
    transfer_type = KWARGS["kv_transfer_config"]["type"]
    events_type = KWARGS["kv_events_config"]["type"]
    out = {
        "expand": [attempt(lambda t=t: _expand_json_human_readable_numbers(t)) for t in cases["expand"]],
        "transfer": [attempt(lambda t=t: {"config": fields(transfer_type(t), TRANSFER_FIELDS)})
                     for t in cases["transfer"]],
        "events": [attempt(lambda t=t: {"config": fields(events_type(t), EVENTS_FIELDS)}) for t in cases["events"]],
        "argvs": [attempt(lambda a=a: {"parsed": parse_argv(a)}) for a in cases["argvs"]],
    }
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
