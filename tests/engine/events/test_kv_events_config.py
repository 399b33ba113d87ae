"""--kv-events-config: vLLM's KVEventsConfig JSON; every refusal is one clear line."""

import pytest

from kvtool.engine.errors import ConfigError
from kvtool.engine.params import parse_kv_events_config


def test_defaults_and_publisher_resolution_are_vllms():
    cfg = parse_kv_events_config('{"enable_kv_cache_events": true}')
    assert (cfg.publisher, cfg.endpoint, cfg.replay_endpoint) == ("zmq", "tcp://*:5557", None)
    assert (cfg.buffer_steps, cfg.hwm, cfg.max_queue_size, cfg.topic) == (10_000, 100_000, 100_000, "")
    assert cfg.publishes
    off = parse_kv_events_config("{}")
    assert off.publisher == "null" and not off.publishes
    null = parse_kv_events_config('{"enable_kv_cache_events": true, "publisher": "null"}')
    assert not null.publishes
    for text in (None, "", "None"):
        assert parse_kv_events_config(text) is None
    # vLLM's lax forms and its size shorthand.
    lax = parse_kv_events_config('{"enable_kv_cache_events": "yes", "hwm": 1k, "buffer_steps": "2_000"}')
    assert (lax.enable_kv_cache_events, lax.hwm, lax.buffer_steps) == (True, 1000, 2000)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ('{"enable_kv_cache_events": true, "endpoints": "tcp://*:5557"}', "unknown field `endpoints`"),
        ('{"publisher": "kafka"}', "publisher"),
        ('{"publisher": null}', "publisher"),
        ("null", "Expected `object`, got `null`"),
        ("  ", "malformed JSON"),
        ('{"buffer_steps": "many"}', "buffer_steps"),
        ('{"buffer_steps": 0}', "buffer_steps must be at least 1"),
        ('{"max_queue_size": 0}', "max_queue_size must be at least 1"),
        ('{"hwm": -1}', "hwm must be >= 0"),
        ('{"endpoint": "127.0.0.1:5557"}', "must start with tcp://, ipc:// or inproc://"),
        ('{"enable_kv_cache_events": tru', "malformed JSON"),
        ('["zmq"]', "invalid --kv-events-config"),
    ],
)
def test_refusals_are_one_line(text, needle):
    with pytest.raises(ConfigError) as info:
        parse_kv_events_config(text)
    message = str(info.value)
    assert needle in message and "\n" not in message
    assert message.startswith("invalid --kv-events-config")
