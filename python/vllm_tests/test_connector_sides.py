"""The connector's parts without a vLLM engine: its config, the lookup
socket, its stats, and a scheduler side and a worker side wired together by
hand over stand-ins for vLLM's config and requests, on a real store (the
calls vLLM makes, in its order: lookup, allocation, step metadata, loads,
saves, finished requests). Quick checks of what the end-to-end run checks
through real vLLM processes."""

from __future__ import annotations

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
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from kvtier import Layout, Store
from kvtier.vllm import KvtierConnector, KvtierConnectorMetadata, KvtierConnectorStats
from kvtier.vllm.config import KNOWN_KEYS, ConnectorConfig
from kvtier.vllm.lookup import LookupClient, LookupServer, decode_lookup, encode_lookup, lookup_address

LAYERS, HEADS, HEAD_DIM, BLOCK = 2, 2, 64, 16
NUM_BLOCKS = 8


def _vllm_config(cache_dir: Path, **extra: Any) -> Any:
    """What the connector reads of vLLM's config, for a 2-layer model."""
    model = SimpleNamespace(
        model="stand-in-model",
        dtype=torch.float32,
        get_num_layers=lambda pc: LAYERS,
        get_num_kv_heads=lambda pc: HEADS,
        get_head_size=lambda: HEAD_DIM,
    )
    return SimpleNamespace(
        model_config=model,
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
        cache_config=SimpleNamespace(block_size=BLOCK, cache_dtype="auto"),
        compilation_config=SimpleNamespace(static_forward_context={}),
        kv_transfer_config=SimpleNamespace(
            engine_id=f"test-{uuid.uuid4()}",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={"cache_dir": str(cache_dir), "g2_bytes": 8 << 20, **extra},
        ),
    )


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
    ids: list[int] = field(default_factory=list)

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (self.ids,)


def _kv_caches() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    shape = (NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD_DIM)
    return {f"model.layers.{i}.self_attn.attn": torch.randn(shape, generator=g) for i in range(LAYERS)}


class _Engine:
    """A scheduler-side and a worker-side connector of one engine, driven
    the way vLLM drives them."""

    def __init__(self, cache_dir: Path, **extra: Any) -> None:
        config = _vllm_config(cache_dir, **extra)
        self.worker = KvtierConnector(config, KVConnectorRole.WORKER)
        self.kv = _kv_caches()
        self.worker.register_kv_caches(self.kv)
        self.scheduler = KvtierConnector(config, KVConnectorRole.SCHEDULER)

    def step(self) -> KvtierConnectorMetadata:
        """One step's metadata, bound to the worker as vLLM binds it."""
        meta = self.scheduler.build_connector_meta(SimpleNamespace())
        assert isinstance(meta, KvtierConnectorMetadata)
        self.worker.bind_connector_metadata(meta)
        return meta

    def finished(self, req_ids: set[str], sending: bool) -> None:
        """Polls the worker until it reports ``req_ids`` done."""
        deadline = time.monotonic() + 60
        seen: set[str] = set()
        while seen != req_ids:
            done_sending, done_recving = self.worker.get_finished(req_ids if sending else set())
            seen |= (done_sending if sending else done_recving) or set()
            assert time.monotonic() < deadline, f"{req_ids - seen} never finished"
            time.sleep(0.01)

    def pages(self, blocks: list[int]) -> list[torch.Tensor]:
        return [t[blocks].clone() for t in self.kv.values()]

    def shutdown(self) -> None:
        self.worker.shutdown()
        self.scheduler.shutdown()


def _save(engine: _Engine, req: _Request, block_ids: list[int]) -> None:
    """A request computed from scratch: a miss, then its save."""
    assert engine.scheduler.get_num_new_matched_tokens(req, 0) == (0, False)
    req.num_computed_tokens = len(req.prompt_token_ids)
    assert engine.scheduler.request_finished(req, block_ids) == (True, None)
    meta = engine.step()
    assert [(j.req_id, j.first, j.block_ids) for j in meta.saves] == [
        (req.request_id, 0, block_ids[: len(req.prompt_token_ids) // BLOCK])
    ]
    engine.worker.start_load_kv(SimpleNamespace())
    engine.worker.wait_for_save()
    engine.worker.clear_connector_metadata()
    engine.finished({req.request_id}, sending=True)


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
        KvtierConnector(_vllm_config(tmp_path, g2bytes=1), KVConnectorRole.SCHEDULER)


def test_lookup_messages_round_trip() -> None:
    tokens = [0, 1, 2**32 - 1, 151_643]
    assert decode_lookup(encode_lookup(tokens, b"")) == (tokens, b"")
    assert decode_lookup(encode_lookup(tokens, b"salt\x00\xff")) == (tokens, b"salt\x00\xff")
    a, key_a = lookup_address(_vllm_config(Path("/nonexistent")))
    b, key_b = lookup_address(_vllm_config(Path("/nonexistent")))
    assert a.startswith("\0")
    assert a != b
    assert key_a != key_b


def test_lookup_server_answers_and_outlives_a_client_with_a_wrong_key(tmp_path: Path) -> None:
    layout = Layout.vllm_cpu(LAYERS, HEADS, HEAD_DIM, block_tokens=BLOCK)
    ns = Store(str(tmp_path), g2_bytes=8 << 20, g3_bytes=8 << 20).namespace(layout, fingerprint="lookup")
    tokens = list(range(5 * BLOCK))
    layers = list(_kv_caches().values())
    got = ns.save_pages(ns.token_keys(tokens[: 3 * BLOCK], salt=b"s"), layers, [0, 1, 2]).wait()
    assert [r.status for r in got or []] == ["stored"] * 3

    address, key = lookup_address(_vllm_config(tmp_path))
    server = LookupServer(address, key, ns)
    try:
        with pytest.raises(AuthenticationError):
            Client(address, family="AF_UNIX", authkey=b"wrong")
        client = LookupClient(address, key)
        assert client.lookup(tokens, b"s") == 3
        assert client.lookup(tokens, b"other") == 0
        assert client.lookup(tokens[:BLOCK], b"s") == 1
    finally:
        server.close()


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
    scheduler = KvtierConnector(config, KVConnectorRole.SCHEDULER)
    worker = KvtierConnector(config, KVConnectorRole.WORKER)
    # vLLM asks the scheduler for stats too.
    assert scheduler.get_kv_connector_stats() is None
    assert scheduler.get_finished({"r"}) == (None, None)
    assert scheduler.get_block_ids_with_load_errors() == set()
    with pytest.raises(RuntimeError, match="worker call on the connector's scheduler side"):
        scheduler.register_kv_caches(_kv_caches())
    with pytest.raises(RuntimeError, match="scheduler call on the connector's worker side"):
        worker.get_num_new_matched_tokens(_Request("r", list(range(40))), 0)
    scheduler.shutdown()
    worker.shutdown()


@pytest.mark.parametrize("staged", [False, True], ids=["in-place", "staged"])
def test_a_saved_prefix_is_restored_between_steps(tmp_path: Path, staged: bool) -> None:
    engine = _Engine(tmp_path, force_staging=staged)
    try:
        tokens = list(range(100, 100 + 3 * BLOCK + 5))
        _save(engine, _Request("first", tokens), [0, 1, 2, 3])
        assert engine.worker.get_block_ids_with_load_errors() == set()

        # The same prompt again: 3 whole blocks held, loaded between steps.
        again = _Request("again", tokens)
        assert engine.scheduler.get_num_new_matched_tokens(again, 0) == (3 * BLOCK, True)
        engine.scheduler.update_state_after_alloc(again, _Blocks([5, 6, 7, 4]), 3 * BLOCK)
        meta = engine.step()
        assert [(j.first, j.block_ids) for j in meta.loads] == [(0, [5, 6, 7])]
        assert meta.load_async
        engine.worker.start_load_kv(SimpleNamespace())
        engine.worker.clear_connector_metadata()
        engine.finished({"again"}, sending=False)
        assert engine.worker.get_block_ids_with_load_errors() == set()
        for saved, restored in zip(engine.pages([0, 1, 2]), engine.pages([5, 6, 7]), strict=True):
            assert torch.equal(saved, restored)

        # Restored whole: nothing more to save once the load is reported.
        engine.scheduler.update_connector_output(SimpleNamespace(finished_recving={"again"}))
        again.num_computed_tokens = len(tokens)
        assert engine.scheduler.request_finished(again, [5, 6, 7, 4]) == (False, None)

        # A request that ends (aborted) while its load still writes its
        # pages keeps them held.
        aborted = _Request("aborted", tokens)
        assert engine.scheduler.get_num_new_matched_tokens(aborted, 0) == (3 * BLOCK, True)
        engine.scheduler.update_state_after_alloc(aborted, _Blocks([4, 5, 6, 7]), 3 * BLOCK)
        assert engine.scheduler.request_finished(aborted, [4, 5, 6, 7]) == (True, None)

        # Another salt shares nothing; computed tokens count as held.
        assert engine.scheduler.get_num_new_matched_tokens(_Request("salted", tokens, cache_salt="x"), 0) == (
            0,
            False,
        )
        assert engine.scheduler.get_num_new_matched_tokens(_Request("local", tokens), 2 * BLOCK) == (BLOCK, True)

        stats = engine.worker.get_kv_connector_stats()
        assert isinstance(stats, KvtierConnectorStats)
        assert stats.data["blocks_saved"] == 3
        assert stats.data["blocks_loaded"] == 3
        assert stats.data["blocks_loaded_layerwise"] == 0
        assert stats.data["blocks_load_failed"] == 0
        assert engine.worker.get_kv_connector_stats() is None
    finally:
        engine.shutdown()


@pytest.mark.parametrize("staged", [False, True], ids=["in-place", "staged"])
def test_a_layerwise_restore_is_trusted_only_when_every_layer_was_waited_for(tmp_path: Path, staged: bool) -> None:
    engine = _Engine(tmp_path, load_async=False, force_staging=staged)
    try:
        tokens = list(range(7, 7 + 2 * BLOCK + 1))
        _save(engine, _Request("first", tokens), [0, 1, 2])
        names = list(engine.kv)

        for req_id, waited, expect_errors in (("all", names, set()), ("one", names[:1], {4, 5})):
            req = _Request(req_id, tokens)
            assert engine.scheduler.get_num_new_matched_tokens(req, 0) == (2 * BLOCK, False)
            engine.scheduler.update_state_after_alloc(req, _Blocks([4, 5, 6]), 2 * BLOCK)
            meta = engine.step()
            assert not meta.load_async
            engine.worker.start_load_kv(SimpleNamespace())
            for name in waited:
                engine.worker.wait_for_layer_load(name)
            engine.worker.clear_connector_metadata()
            assert engine.worker.get_block_ids_with_load_errors() == expect_errors, req_id
            if not expect_errors:
                for saved, restored in zip(engine.pages([0, 1]), engine.pages([4, 5]), strict=True):
                    assert torch.equal(saved, restored)

        stats = engine.worker.get_kv_connector_stats()
        assert isinstance(stats, KvtierConnectorStats)
        assert (stats.data["blocks_loaded_layerwise"], stats.data["blocks_load_failed"]) == (2, 2)
    finally:
        engine.shutdown()
