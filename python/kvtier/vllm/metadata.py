"""What the scheduler side hands the workers each step: the loads and
saves to run, as :class:`Job`\\ s of whole blocks."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass
class Job:
    """One request's blocks to load or save: blocks ``first ..
    first + len(block_ids)`` of ``tokens`` (whole blocks, keyed with
    ``salt``), to or from the vLLM blocks ``block_ids`` in order. Keys are
    computed by the worker, which holds the namespace."""

    req_id: str
    tokens: list[int]
    salt: bytes
    first: int
    block_ids: list[int]


@dataclass
class KvtierConnectorMetadata(KVConnectorMetadata):
    """What the scheduler side asks of the workers in one step."""

    loads: list[Job] = field(default_factory=list)
    saves: list[Job] = field(default_factory=list)
    #: Whether ``loads`` are asynchronous (finished between steps).
    load_async: bool = True
