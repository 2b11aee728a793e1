"""KV pages of per-layer torch tensors that cannot be copied in place: an
accelerator's memory, a strided (permuted) view, or a backend that arranges
K and V differently inside a page. Pages pass through one pinned host buffer
per transfer and are stored in one canonical form, so a GPU worker and a CPU
worker of the same model share KV.

Every layer is a tensor of logical shape ``[num_blocks, kv_heads,
block_size, 2 * head_size]`` (vLLM's per-layer KV cache view, whatever its
memory order), and the backends disagree on what the last axis holds:

- :data:`KV_PER_BLOCK` (vLLM's CPU backend): per (block, head), the block's
  ``block_size`` K rows come first, then its V rows. This is the stored,
  canonical form (``Layout.vllm_cpu``), copied in place where the tensor is
  on the CPU and contiguous.
- :data:`KV_PER_TOKEN` (vLLM's FlashAttention, Triton and FlexAttention
  backends): per token, ``head_size`` K values, then its V values. Converted
  to and from the canonical form on the tensor's own device, in the same
  pass as the gather or scatter of the transfer's blocks.

This module needs only torch (no vLLM): :mod:`kvtier.vllm` uses it for its
workers, and a caller with its own paged KV cache can use it directly.
"""

from __future__ import annotations

import torch

#: Per (block, head), all K rows, then all V rows: the stored form.
KV_PER_BLOCK = "kv-per-block"
#: Per token, K then V (``head_size`` values each).
KV_PER_TOKEN = "kv-per-token"
#: Per token, one MLA latent row: pages copied as they are.
LATENT = "latent"

#: How each of vLLM's attention backends (by ``get_name()``) arranges a
#: page; a backend not named here is refused rather than guessed.
VLLM_BACKENDS = {
    "CPU_ATTN": KV_PER_BLOCK,
    "FLASH_ATTN": KV_PER_TOKEN,
    "TRITON_ATTN": KV_PER_TOKEN,
    "FLEX_ATTENTION": KV_PER_TOKEN,
    "CPU_MLA": LATENT,
    "TRITON_MLA": LATENT,
    "FLASHMLA": LATENT,
    "FLASHINFER_MLA": LATENT,
    "CUTLASS_MLA": LATENT,
}


class PageStaging:
    """Moves whole pages between per-layer KV tensors and pinned host
    buffers of ``[layers, blocks, page]`` in the canonical (per-block) form.

    Args:
        layers: One tensor per layer, each of logical shape ``[num_blocks,
            kv_heads, block_size, 2 * head_size]``, all on one device, any
            strides.
        arrangement: :data:`KV_PER_BLOCK` or :data:`KV_PER_TOKEN`.

    Raises:
        ValueError: No layers, layers of different shapes, dtypes or
            devices, or an unknown arrangement.
    """

    def __init__(self, layers: list[torch.Tensor], arrangement: str) -> None:
        if not layers:
            raise ValueError("kvtier: no KV cache tensors to stage")
        if arrangement not in (KV_PER_BLOCK, KV_PER_TOKEN, LATENT):
            raise ValueError(f"kvtier: unknown page arrangement {arrangement!r}")
        first = layers[0]
        if arrangement != LATENT and (first.dim() != 4 or first.shape[-1] % 2):
            raise ValueError(
                f"kvtier: a KV cache of shape {tuple(first.shape)}; expected [num_blocks, kv_heads, "
                "block_size, 2 * head_size]"
            )
        for t in layers:
            if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
                raise ValueError(
                    f"kvtier: KV cache layers differ ({tuple(t.shape)} {t.dtype} on {t.device} vs "
                    f"{tuple(first.shape)} {first.dtype} on {first.device})"
                )
        self.layers = layers
        self.arrangement = arrangement
        self.page_elems = first[0].numel()
        if arrangement != LATENT:
            _, self.heads, self.tokens, two_d = first.shape
            self.head_size = two_d // 2

    def buffer(self, blocks: int) -> torch.Tensor:
        """An uninitialised host buffer for ``blocks`` pages of every layer,
        pinned where CUDA is available (so copies to the device are
        asynchronous)."""
        t = self.layers[0]
        return torch.empty(
            (len(self.layers), blocks, self.page_elems),
            dtype=t.dtype,
            pin_memory=torch.cuda.is_available(),
        )

    @staticmethod
    def pieces(host: torch.Tensor) -> list[list[torch.Tensor]]:
        """Per block, its pieces in a host buffer: ``host[l, i]`` for each
        layer ``l`` (the regions of a ``Layout.vllm_cpu`` block, in order)."""
        return [[host[li, i] for li in range(host.shape[0])] for i in range(host.shape[1])]

    def _canonical(self, page: torch.Tensor) -> torch.Tensor:
        """``[n, heads, 2, tokens, head_size]`` view of host pages
        (``[n, page]`` for :data:`LATENT`)."""
        if self.arrangement == LATENT:
            return page.view(-1, self.page_elems)
        return page.view(-1, self.heads, 2, self.tokens, self.head_size)

    def _device_view(self, sel: torch.Tensor) -> torch.Tensor:
        """Pages gathered from a layer (``[n, heads, tokens, 2 * head_size]``)
        seen as ``[n, heads, 2, tokens, head_size]`` (no copy; ``[n, page]``
        for :data:`LATENT`)."""
        if self.arrangement == LATENT:
            return sel.reshape(-1, self.page_elems)
        if self.arrangement == KV_PER_BLOCK:
            return sel.reshape(-1, self.heads, 2, self.tokens, self.head_size)
        return sel.reshape(-1, self.heads, self.tokens, 2, self.head_size).transpose(2, 3)

    def gather(self, block_ids: list[int]) -> torch.Tensor:
        """The canonical pages of ``block_ids`` in a new host buffer; the
        device-to-host copies are complete when this returns."""
        host = self.buffer(len(block_ids))
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.layers[0].device)
        for li, t in enumerate(self.layers):
            sel = self._device_view(t.index_select(0, idx))
            self._canonical(host[li]).copy_(sel.contiguous())
        return host

    def scatter(self, host: torch.Tensor, block_ids: list[int], layer: int | None = None) -> None:
        """Writes canonical pages from ``host`` into ``block_ids`` of every
        layer, or of ``layer`` alone (queued on the device's current stream;
        a pinned ``host`` is kept alive by torch until its copies are
        done)."""
        if host.shape != (len(self.layers), len(block_ids), self.page_elems):
            raise ValueError(f"kvtier: host pages of shape {tuple(host.shape)} for {len(block_ids)} blocks")
        device = self.layers[0].device
        idx = torch.tensor(block_ids, dtype=torch.long, device=device)
        n = len(block_ids)
        if layer is not None and not 0 <= layer < len(self.layers):
            raise ValueError(f"kvtier: no layer {layer} of {len(self.layers)}")
        for li in range(len(self.layers)) if layer is None else [layer]:
            t = self.layers[li]
            pages = self._canonical(host[li].to(device, non_blocking=True))
            if self.arrangement == KV_PER_TOKEN:
                pages = pages.transpose(2, 3)
            t.index_copy_(0, idx, pages.reshape(n, *t.shape[1:]))
