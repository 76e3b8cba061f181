"""The proxy model: a small pre-LayerNorm GPT without biases (Wortsman et al. 2023, §2.1 set-up).

Two knobs are the paper's positive controls: ``qk_layernorm`` (a LayerNorm on the queries and the
keys of every head before their dot product) and the z-loss (:func:`lm_loss`, ``z_loss > 0``:
``z_loss * log(Z)**2`` added to the cross-entropy, ``Z`` the softmax's normaliser).  Every attention
layer records the largest pre-softmax logit it computed (``max_logit``), without a host read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class ModelConfig:
    vocab: int = 256  #: byte-level tokens
    width: int = 128
    heads: int = 4
    layers: int = 2
    seq_len: int = 128
    qk_layernorm: bool = False


class Attention(nn.Module):
    """Causal multi-head self-attention with explicit logits (so that their maximum can be read)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads = cfg.heads  #: (the name QKClip reads)
        self.head_dim = cfg.width // cfg.heads
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width, bias=False)
        self.out = nn.Linear(cfg.width, cfg.width, bias=False)
        self.q_norm = nn.LayerNorm(self.head_dim, bias=False) if cfg.qk_layernorm else None
        self.k_norm = nn.LayerNorm(self.head_dim, bias=False) if cfg.qk_layernorm else None
        mask = torch.ones(cfg.seq_len, cfg.seq_len, dtype=torch.bool).tril()
        self.register_buffer("mask", mask, persistent=False)
        self.max_logit = torch.zeros(())  #: the largest attention logit since the last reset

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, w = h.shape
        q, k, v = self.qkv(h).view(b, t, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        logits = (q @ k.transpose(-1, -2)) / math.sqrt(self.head_dim)
        mask = self.mask[:t, :t]
        with torch.no_grad():
            seen = logits.detach().masked_fill(~mask, -math.inf).amax()
            self.max_logit = torch.maximum(self.max_logit, seen)
        weights = logits.masked_fill(~mask, -math.inf).softmax(dim=-1)
        y = (weights @ v).transpose(1, 2).reshape(b, t, w)
        out: torch.Tensor = self.out(y)
        return out


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.width, bias=False)
        self.attn = Attention(cfg)
        self.norm2 = nn.LayerNorm(cfg.width, bias=False)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.width, 4 * cfg.width, bias=False),
            nn.GELU(),
            nn.Linear(4 * cfg.width, cfg.width, bias=False),
        )

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.attn(self.norm1(h))
        out: torch.Tensor = h + self.mlp(self.norm2(h))
        return out


class GPT(nn.Module):
    """Token and learned position embeddings, pre-LN blocks, a final LayerNorm, an untied read-out."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.width)
        self.pos = nn.Embedding(cfg.seq_len, cfg.width)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.width, bias=False)
        self.head = nn.Linear(cfg.width, cfg.vocab, bias=False)
        for module in self.modules():  # the paper's init: N(0, 1/fan_in) weights, N(0, 1) embeddings
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=module.in_features**-0.5)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok(x) + self.pos.weight[: x.shape[1]]
        for block in self.blocks:
            h = block(h)
        logits: torch.Tensor = self.head(self.norm(h))
        return logits

    def max_logit(self) -> torch.Tensor:
        """The largest attention logit of any layer since :meth:`reset_max_logit` (a 0-d tensor)."""
        return torch.stack([block.attn.max_logit for block in self.blocks]).amax()

    def reset_max_logit(self) -> None:
        for block in self.blocks:
            block.attn.max_logit = torch.zeros(())


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, z_loss: float = 0.0) -> torch.Tensor:
    """Mean next-token cross-entropy, plus ``z_loss * mean(log(Z)**2)`` when ``z_loss > 0``."""
    flat = logits.reshape(-1, logits.shape[-1]).float()
    loss = nn.functional.cross_entropy(flat, targets.reshape(-1))
    if z_loss > 0:
        loss = loss + z_loss * flat.logsumexp(dim=-1).pow(2).mean()
    return loss
