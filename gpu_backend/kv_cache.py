"""The paged KV cache: one preallocated tensor, pages are plain ints owned by the caller."""

from __future__ import annotations

import torch

from gpu_backend.models.config import ModelConfig


class KVCache:
    """K and V of every layer: `data[layer]` is [num_pages * page_size, 2, kv_heads, head_dim].

    K and V of a token sit side by side so one index_copy writes both and one gather reads both.
    Slot `page * page_size + offset` holds the token at `offset` of `page`.
    """

    def __init__(self, cfg: ModelConfig, page_size: int, num_pages: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        if page_size < 1 or num_pages < 1:
            raise ValueError(f"page_size and num_pages must be >= 1, got {page_size} and {num_pages}")
        self.page_size = page_size
        self.num_pages = num_pages
        self.data = torch.zeros(
            cfg.num_layers, num_pages * page_size, 2, cfg.num_kv_heads, cfg.head_dim, device=device, dtype=dtype
        )

    @staticmethod
    def bytes_per_page(cfg: ModelConfig, page_size: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return cfg.num_layers * page_size * 2 * cfg.num_kv_heads * cfg.head_dim * elem

    def page_slots(self, pages: list[int]) -> torch.Tensor:
        """The slot indices of `pages`, page after page, on the cache's device."""
        ps = self.page_size
        slots = torch.tensor(pages, dtype=torch.long).repeat_interleave(ps) * ps + torch.arange(ps).repeat(len(pages))
        return slots.to(self.data.device)

    def read_pages(self, pages: list[int]) -> torch.Tensor:
        """`pages`' K/V of every layer, copied to host memory ([layers, pages * page_size, 2, heads, dim])."""
        out = self.data[:, self.page_slots(pages)]
        return out.to("cpu", non_blocking=False) if out.is_cuda else out

    def write_pages(self, pages: list[int], kv: torch.Tensor) -> None:
        """Write `read_pages`' copy back into `pages` (any pages, as many and in the same order)."""
        self.data[:, self.page_slots(pages)] = kv.to(self.data.device)
        if self.data.is_cuda:  # the next batch may run on another stream: the copy lands first
            torch.cuda.synchronize(self.data.device)

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the K/V of slots `src` to slots `dst` in every layer."""
        self.data[:, dst] = self.data[:, src]
