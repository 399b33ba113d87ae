"""The OffloadingConnector's messages: load and store jobs (scheduler -> worker) and completions (worker -> scheduler).

Jobs carry ids; the worker half reports a job's id once it no longer uses the job's CPU slot
(its copies are done and its disk write, if any, has ended), and the scheduler half then
releases the slot's pin. Slots are numbers into a pool both halves size identically.
"""

from __future__ import annotations

import msgspec

from kvtool.engine.core.messages import KVConnectorCompletions, KVConnectorMetadata


class LoadJob(msgspec.Struct, kw_only=True):
    job_id: int
    request_id: str
    key: bytes
    index: int  # offload block index within the request
    block_ids: list[int]  # engine blocks to fill
    first: int  # index, inside the offload block, of block_ids[0]
    slot: int | None  # CPU slot; None: read from disk through a staging buffer
    from_disk: bool  # promote from disk into the slot first
    tokens: int = 0  # tokens the job counts as loaded (each chunk's once, over its groups' jobs)


class StoreJob(msgspec.Struct, kw_only=True):
    job_id: int
    request_id: str
    key: bytes
    block_ids: list[int]  # the offload block's engine blocks
    slot: int  # CPU slot
    copy_from_pages: bool  # False: the slot already holds the bytes (disk write only)
    write_to_disk: bool
    tokens: int = 0  # tokens the job counts as stored (each chunk's once, over its groups' copies)


class OffloadingMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = []
    stores: list[StoreJob] = []


class OffloadingCompletions(KVConnectorCompletions):
    # Jobs whose slot the worker no longer uses (loads done, stores copied and written).
    finished_job_ids: list[int] = []
    # Keys the worker wrote to the disk tier, and those the tier evicted for room.
    written: list[bytes] = []
    evicted: list[bytes] = []
