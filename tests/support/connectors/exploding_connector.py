"""A test-only connector whose scheduler half raises for a request that asks it to (kv_transfer_params
{"explode": true}): one request's exception in the middle of a step, as a connector bug would raise it."""

from __future__ import annotations

from tests.support.connectors.dict_connector import DictScheduler, DictWorker
from kvtool.engine.connectors.base import KVConnector


class ExplodingScheduler(DictScheduler):
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        if request.kv_transfer_params.get("explode"):
            raise RuntimeError("this request's lookup blew up")
        return super().get_num_new_matched_tokens(request, num_computed_tokens)


class ExplodingConnector(KVConnector):
    scheduler_half = ExplodingScheduler
    worker_half = DictWorker
