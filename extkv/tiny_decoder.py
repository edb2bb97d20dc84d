"""TinyDecoder: the small paged-attention decoder the reference runner serves.

Theory of operation
-------------------
A few decoder layers whose attention reads and writes a paged KV cache
(blocks, K/V, block_size, kv heads, head size) through block tables, the
way a serving engine's attention does: each step writes its token's K and V
into the slot its position names and attends over the blocks its table
lists. Every shape is static (tables padded with the null block, lengths
masking the rest), so a CUDA graph can capture a decode step and replay it
over blocks committed after the capture. extkv.reference_model drives it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .layout import FullAttentionSpec


@dataclass(frozen=True)
class TinyDecoderConfig:
    vocab_size: int = 512
    hidden_size: int = 256
    num_layers: int = 3
    num_heads: int = 4
    num_kv_heads: int = 2
    head_size: int = 64
    block_size: int = 16
    max_blocks_per_seq: int = 16
    dtype: torch.dtype = torch.float32

    @property
    def max_positions(self) -> int:
        return self.block_size * self.max_blocks_per_seq

    @property
    def kv_cache_spec(self) -> FullAttentionSpec:
        return FullAttentionSpec(
            block_size=self.block_size, num_kv_heads=self.num_kv_heads, head_size=self.head_size, dtype=self.dtype
        )


def paged_attention(
    query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor
) -> torch.Tensor:
    """Attention of one new token per sequence over its cached context.

    `query` (batch, heads, head_size); `kv_cache` (blocks, 2, block_size,
    kv_heads, head_size), K then V; `block_tables` (batch, max_blocks) block
    ids, unused entries pointing at the null block; `seq_lens` (batch,) tokens
    in context including the new one. Static shapes throughout, so a CUDA
    graph can capture it."""
    batch, heads, head_size = query.shape
    keys = kv_cache[block_tables, 0].flatten(1, 2)  # (batch, tokens, kv_heads, head_size)
    values = kv_cache[block_tables, 1].flatten(1, 2)
    group = heads // keys.shape[2]
    keys = keys.repeat_interleave(group, dim=2)
    values = values.repeat_interleave(group, dim=2)
    scores = torch.einsum("bhd,bthd->bht", query, keys) * head_size**-0.5
    positions = torch.arange(keys.shape[1], device=query.device)
    scores = scores.masked_fill(positions[None, None, :] >= seq_lens[:, None, None], float("-inf"))
    return torch.einsum("bht,bthd->bhd", scores.softmax(dim=-1), values)


class DecoderLayer(nn.Module):
    def __init__(self, config: TinyDecoderConfig):
        super().__init__()
        self.config = config
        q, kv = config.num_heads * config.head_size, config.num_kv_heads * config.head_size
        self.norm1 = nn.LayerNorm(config.hidden_size)
        self.qkv = nn.Linear(config.hidden_size, q + 2 * kv)
        self.out = nn.Linear(q, config.hidden_size)
        self.norm2 = nn.LayerNorm(config.hidden_size)
        self.mlp = nn.Sequential(
            nn.Linear(config.hidden_size, 4 * config.hidden_size), nn.SiLU(), nn.Linear(4 * config.hidden_size, config.hidden_size)
        )

    def forward(self, hidden, kv_cache, slot_blocks, slot_offsets, block_tables, seq_lens):
        c = self.config
        q_size, kv_size = c.num_heads * c.head_size, c.num_kv_heads * c.head_size
        query, key, value = self.qkv(self.norm1(hidden)).split([q_size, kv_size, kv_size], dim=-1)
        batch = hidden.shape[0]
        kv_cache[slot_blocks, 0, slot_offsets] = key.view(batch, c.num_kv_heads, c.head_size)
        kv_cache[slot_blocks, 1, slot_offsets] = value.view(batch, c.num_kv_heads, c.head_size)
        attended = paged_attention(query.view(batch, c.num_heads, c.head_size), kv_cache, block_tables, seq_lens)
        hidden = hidden + self.out(attended.reshape(batch, q_size))
        return hidden + self.mlp(self.norm2(hidden))


class TinyDecoder(nn.Module):
    """A few decoder layers with paged attention, enough to exercise a KV cache
    the way a serving engine does."""

    def __init__(self, config: TinyDecoderConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.positions = nn.Embedding(config.max_positions, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = nn.LayerNorm(config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, tokens, positions, block_tables, seq_lens, kv_caches):
        """One decode step: logits (batch, vocab) for the token at `positions`."""
        block_size = self.config.block_size
        slot_blocks = torch.gather(block_tables, 1, (positions // block_size)[:, None])[:, 0]
        slot_offsets = positions % block_size
        hidden = self.embed(tokens) + self.positions(positions)
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden = layer(hidden, kv_cache, slot_blocks, slot_offsets, block_tables, seq_lens)
        return self.lm_head(self.norm(hidden))
