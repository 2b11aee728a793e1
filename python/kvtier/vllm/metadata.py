"""What the scheduler side hands the workers each step: the loads and
saves to run, as :class:`Job`\\ s of whole blocks per KV cache group, and
the blocks vLLM hands out anew this step (the save fence)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass
class Job:
    """One request's blocks to load or save: per KV cache group (by index),
    ``(block index, vLLM block id)`` pairs, the index counting whole blocks
    of ``tokens`` (keyed with ``salt``). A group's pairs leave out the
    blocks it does not need (outside a sliding window). Keys are computed by
    the worker, which holds the namespaces."""

    req_id: str
    tokens: list[int]
    salt: bytes
    blocks: list[list[tuple[int, int]]]

    def block_ids(self) -> set[int]:
        """Every vLLM block id the job reads or writes."""
        return {b for group in self.blocks for _, b in group}


@dataclass
class KvtierConnectorMetadata(KVConnectorMetadata):
    """What the scheduler side asks of the workers in one step."""

    loads: list[Job] = field(default_factory=list)
    saves: list[Job] = field(default_factory=list)
    #: Whether ``loads`` are asynchronous (finished between steps).
    load_async: bool = True
    #: Block ids vLLM hands out this step (to scheduled requests and to
    #: loads): a save still copying from one must end before the step's
    #: forward pass or load writes into it.
    fence: set[int] = field(default_factory=set)
