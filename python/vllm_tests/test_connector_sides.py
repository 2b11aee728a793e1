"""The connector's parts without a vLLM engine: its config, the lookup
socket, its stats, and scheduler and worker sides wired together by hand on
a real store, over vLLM's own KV cache config objects (the groups and specs
vLLM builds for a plain, a hybrid sliding-window and an MLA model), KV
tensors of the shapes vLLM registers (the hybrid groups' layers alias one
memory, as vLLM's do) and stand-ins for its scheduler output, called in
vLLM's order (lookup, allocation, step metadata, fence, loads, saves,
transfer results). Tensor parallelism runs the workers of every rank in
this process. Quick checks of what the end-to-end runs check through real
vLLM processes."""

from __future__ import annotations

import gc
import os
import time
import uuid
from dataclasses import dataclass, field
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from stored_kv import flip
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

from kvtier import Store
from kvtier.vllm import KvtierConnector, KvtierConnectorMetadata, KvtierConnectorStats, connector_namespaces
from kvtier.vllm.config import KNOWN_KEYS, ConnectorConfig
from kvtier.vllm.groups import FULL, SLIDING, KvGroup, hit_end, kv_groups, rank_heads
from kvtier.vllm.lookup import LookupClient, decode_lookup, encode_lookup, lookup_address
from kvtier.vllm.scheduler import KvtierScheduler
from kvtier.vllm.worker import KvtierWorker

HEADS, HEAD_DIM, BLOCK = 2, 64, 16
NUM_BLOCKS = 16
LATENT_DIM = 576


def _layer(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def _llama(layers: int = 2, heads: int = HEADS) -> KVCacheConfig:
    """vLLM's config of a plain model: one full-attention group."""
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=heads, head_size=HEAD_DIM, dtype=torch.float32)
    return KVCacheConfig(NUM_BLOCKS, [], [KVCacheGroupSpec([_layer(i) for i in range(layers)], spec)])


def _gemma2(heads: int = HEADS, window: int = BLOCK) -> KVCacheConfig:
    """vLLM's config of Gemma 2 under the hybrid manager: sliding-window
    layers 0 and 2, full layers 1 and 3, in two groups."""
    sw = SlidingWindowSpec(
        block_size=BLOCK, num_kv_heads=heads, head_size=HEAD_DIM, dtype=torch.float32, sliding_window=window
    )
    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=heads, head_size=HEAD_DIM, dtype=torch.float32)
    return KVCacheConfig(
        NUM_BLOCKS, [], [KVCacheGroupSpec([_layer(0), _layer(2)], sw), KVCacheGroupSpec([_layer(1), _layer(3)], full)]
    )


def _mla(layers: int = 2) -> KVCacheConfig:
    """vLLM's config of DeepSeek-V2 on the CPU: one MLA group, block 16,
    a 512 + 64 latent row per token."""
    spec = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=LATENT_DIM, dtype=torch.float32)
    return KVCacheConfig(NUM_BLOCKS, [], [KVCacheGroupSpec([_layer(i) for i in range(layers)], spec)])


def _vllm_config(cache_dir: Path, tp: int = 1, total_heads: int = HEADS, **extra: Any) -> Any:
    """What the connector reads of vLLM's config."""
    model = SimpleNamespace(
        model="stand-in-model",
        dtype=torch.float32,
        get_total_num_kv_heads=lambda: total_heads,
    )
    return SimpleNamespace(
        model_config=model,
        parallel_config=SimpleNamespace(tensor_parallel_size=tp),
        cache_config=SimpleNamespace(block_size=BLOCK, cache_dtype="auto"),
        compilation_config=SimpleNamespace(static_forward_context={}),
        kv_transfer_config=SimpleNamespace(
            engine_id=f"test-{uuid.uuid4()}",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={"cache_dir": str(cache_dir), "g2_bytes": 32 << 20, **extra},
        ),
    )


def _kv_caches(kv: KVCacheConfig, tp: int = 1, seed: int = 11) -> dict[str, torch.Tensor]:
    """Random KV tensors of the shapes vLLM registers for ``kv`` at ``tp``
    ranks; the i-th layers of the groups alias one memory, as vLLM's do."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    buffers: list[torch.Tensor] = []
    for group in kv.kv_cache_groups:
        spec = group.kv_cache_spec
        if isinstance(spec, MLAAttentionSpec):
            shape: tuple[int, ...] = (NUM_BLOCKS, 1, BLOCK, LATENT_DIM)
        else:
            shape = (NUM_BLOCKS, spec.num_kv_heads, BLOCK, 2 * HEAD_DIM)
        for i, name in enumerate(group.layer_names):
            if i == len(buffers):
                buffers.append(torch.randn(shape, generator=g))
            out[name] = buffers[i].view(shape)
    return out


@dataclass
class _Request:
    request_id: str
    prompt_token_ids: list[int]
    cache_salt: str | None = None
    lora_request: Any = None
    mm_features: Any = None
    num_computed_tokens: int = 0


@dataclass
class _Blocks:
    ids: tuple[list[int], ...]

    def get_block_ids(self) -> tuple[list[int], ...]:
        return self.ids


@dataclass
class _Engine:
    """The scheduler side and the workers (one per rank) of one engine,
    driven the way vLLM drives them."""

    kv: KVCacheConfig
    config: Any
    workers: list[KvtierWorker]
    caches: list[dict[str, torch.Tensor]]
    scheduler: KvtierScheduler
    #: The block table of each request, per group (what vLLM's KV cache
    #: manager answers).
    tables: dict[str, tuple[list[int], ...]] = field(default_factory=dict)

    @classmethod
    def start(cls, cache_dir: Path, kv: KVCacheConfig, tp: int = 1, seed: int = 11, **extra: Any) -> _Engine:
        config = _vllm_config(cache_dir, tp=tp, **extra)
        connector = ConnectorConfig.from_vllm(config)
        workers, caches = [], []
        for rank in range(tp):
            w = KvtierWorker(config, connector, kv, rank=rank)
            caches.append(_kv_caches(kv, tp, seed + rank))
            w.register_kv_caches(caches[-1])
            workers.append(w)
        scheduler = KvtierScheduler(config, connector, kv_groups(kv), lambda r: engine.tables[r])
        engine = cls(kv, config, workers, caches, scheduler)
        return engine

    def step(
        self, new: list[tuple[str, int, int]] = (), cached: list[tuple[str, int, int]] = ()
    ) -> KvtierConnectorMetadata:
        """One step: ``(request, computed, scheduled)`` of new and running
        requests; every worker runs its part (fence, loads, saves)."""
        out = SimpleNamespace(
            scheduled_new_reqs=[
                SimpleNamespace(req_id=r, block_ids=self.tables[r], num_computed_tokens=c) for r, c, _ in new
            ],
            scheduled_cached_reqs=SimpleNamespace(
                req_ids=[r for r, _, _ in cached],
                new_block_ids=[None for _ in cached],
                num_computed_tokens=[c for _, c, _ in cached],
            ),
            num_scheduled_tokens={r: n for r, _, n in [*new, *cached]},
        )
        meta = self.scheduler.build_connector_meta(out)
        for w in self.workers:
            w.handle_preemptions(meta)
            w.start_load_kv(meta)
            w.wait_for_save(KvtierConnectorMetadata(meta.loads, list(meta.saves), meta.load_async, meta.fence))
        return meta

    def finished(self, req_ids: set[str]) -> set[str]:
        """Polls the workers until each reported ``req_ids`` loaded; returns
        those a worker reported failed."""
        deadline = time.monotonic() + 60
        failed: set[str] = set()
        for w in self.workers:
            seen: set[str] = set()
            while seen != req_ids:
                recving, bad = w.get_finished()
                seen |= recving
                failed |= bad
                assert time.monotonic() < deadline, f"{req_ids - seen} never finished"
                time.sleep(0.01)
        return failed

    def drain(self) -> None:
        """Waits for every save in flight."""
        for w in self.workers:
            w.handle_preemptions(KvtierConnectorMetadata(fence=set(range(NUM_BLOCKS))))

    def save(self, req: _Request, tables: tuple[list[int], ...]) -> KvtierConnectorMetadata:
        """A request computed from scratch in one step: a miss, then its
        blocks saved."""
        assert self.scheduler.get_num_new_matched_tokens(req, 0) == (0, False)
        self.tables[req.request_id] = tables
        meta = self.step(new=[(req.request_id, 0, len(req.prompt_token_ids))])
        self.drain()
        assert self.scheduler.request_finished(req) == (False, None)
        return meta

    def load(self, req: _Request, tables: tuple[list[int], ...], hit_tokens: int, computed: int = 0) -> set[str]:
        """A request restored between steps; the requests reported failed."""
        assert self.scheduler.get_num_new_matched_tokens(req, computed) == (hit_tokens - computed, True)
        self.tables[req.request_id] = tables
        self.scheduler.update_state_after_alloc(req, _Blocks(tables), hit_tokens - computed)
        self.step()
        failed = self.finished({req.request_id})
        self.scheduler.update_connector_output(SimpleNamespace(finished_recving={req.request_id}))
        return failed

    def page(self, layer: str, block: int, rank: int = 0) -> torch.Tensor:
        return self.caches[rank][layer][block].clone()

    def shutdown(self) -> None:
        for w in self.workers:
            w.shutdown()


def test_config_reads_every_key_with_its_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    c = ConnectorConfig.from_extra({})
    assert c.cache_dir == os.path.realpath(tmp_path / "kvtier" / "vllm")
    assert (c.g2_bytes, c.g3_bytes) == (1 << 30, 8 << 30)
    assert (c.remote, c.namespace, c.fingerprint, c.kv_offload_codec) == (None, None, None, "none")
    assert (c.load_async, c.layerwise_load, c.warm_read_buffers, c.force_staging) == (True, True, True, False)
    assert not c.layerwise
    assert {
        "cache_dir",
        "g2_bytes",
        "g3_bytes",
        "remote",
        "namespace",
        "fingerprint",
        "kv_offload_codec",
        "load_async",
        "layerwise_load",
        "warm_read_buffers",
        "force_staging",
    } == KNOWN_KEYS

    c = ConnectorConfig.from_extra(
        {"g2_bytes": "4096", "fingerprint": "", "load_async": False, "namespace": "ns", "remote": "redis://x:1"}
    )
    assert c.g2_bytes == 4096
    assert c.fingerprint is None
    assert c.layerwise
    assert (c.namespace, c.remote) == ("ns", "redis://x:1")
    assert not ConnectorConfig.from_extra({"load_async": False, "layerwise_load": False}).layerwise
    assert KvtierConnector.requires_piecewise_for_cudagraph({"load_async": False})
    assert not KvtierConnector.requires_piecewise_for_cudagraph({})


def test_config_refuses_an_unknown_key(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"unknown kv_connector_extra_config keys \['g2bytes'\]"):
        ConnectorConfig.from_extra({"g2bytes": 1})
    assert ConnectorConfig.from_extra({"g2bytes": 1}, check_keys=False).g2_bytes == 1 << 30
    with pytest.raises(ValueError, match="g2bytes"):
        KvtierConnector(_vllm_config(tmp_path, g2bytes=1), KVConnectorRole.SCHEDULER, _llama())


def test_lookup_messages_round_trip() -> None:
    tokens = [0, 1, 2**32 - 1, 151_643]
    assert decode_lookup(encode_lookup(tokens, b"")) == (tokens, b"")
    assert decode_lookup(encode_lookup(tokens, b"salt\x00\xff")) == (tokens, b"salt\x00\xff")
    a, key_a = lookup_address(_vllm_config(Path("/nonexistent")))
    b, key_b = lookup_address(_vllm_config(Path("/nonexistent")))
    assert a.startswith("\0")
    assert a != b
    assert key_a != key_b
    c = _vllm_config(Path("/nonexistent"))
    assert lookup_address(c, 0) != lookup_address(c, 1)


def test_lookup_server_answers_per_group_and_outlives_a_client_with_a_wrong_key(tmp_path: Path) -> None:
    engine = _Engine.start(tmp_path, _gemma2())
    try:
        tokens = list(range(5 * BLOCK))
        engine.save(_Request("r", tokens[: 3 * BLOCK + 1], cache_salt="s"), ([1, 2, 3, 4], [5, 6, 7, 8]))
        address, key = lookup_address(engine.config)
        with pytest.raises(AuthenticationError):
            Client(address, family="AF_UNIX", authkey=b"wrong")
        client = LookupClient(address, key)
        salt = b'["s", ""]'
        assert client.lookup(tokens, salt) == b"\1\1\1\0\0" * 2
        assert client.lookup(tokens, b"other") == b"\0" * 10
    finally:
        engine.shutdown()


def test_hit_end_follows_vllm_s_rule_for_windows() -> None:
    def group(kind: str, window: int | None = None) -> KvGroup:
        return KvGroup(0, kind, ("l",), BLOCK, HEAD_DIM, 1, torch.float32, window)

    full, sw = group(FULL), group(SLIDING, 2 * BLOCK)  # the window needs 2 blocks
    assert sw.window_blocks == 2
    assert group(SLIDING, BLOCK + 1).window_blocks == 1
    # The full group stops at its first miss; the window needs its 2 blocks
    # before the end, and need not hold the blocks before them.
    assert hit_end([full, sw], [b"\1\1\1\1\0", b"\0\0\1\1\1"], 0, 5) == 4
    assert hit_end([full, sw], [b"\1\1\1\1\1", b"\1\1\0\1\1"], 0, 5) == 5
    assert hit_end([full, sw], [b"\1\1\1\1\0", b"\1\1\0\1\0"], 0, 5) == 2
    assert hit_end([full, sw], [b"\0\1", b"\1\1"], 0, 2) == 0
    # From a local hit at block 3 on: the window may reach back before it.
    assert hit_end([sw], [b"\1\0"], 3, 5) == 4
    assert hit_end([sw], [b"\0\1"], 3, 5) == 3


def test_rank_heads_split_like_vllm() -> None:
    assert [rank_heads(4, r, 2).heads for r in range(2)] == [(0, 1), (2, 3)]
    assert rank_heads(2, 0, 1).heads == (0, 1)
    assert [(h.heads, h.replica) for h in (rank_heads(2, r, 4) for r in range(4))] == [
        ((0,), 0),
        ((0,), 1),
        ((1,), 0),
        ((1,), 1),
    ]
    with pytest.raises(ValueError, match="do not split"):
        rank_heads(3, 0, 2)


def test_stats_count_and_aggregate() -> None:
    stats = KvtierConnectorStats()
    assert stats.is_empty()
    stats.loaded(3, 1, 0.5, layerwise=True)
    stats.saved(2, 0, 0.25)
    other = KvtierConnector.build_kv_connector_stats(stats.reduce())
    assert isinstance(other, KvtierConnectorStats)
    stats.aggregate(other)
    assert stats.reduce() == {
        "blocks_loaded": 6,
        "blocks_loaded_layerwise": 6,
        "blocks_load_failed": 2,
        "blocks_saved": 4,
        "blocks_save_failed": 0,
        "load_s": 1.0,
        "save_s": 0.5,
        "fresh_buffers": 0,
    }
    stats.reset()
    assert stats.is_empty()


def test_each_side_answers_only_its_own_calls(tmp_path: Path) -> None:
    config = _vllm_config(tmp_path)
    scheduler = KvtierConnector(config, KVConnectorRole.SCHEDULER, _llama())
    worker = KvtierConnector(config, KVConnectorRole.WORKER, _llama())
    # vLLM asks the scheduler for stats too.
    assert scheduler.get_kv_connector_stats() is None
    assert scheduler.get_finished({"r"}) == (None, None)
    assert scheduler.get_block_ids_with_load_errors() == set()
    with pytest.raises(RuntimeError, match="worker call on the connector's scheduler side"):
        scheduler.register_kv_caches(_kv_caches(_llama()))
    with pytest.raises(RuntimeError, match="scheduler call on the connector's worker side"):
        worker.get_num_new_matched_tokens(_Request("r", list(range(40))), 0)
    scheduler.shutdown()
    worker.shutdown()


def test_refused_at_start(tmp_path: Path) -> None:
    # Two groups take no block-level load errors: sync loads are refused.
    with pytest.raises(ValueError, match="load_async"):
        KvtierConnector(_vllm_config(tmp_path, load_async=False), KVConnectorRole.SCHEDULER, _gemma2())
    # A spec that disagrees with the model's heads.
    config = _vllm_config(tmp_path)
    w = KvtierWorker(config, ConnectorConfig.from_vllm(config), _llama(heads=1))
    with pytest.raises(ValueError, match="1 KV heads per rank; 2 heads over 1 ranks give 2"):
        w.register_kv_caches(_kv_caches(_llama(heads=1)))
    # A tensor of another shape than the group's spec.
    config = _vllm_config(tmp_path, total_heads=1)
    w = KvtierWorker(config, ConnectorConfig.from_vllm(config), _llama(heads=1))
    with pytest.raises(ValueError, match="kvtier takes"):
        w.register_kv_caches(_kv_caches(_llama()))


@pytest.mark.parametrize("staged", [False, True], ids=["in-place", "staged"])
def test_a_saved_prefix_is_restored_between_steps(tmp_path: Path, staged: bool) -> None:
    engine = _Engine.start(tmp_path, _llama(), force_staging=staged)
    try:
        tokens = list(range(100, 100 + 3 * BLOCK + 5))
        meta = engine.save(_Request("first", tokens), ([1, 2, 3, 4],))
        assert [(j.req_id, j.blocks) for j in meta.saves] == [("first", [[(0, 1), (1, 2), (2, 3)]])]
        assert meta.fence == {1, 2, 3, 4}
        saved = [engine.page(_layer(i), b) for i in range(2) for b in (1, 2, 3)]

        # The same prompt again: 3 whole blocks held, loaded between steps.
        assert engine.load(_Request("again", tokens), ([5, 6, 7, 4],), 3 * BLOCK) == set()
        assert all(w.get_block_ids_with_load_errors() == set() for w in engine.workers)
        restored = [engine.page(_layer(i), b) for i in range(2) for b in (5, 6, 7)]
        assert all(torch.equal(a, b) for a, b in zip(saved, restored, strict=True))

        # A request that ends (aborted) while its load still writes its
        # pages keeps them held.
        aborted = _Request("aborted", tokens)
        assert engine.scheduler.get_num_new_matched_tokens(aborted, 0) == (3 * BLOCK, True)
        engine.scheduler.update_state_after_alloc(aborted, _Blocks(([4, 5, 6, 7],)), 3 * BLOCK)
        assert engine.scheduler.request_finished(aborted) == (True, None)

        # Another salt shares nothing; computed tokens count as held.
        salted = _Request("salted", tokens, cache_salt="x")
        assert engine.scheduler.get_num_new_matched_tokens(salted, 0) == (0, False)
        assert engine.scheduler.get_num_new_matched_tokens(_Request("local", tokens), 2 * BLOCK) == (BLOCK, True)

        stats = engine.workers[0].get_kv_connector_stats()
        assert isinstance(stats, KvtierConnectorStats)
        assert stats.data["blocks_saved"] == 3
        assert stats.data["blocks_loaded"] == 3
        assert stats.data["blocks_loaded_layerwise"] == 0
        assert stats.data["blocks_load_failed"] == 0
        assert engine.workers[0].get_kv_connector_stats() is None
    finally:
        engine.shutdown()


def test_saves_follow_the_steps_and_the_fence_waits_for_them(tmp_path: Path) -> None:
    engine = _Engine.start(tmp_path, _llama())
    try:
        tokens = list(range(4 * BLOCK + 3))
        req = _Request("chunked", tokens)
        assert engine.scheduler.get_num_new_matched_tokens(req, 0) == (0, False)
        engine.tables["chunked"] = ([1, 2, 3, 4, 5],)
        # Chunked prefill: 2 blocks and a bit, then the rest.
        first = engine.step(new=[("chunked", 0, 2 * BLOCK + 4)])
        assert [j.blocks for j in first.saves] == [[[(0, 1), (1, 2)]]]
        second = engine.step(cached=[("chunked", 2 * BLOCK + 4, len(tokens) - 2 * BLOCK - 4)])
        assert [j.blocks for j in second.saves] == [[[(2, 3), (3, 4)]]]
        # A step that hands block 3 out again waits for its save first.
        w = engine.workers[0]
        assert w._saves
        w.handle_preemptions(KvtierConnectorMetadata(fence={3}))
        assert all(r.done() for r in w._saves if 3 in r.block_ids)
        # Decode steps save nothing more; a preempted request that computes
        # again from 0 saves its blocks again.
        assert engine.step(cached=[("chunked", len(tokens), 1)]).saves == []
        assert [j.blocks for j in engine.step(cached=[("chunked", 0, BLOCK)]).saves] == [[[(0, 1)]]]

        # Blocks vLLM's own cache holds but kvtier does not are saved too.
        local = _Request("local", list(range(5000, 5000 + 3 * BLOCK + 1)))
        assert engine.scheduler.get_num_new_matched_tokens(local, 2 * BLOCK) == (0, False)
        engine.tables["local"] = ([6, 7, 8, 9],)
        saves = engine.step(new=[("local", 2 * BLOCK, BLOCK + 1)]).saves
        assert [j.blocks for j in saves] == [[[(0, 6), (1, 7), (2, 8)]]]
    finally:
        engine.shutdown()


@pytest.mark.parametrize("staged", [False, True], ids=["in-place", "staged"])
def test_a_layerwise_restore_is_trusted_only_when_every_layer_was_waited_for(tmp_path: Path, staged: bool) -> None:
    engine = _Engine.start(tmp_path, _llama(), load_async=False, force_staging=staged)
    try:
        tokens = list(range(7, 7 + 2 * BLOCK + 1))
        engine.save(_Request("first", tokens), ([1, 2, 3],))
        saved = [engine.page(_layer(i), b) for i in range(2) for b in (1, 2)]
        w = engine.workers[0]
        for req_id, waited, expect_errors in (("all", [0, 1], set()), ("one", [0], {4, 5})):
            req = _Request(req_id, tokens)
            assert engine.scheduler.get_num_new_matched_tokens(req, 0) == (2 * BLOCK, False)
            engine.tables[req_id] = ([4, 5, 6],)
            engine.scheduler.update_state_after_alloc(req, _Blocks(([4, 5, 6],)), 2 * BLOCK)
            meta = engine.step()
            assert not meta.load_async
            for i in waited:
                w.wait_for_layer_load(_layer(i))
            assert w.get_block_ids_with_load_errors() == expect_errors, req_id
            if not expect_errors:
                restored = [engine.page(_layer(i), b) for i in range(2) for b in (4, 5)]
                assert all(torch.equal(a, b) for a, b in zip(saved, restored, strict=True))

        stats = w.get_kv_connector_stats()
        assert isinstance(stats, KvtierConnectorStats)
        assert (stats.data["blocks_loaded_layerwise"], stats.data["blocks_load_failed"]) == (2, 2)
    finally:
        engine.shutdown()


def _corrupt(ns: Any, key: bytes) -> None:
    """Flips one payload byte of ``key``'s block on disk."""
    ns.flush()
    where = ns.locate(key)
    assert where is not None
    path, offset = where
    flip(path, offset + 128 + 100)
    ns.evict_memory()


def test_hybrid_groups_keep_their_own_blocks_and_windows(tmp_path: Path) -> None:
    engine = _Engine.start(tmp_path, _gemma2())
    try:
        tokens = list(range(50, 50 + 3 * BLOCK + 5))
        # The window (one block) and the full layers: their own block ids,
        # in one memory (layer 0 and layer 1 alias).
        assert engine.caches[0][_layer(0)].data_ptr() == engine.caches[0][_layer(1)].data_ptr()
        meta = engine.save(_Request("first", tokens), ([1, 2, 3, 4], [5, 6, 7, 8]))
        assert [j.blocks for j in meta.saves] == [[[(0, 1), (1, 2), (2, 3)], [(0, 5), (1, 6), (2, 7)]]]
        sw = [engine.page(_layer(i), 3) for i in (0, 2)]
        full = [engine.page(_layer(i), b) for i in (1, 3) for b in (5, 6, 7)]

        # The restore: the sliding group gets only the block in its window
        # (vLLM hands null blocks for the others), the full group all 3.
        req = _Request("again", tokens)
        assert engine.scheduler.get_num_new_matched_tokens(req, 0) == (3 * BLOCK, True)
        tables = ([0, 0, 9, 10], [11, 12, 13, 14])
        engine.tables["again"] = tables
        engine.scheduler.update_state_after_alloc(req, _Blocks(tables), 3 * BLOCK)
        meta = engine.step()
        assert [j.blocks for j in meta.loads] == [[[(2, 9)], [(0, 11), (1, 12), (2, 13)]]]
        assert engine.finished({"again"}) == set()
        assert all(torch.equal(a, engine.page(_layer(i), 9)) for a, i in zip(sw, (0, 2), strict=True))
        got = [engine.page(_layer(i), b) for i in (1, 3) for b in (11, 12, 13)]
        assert all(torch.equal(a, b) for a, b in zip(full, got, strict=True))
        # Nothing of the null block was written or read.
        assert meta.fence == {9, 11, 12, 13}

        # Saves skip the null blocks a moving window left.
        later = _Request("later", list(range(900, 900 + 4 * BLOCK + 1)))
        assert engine.scheduler.get_num_new_matched_tokens(later, 0) == (0, False)
        engine.tables["later"] = ([0, 0, 2, 3, 4], [5, 6, 7, 8, 15])
        saves = engine.step(new=[("later", 2 * BLOCK, 2 * BLOCK)]).saves
        assert [j.blocks for j in saves] == [[[(2, 2), (3, 3)], [(0, 5), (1, 6), (2, 7), (3, 8)]]]
    finally:
        engine.shutdown()


def test_groups_of_equal_shape_never_share_a_namespace(tmp_path: Path) -> None:
    # Gemma 3 under the hybrid manager: a group per layer, three of them
    # sliding windows of one shape, all four tensors at one address.
    sw = SlidingWindowSpec(
        block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=torch.float32, sliding_window=BLOCK
    )
    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=torch.float32)
    kv = KVCacheConfig(
        NUM_BLOCKS, [], [KVCacheGroupSpec([_layer(i)], sw) for i in range(3)] + [KVCacheGroupSpec([_layer(3)], full)]
    )
    spaces = connector_namespaces(_vllm_config(tmp_path), kv, store=Store(str(tmp_path)))
    names = [ns.name for group in spaces.values() for ns in group]
    assert len(names) == 4 * HEADS
    assert len(set(names)) == len(names)
    tokens = list(range(2 * BLOCK))
    keys = {k for group in spaces.values() for ns in group for k in ns.token_keys(tokens)}
    assert len(keys) == 2 * 4 * HEADS


def test_a_corrupt_hybrid_block_fails_the_request_s_restore_not_a_block(tmp_path: Path) -> None:
    engine = _Engine.start(tmp_path, _gemma2(), g3_bytes=64 << 20)
    try:
        tokens = list(range(3 * BLOCK + 5))
        engine.save(_Request("first", tokens), ([1, 2, 3, 4], [5, 6, 7, 8]))
        spaces = connector_namespaces(engine.config, engine.kv)
        ns = spaces[1][1]  # the full group, KV head 1
        _corrupt(ns, ns.token_keys(tokens)[1])
        for g in spaces.values():
            for n in g:
                n.evict_memory()
        failed = engine.load(_Request("again", tokens), ([0, 0, 9, 10], [11, 12, 13, 14]), 3 * BLOCK)
        # vLLM takes no block-level errors with two groups: the request's
        # restore fails whole, and vLLM recomputes it.
        assert failed == {"again"}
        assert engine.workers[0].get_block_ids_with_load_errors() == set()
    finally:
        engine.shutdown()


@pytest.mark.parametrize("kind", ["gemma2", "llama"])
def test_kv_saved_at_one_tp_degree_restores_at_another(tmp_path: Path, kind: str) -> None:
    kv = {"gemma2": _gemma2, "llama": _llama}[kind]
    tokens = list(range(300, 300 + 2 * BLOCK + 3))
    tables = ([1, 2, 3], [4, 5, 6]) if kind == "gemma2" else ([1, 2, 3],)
    into = ([0, 7, 8], [9, 10, 11]) if kind == "gemma2" else ([7, 8, 9],)
    for save_tp, load_tp in ((2, 1), (1, 2)):
        root = tmp_path / f"{save_tp}to{load_tp}"
        saver = _Engine.start(root, kv(heads=HEADS // save_tp), tp=save_tp, seed=5)
        try:
            saver.save(_Request("s", tokens), tables)
            # Each head's pages: rank r of T holds heads [r*H/T, (r+1)*H/T).
            want = {
                (name, b): torch.cat([c[name][b] for c in saver.caches], dim=0)
                for name in saver.caches[0]
                for b in range(NUM_BLOCKS)
            }
        finally:
            saver.shutdown()
        del saver
        gc.collect()
        loader = _Engine.start(root, kv(heads=HEADS // load_tp), tp=load_tp, seed=9)
        try:
            assert loader.load(_Request("l", tokens), into, 2 * BLOCK) == set()
            for gi, group in enumerate(loader.kv.kv_cache_groups):
                for (i, src), dst in zip(enumerate(tables[gi][:2]), into[gi][:2], strict=True):
                    if dst == 0:
                        continue
                    for name in group.layer_names:
                        got = torch.cat([c[name][dst] for c in loader.caches], dim=0)
                        assert torch.equal(got, want[(name, src)]), (save_tp, load_tp, name, i)
        finally:
            loader.shutdown()


def test_mla_latent_pages_are_saved_and_restored_at_any_tp(tmp_path: Path) -> None:
    tokens = list(range(2 * BLOCK + 1))
    engine = _Engine.start(tmp_path, _mla(), tp=2, total_heads=1, kv_offload_codec="none")
    try:
        names = [ns.name for w in engine.workers for ns in w.namespaces]
        assert len(set(names)) == 2  # each rank's copy of the latent has its own directory
        engine.save(_Request("s", tokens), ([1, 2, 3],))
        want = [engine.page(_layer(i), b, rank=r) for r in (0, 1) for i in (0, 1) for b in (1, 2)]
        assert engine.load(_Request("l", tokens), ([4, 5, 6],), 2 * BLOCK) == set()
        got = [engine.page(_layer(i), b, rank=r) for r in (0, 1) for i in (0, 1) for b in (4, 5)]
        assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    finally:
        engine.shutdown()
    config = _vllm_config(tmp_path, total_heads=1)
    with pytest.raises(ValueError, match="kvtier takes"):
        KvtierWorker(config, ConnectorConfig.from_vllm(config), _mla()).register_kv_caches(_kv_caches(_llama()))


@pytest.mark.parametrize("codec", ["int8", "bf16"])
def test_mla_pages_take_a_codec(tmp_path: Path, codec: str) -> None:
    engine = _Engine.start(tmp_path, _mla(), total_heads=1, kv_offload_codec=codec)
    try:
        tokens = list(range(BLOCK + 1))
        engine.save(_Request("s", tokens), ([1, 2],))
        want = engine.page(_layer(0), 1)
        assert engine.load(_Request("l", tokens), ([3, 4],), BLOCK) == set()
        got = engine.page(_layer(0), 3)
        assert not torch.equal(got, want)  # coded, so not bit-exact
        assert torch.allclose(got, want, atol=float(want.abs().max()) / 100)
    finally:
        engine.shutdown()
