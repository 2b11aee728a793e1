"""The connector's settings: the keys of vLLM's ``kv_connector_extra_config``
that :class:`~kvtier.vllm.KvtierConnector` reads, their defaults and how a
value is read. Every key is optional; a key kvtier does not know is refused
at start, because a misspelt key would otherwise be ignored without a word.
docs/guides/vllm.md describes each key for users.

This module needs no vLLM: it reads the config it is given by attribute."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.config import VllmConfig


def default_cache_dir() -> str:
    """``$XDG_CACHE_HOME/kvtier/vllm`` (``~/.cache`` without it)."""
    return str(Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvtier" / "vllm")


@dataclass(frozen=True)
class ConnectorConfig:
    """The connector's settings, one field per ``kv_connector_extra_config``
    key of the same name."""

    #: The store's directory (resolved to a real path): G3 lives under it,
    #: and one process opens one store per directory.
    cache_dir: str
    #: G2 (host memory) budget in bytes.
    g2_bytes: int = 1 << 30
    #: G3 (the directory) budget in bytes.
    g3_bytes: int = 8 << 30
    #: A G4 pool URL (``redis://``, ``rediss://``, ``redis+cluster://``,
    #: ``s3://``), shared by every node that names it.
    remote: str | None = None
    #: The G3 directory's name under ``cache_dir``; ``None``: derived from
    #: the model and layout.
    namespace: str | None = None
    #: Names the weights; ``None``: :func:`kvtier.vllm.model_fingerprint` of
    #: the served model. KV of another fingerprint is never served.
    fingerprint: str | None = None
    #: How the store keeps the KV: ``none``, ``bf16`` (from f32),
    #: ``fp8-e4m3`` or ``int8`` (a scale per token and head). Part of the
    #: keys, so coded and uncoded KV never mix.
    kv_offload_codec: str = "none"
    #: Restores run between scheduler steps while other requests keep
    #: decoding; false restores inside the step that needs them.
    load_async: bool = True
    #: With ``load_async`` false: each layer's attention waits only for its
    #: own layer; false waits for the whole restore before the step.
    layerwise_load: bool = True
    #: At start, fault in the buffers restores read into (as many blocks as
    #: ``g2_bytes`` holds) before vLLM takes requests.
    warm_read_buffers: bool = True
    #: Copy pages through host buffers even where the KV cache could be
    #: read and written in place (the accelerator's path, run on a CPU).
    force_staging: bool = False

    @property
    def layerwise(self) -> bool:
        """Whether restores are handed to vLLM layer by layer inside the
        step (sync loads with ``layerwise_load``)."""
        return not self.load_async and self.layerwise_load

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any], check_keys: bool = True) -> ConnectorConfig:
        """Reads ``kv_connector_extra_config`` (JSON from vLLM's command
        line, so its values are of any type until read here); with
        ``check_keys``, a key that is not a field is a ``ValueError`` naming
        the known ones."""
        if check_keys:
            unknown = set(extra) - KNOWN_KEYS
            if unknown:
                raise ValueError(
                    f"kvtier: unknown kv_connector_extra_config keys {sorted(unknown)}; known: {sorted(KNOWN_KEYS)}"
                )
        remote = extra.get("remote")
        namespace = extra.get("namespace")
        fingerprint = extra.get("fingerprint")
        return cls(
            cache_dir=os.path.realpath(str(extra.get("cache_dir", default_cache_dir()))),
            g2_bytes=int(extra.get("g2_bytes", cls.g2_bytes)),
            g3_bytes=int(extra.get("g3_bytes", cls.g3_bytes)),
            remote=None if remote is None else str(remote),
            namespace=None if namespace is None else str(namespace),
            # An empty fingerprint is no fingerprint: the default is used.
            fingerprint=str(fingerprint) if fingerprint else None,
            kv_offload_codec=str(extra.get("kv_offload_codec", cls.kv_offload_codec)),
            load_async=bool(extra.get("load_async", cls.load_async)),
            layerwise_load=bool(extra.get("layerwise_load", cls.layerwise_load)),
            warm_read_buffers=bool(extra.get("warm_read_buffers", cls.warm_read_buffers)),
            force_staging=bool(extra.get("force_staging", cls.force_staging)),
        )

    @classmethod
    def from_vllm(cls, vllm_config: VllmConfig) -> ConnectorConfig:
        """The settings in ``vllm_config.kv_transfer_config`` (all defaults
        without one)."""
        ktc = vllm_config.kv_transfer_config
        extra = dict(ktc.kv_connector_extra_config or {}) if ktc is not None else {}
        return cls.from_extra(extra)


#: The keys ``kv_connector_extra_config`` may hold.
KNOWN_KEYS = frozenset(f.name for f in fields(ConnectorConfig))
