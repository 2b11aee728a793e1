"""kvtier.staging: pages of KV tensors that cannot be copied in place
(an accelerator's, strided views, K and V side by side per token) round-trip
through the store in the CPU backend's form, so every arrangement stores the
same bytes. Runs on the CPU, and on CUDA too where torch sees a GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvtier import BlockResult, Layout, Store, Transfer
from kvtier.staging import KV_PER_BLOCK, KV_PER_TOKEN, PageStaging

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
LAYERS, HEADS, TOKENS, HEAD = 3, 2, 16, 64
BLOCKS = 10


def kv_cache(device: str, dtype: torch.dtype, seed: int, strided: bool) -> list[torch.Tensor]:
    """Per layer a [BLOCKS, HEADS, TOKENS, 2 * HEAD] tensor of random values;
    ``strided`` lays it out token-major in memory ([B, N, H, C], as vLLM's
    NHD layout) and hands out the permuted view."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(LAYERS):
        if strided:
            t = torch.randn(BLOCKS, TOKENS, HEADS, 2 * HEAD, generator=g).to(dtype).permute(0, 2, 1, 3)
        else:
            t = torch.randn(BLOCKS, HEADS, TOKENS, 2 * HEAD, generator=g).to(dtype)
        out.append(t.to(device))
    return out


def cpu_page(t: torch.Tensor, block: int, arrangement: str) -> torch.Tensor:
    """Block ``block`` of layer ``t`` as vLLM's CPU backend holds it: per
    head the block's K rows, then its V rows, seen as [HEADS, TOKENS, 2 *
    HEAD] (written here from the backends' definitions, not from
    PageStaging)."""
    page = t[block].cpu()
    if arrangement == KV_PER_BLOCK:
        return page.contiguous()
    k, v = page[..., :HEAD], page[..., HEAD:]
    return torch.cat([k, v], dim=1).reshape(HEADS, TOKENS, 2 * HEAD)


def results(t: Transfer) -> list[BlockResult]:
    """A transfer's results, once it is done."""
    r = t.wait()
    assert r is not None
    return r


def keys(n: int) -> list[bytes]:
    return [b"stage" + i.to_bytes(4, "little") for i in range(n)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arrangement", [KV_PER_TOKEN, KV_PER_BLOCK])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_staged_pages_are_stored_in_the_cpu_backends_form(
    tmp_path: Path, device: str, arrangement: str, dtype: torch.dtype
) -> None:
    name = "f32" if dtype == torch.float32 else "bf16"
    layout = Layout.vllm_cpu(LAYERS, HEADS, HEAD, block_tokens=TOKENS, dtype=name)
    ns = Store(str(tmp_path), g2_bytes=16 << 20, g3_bytes=64 << 20).namespace(layout, fingerprint="staging")
    src = kv_cache(device, dtype, seed=1, strided=True)
    saved_ids = [7, 2, 5, 0]
    staging = PageStaging(src, arrangement)
    host = staging.gather(saved_ids)
    assert all(r == "stored" for r in results(ns.save(keys(4), PageStaging.pieces(host))))

    # Read back in place into the CPU backend's own contiguous tensors:
    # what was stored is the CPU form of each page, whatever its arrangement.
    cpu = [torch.zeros(BLOCKS, HEADS, TOKENS, 2 * HEAD, dtype=dtype) for _ in range(LAYERS)]
    assert all(r.ok for r in results(ns.load_pages(keys(4), cpu, [1, 3, 4, 6])))
    for t_src, t_cpu in zip(src, cpu, strict=True):
        for got, want in zip([1, 3, 4, 6], saved_ids, strict=True):
            assert torch.equal(t_cpu[got], cpu_page(t_src, want, arrangement))

    # Loaded back layer by layer through staging into fresh tensors of the
    # same kind, at other blocks (as vLLM's connector does inside a step):
    # each layer's blocks equal the sources once that layer is scattered,
    # the later layers and every other block are untouched.
    dst = kv_cache(device, dtype, seed=2, strided=True)
    before = [t.clone() for t in dst]
    back = PageStaging(dst, arrangement)
    host = back.buffer(4)
    loading = ns.load(keys(4), PageStaging.pieces(host), layerwise=True)
    for li in range(LAYERS):
        assert loading.wait_layer(li, timeout=60)
        back.scatter(host, [9, 8, 3, 1], layer=li)
        if device == "cuda":
            torch.cuda.synchronize()
        for got, want in zip([9, 8, 3, 1], saved_ids, strict=True):
            assert torch.equal(dst[li][got], src[li][want])
        for later in range(li + 1, LAYERS):
            assert torch.equal(dst[later], before[later])
    assert all(r.ok for r in results(loading))
    for t_dst, t_before in zip(dst, before, strict=True):
        for b in {0, 2, 4, 5, 6, 7}:
            assert torch.equal(t_dst[b], t_before[b])


@pytest.mark.parametrize("device", DEVICES)
def test_a_gpu_style_page_and_a_cpu_page_share_one_stored_block(tmp_path: Path, device: str) -> None:
    """Saved from a per-token (FlashAttention) cache, loaded into a
    per-block (CPU backend) staged cache, and the other way round: each
    backend reads back the KV the other one wrote."""
    layout = Layout.vllm_cpu(LAYERS, HEADS, HEAD, block_tokens=TOKENS, dtype="f32")
    ns = Store(str(tmp_path), g2_bytes=16 << 20, g3_bytes=64 << 20).namespace(layout, fingerprint="share")
    flash = kv_cache(device, torch.float32, seed=3, strided=False)
    host = PageStaging(flash, KV_PER_TOKEN).gather([4])
    assert all(r == "stored" for r in results(ns.save(keys(1), PageStaging.pieces(host))))
    cpu = kv_cache("cpu", torch.float32, seed=4, strided=True)
    stage = PageStaging(cpu, KV_PER_BLOCK)
    host = stage.buffer(1)
    assert all(r.ok for r in results(ns.load(keys(1), PageStaging.pieces(host))))
    stage.scatter(host, [0])
    assert torch.equal(cpu[1][0], cpu_page(flash[1], 4, KV_PER_TOKEN))
    # Back: the CPU page into a per-token cache gives the original K and V.
    again = kv_cache(device, torch.float32, seed=5, strided=True)
    PageStaging(again, KV_PER_TOKEN).scatter(PageStaging(cpu, KV_PER_BLOCK).gather([0]), [6])
    for li in range(LAYERS):
        assert torch.equal(again[li][6], flash[li][4])


def test_bad_tensors_are_refused() -> None:
    a = torch.zeros(4, 2, 16, 128)
    with pytest.raises(ValueError, match="no KV cache tensors"):
        PageStaging([], KV_PER_TOKEN)
    with pytest.raises(ValueError, match="unknown page arrangement"):
        PageStaging([a], "kv-per-head")
    with pytest.raises(ValueError, match="expected \\[num_blocks"):
        PageStaging([torch.zeros(4, 16, 128)], KV_PER_TOKEN)
    with pytest.raises(ValueError, match="layers differ"):
        PageStaging([a, torch.zeros(4, 2, 16, 128, dtype=torch.bfloat16)], KV_PER_TOKEN)
    s = PageStaging([a, a.clone()], KV_PER_TOKEN)
    with pytest.raises(ValueError, match="host pages of shape"):
        s.scatter(s.buffer(3), [0, 1])
    with pytest.raises(ValueError, match="no layer 2 of 2"):
        s.scatter(s.buffer(2), [0, 1], layer=2)
