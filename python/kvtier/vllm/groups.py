"""What kvtier keeps of each KV cache group vLLM hands the connector, and
which KV heads a tensor-parallel rank holds.

vLLM splits a model's attention layers into KV cache groups: one for a
plain model; with the hybrid KV cache manager, one per kind of layer
(Gemma 2's sliding-window layers beside its full ones, Gemma 3's several
windows). Each group has its own block table, and the groups' layer
tensors alias one memory (a block id belongs to one group at a time), so
the connector keeps every group under keys and a layout of its own and
touches a group's layers only at that group's block ids.

**Objects.** One store object per (group, block, KV head): the block's
pages of that head in every layer of the group. The object is named by the
head's index among the model's KV heads, never by the rank that wrote it,
so a deployment at any tensor-parallel degree that divides the KV heads
reads exactly the heads its ranks own: KV saved at TP=2 restores at TP=1
and at TP=4 (docs/block-format.md, "Objects under vLLM"). Each head is a
namespace (a G3 directory) of its own, so the ranks of one node never
share a directory. MLA keeps one latent row per token and no heads: one
object per (group, block). A head held by several ranks (more ranks than
KV heads, or MLA's latent at TP > 1) is saved by each of them under its
replica index, since a G3 directory has one owner.

**Sliding windows.** A sliding-window group needs only the blocks inside
the window before the first token it computes: vLLM frees the others as
the window moves and hands the null block (id 0) in their place, and
kvtier never reads or writes block 0.

This module reads vLLM's KV cache config by attribute and imports vLLM only
to tell its spec classes apart."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

#: The kinds of group kvtier stores.
FULL, SLIDING, LATENT = "full", "sliding", "latent"

#: Names the object scheme in every namespace's fingerprint: a change of
#: scheme gives other keys, so objects of an older scheme are a clean miss.
OBJECT_SCHEME = "kvtier.vllm objects v3: one per group, block and KV head"

#: The null block vLLM puts where a sliding window dropped a block.
NULL_BLOCK = 0


@dataclass(frozen=True)
class KvGroup:
    """One KV cache group as kvtier stores it."""

    #: Its index in vLLM's ``kv_cache_groups`` (and in every block table).
    index: int
    #: :data:`FULL`, :data:`SLIDING` or :data:`LATENT` (MLA).
    kind: str
    #: Its layers, by layer index (the order of their pages in an object).
    layer_names: tuple[str, ...]
    #: Tokens per block.
    block_size: int
    #: Elements of one token's row of one head (K's or V's); MLA: the
    #: latent and its rope part together.
    head_size: int
    #: KV heads each rank holds (1 for MLA).
    heads_per_rank: int
    dtype: torch.dtype
    #: A sliding window's width in tokens and the tokens vLLM keeps beyond
    #: it; ``None`` and 0 otherwise.
    window: int | None = None
    extra_tokens: int = 0

    @property
    def window_blocks(self) -> int | None:
        """How many blocks before the first computed token this group needs
        (vLLM's own rule: ``cdiv(window - 1 + extra, block_size)``);
        ``None``: every block from the start."""
        if self.window is None:
            return None
        return -(-(self.window - 1 + self.extra_tokens) // self.block_size)

    def descriptor(self) -> str:
        """What separates this group's keys from every other group's: the
        object scheme, its kind, window and layer names."""
        return json.dumps(
            {
                "scheme": OBJECT_SCHEME,
                "kind": self.kind,
                "window": self.window,
                "extra": self.extra_tokens,
                "layers": list(self.layer_names),
            },
            sort_keys=True,
        )


def kv_groups(kv_cache_config: Any) -> list[KvGroup]:
    """The groups of vLLM's ``KVCacheConfig``; a group kvtier cannot store
    (Mamba state, chunked-local or cross attention, padded or quantized
    pages, ...) is a ``ValueError`` naming it, and so are groups of
    different block sizes."""
    from vllm.model_executor.models.utils import extract_layer_index
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec

    groups: list[KvGroup] = []
    for i, g in enumerate(kv_cache_config.kv_cache_groups):
        spec = g.kv_cache_spec
        kind = {FullAttentionSpec: FULL, SlidingWindowSpec: SLIDING, MLAAttentionSpec: LATENT}.get(type(spec))
        what = f"KV cache group {i} ({type(spec).__name__}, layers {', '.join(g.layer_names)})"
        if kind is None or not getattr(g, "enable_kv_transfer", True):
            raise ValueError(
                f"kvtier: {what} is not one kvtier stores: full attention, sliding-window and MLA groups are"
            )
        if kind == FULL and getattr(spec, "attention_chunk_size", None):
            raise ValueError(f"kvtier: {what} uses chunked local attention, which kvtier does not store")
        if getattr(spec, "page_size_padded", None) or int(getattr(spec, "kv_quant_mode", 0) or 0):
            raise ValueError(f"kvtier: {what} has padded or quantized pages, which kvtier does not store")
        groups.append(
            KvGroup(
                index=i,
                kind=kind,
                layer_names=tuple(sorted(g.layer_names, key=extract_layer_index)),
                block_size=int(spec.block_size),
                head_size=int(spec.head_size),
                heads_per_rank=int(spec.num_kv_heads),
                dtype=spec.dtype,
                window=int(spec.sliding_window) if kind == SLIDING else None,
                extra_tokens=int(getattr(spec, "extra_retained_tokens", 0) or 0) if kind == SLIDING else 0,
            )
        )
    if not groups:
        raise ValueError("kvtier: vLLM's KV cache config has no groups")
    sizes = {g.block_size for g in groups}
    if len(sizes) > 1:
        raise ValueError(f"kvtier: KV cache groups of different block sizes {sorted(sizes)}")
    return groups


@dataclass(frozen=True)
class RankHeads:
    """The KV heads one tensor-parallel rank holds."""

    #: The model's KV heads (1 for MLA's latent).
    total: int
    #: The heads of this rank, in the order of its KV tensors' head axis.
    heads: tuple[int, ...]
    #: Which copy of its heads this rank holds, when several ranks hold
    #: them (0 otherwise).
    replica: int


def rank_heads(total: int, rank: int, world: int) -> RankHeads:
    """The heads of ``rank`` of ``world``, as vLLM shards them: ranks split
    the heads evenly (rank r holds ``[r*H/T, (r+1)*H/T)``); with more ranks
    than heads, each head is held by ``T/H`` consecutive ranks. A split
    vLLM would not make is a ``ValueError``."""
    if total < 1 or world < 1 or not 0 <= rank < world:
        raise ValueError(f"kvtier: rank {rank} of {world} over {total} KV heads")
    if world <= total:
        if total % world:
            raise ValueError(f"kvtier: {total} KV heads do not split over {world} ranks")
        per = total // world
        return RankHeads(total, tuple(range(rank * per, (rank + 1) * per)), 0)
    if world % total:
        raise ValueError(f"kvtier: {world} ranks do not replicate {total} KV heads evenly")
    copies = world // total
    return RankHeads(total, (rank // copies,), rank % copies)


def hit_end(groups: list[KvGroup], present: list[bytes], first: int, end: int) -> int:
    """The end (in blocks) of the longest restore from block ``first``:
    the largest ``e`` in ``(first, end]`` such that every full or MLA group
    holds blocks ``[first, e)`` and every sliding-window group the blocks of
    its window before ``e`` (from ``max(first, e - window_blocks)``), as
    vLLM's own cache decides a hit; ``first`` when there is none.
    ``present[g][i]`` says whether group ``g`` holds block ``first + i``."""
    cap = end
    for g, p in zip(groups, present, strict=True):
        if g.window_blocks is None:
            missing = p.find(0, 0, end - first)
            if missing >= 0:
                cap = min(cap, first + missing)
    for e in range(cap, first, -1):
        if all(
            g.window_blocks is None or all(p[i - first] for i in range(max(first, e - g.window_blocks), e))
            for g, p in zip(groups, present, strict=True)
        ):
            return e
    return first
