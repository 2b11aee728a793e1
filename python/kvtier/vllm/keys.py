"""What a block's key is made of under vLLM, besides its tokens.

Blocks are named by kvtier's chained token keys (docs/keys.md): one vLLM
block (128 tokens on the CPU backend) is one kvtier block, its key names the
whole prefix up to it, salted by the request's ``cache_salt`` and LoRA
adapter (:func:`request_salt`) and scoped by the model fingerprint
(:func:`model_fingerprint`) and the layout (the namespace). vLLM's own
``request.block_hashes`` are not used: unless ``PYTHONHASHSEED`` is set,
vLLM seeds them at random in every process, so they would never match after
a restart or on another node. Requests with multi-modal inputs are neither
restored nor saved: their KV depends on more than their tokens.

This module needs no vLLM: it reads the objects it is given by attribute."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.request import Request


def model_fingerprint(model: str, revision: str | None = None, quantization: str | None = None) -> str:
    """The fingerprint :class:`~kvtier.vllm.KvtierConnector` gives a model
    by default: its name, revision and quantization and, for a local
    directory, a hash of its config.json and the names and sizes of its
    weight files."""
    parts: dict[str, object] = {"model": str(model), "revision": str(revision), "quantization": str(quantization)}
    root = Path(str(model))
    if root.is_dir():
        config = root / "config.json"
        if config.is_file():
            parts["config"] = hashlib.sha256(config.read_bytes()).hexdigest()
        parts["weights"] = sorted(
            (p.name, p.stat().st_size)
            for p in root.iterdir()
            if p.suffix in (".safetensors", ".bin", ".pt") and p.is_file()
        )
    return "vllm:" + json.dumps(parts, sort_keys=True)


def served_model_fingerprint(vllm_config: VllmConfig) -> str:
    """:func:`model_fingerprint` of the model ``vllm_config`` serves."""
    mc = vllm_config.model_config
    return model_fingerprint(mc.model, getattr(mc, "revision", None), getattr(mc, "quantization", None))


def request_salt(cache_salt: str | None, lora_name: str | None) -> bytes:
    """The key salt of a request: its ``cache_salt`` and LoRA adapter
    (empty for neither, so such requests share keys)."""
    if not cache_salt and not lora_name:
        return b""
    return json.dumps([cache_salt or "", lora_name or ""]).encode()


def salt_of(request: Request) -> bytes:
    """:func:`request_salt` of a vLLM request."""
    lora = getattr(request, "lora_request", None)
    return request_salt(getattr(request, "cache_salt", None), lora.lora_name if lora else None)
