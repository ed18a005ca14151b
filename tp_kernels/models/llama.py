"""A small Llama-style decoder with torchtitan's module names, so torchtitan's TP plan applies.

Shapes (``B`` batch, ``S`` sequence, ``D = dim``, ``H = n_heads``, ``K = n_kv_heads``,
``d = D / H`` head dim, ``F = ffn_hidden_dim``, ``V = vocab_size``)::

    tokens [B, S] int64
      -> tok_embeddings                                  h [B, S, D]
      -> layers["0"], layers["1"], ...:
           h = h + attention(attention_norm(h))          wq [H*d, D], wk/wv [K*d, D], wo [D, H*d]
           h = h + feed_forward(ffn_norm(h))             w1/w3 [F, D], w2 [D, F]
      -> norm -> output                                  logits [B, S, V]

Attention is causal softmax attention with rotary position embeddings (RoPE, half-split rotation:
``x = [x1, x2]`` -> ``[x1*cos - x2*sin, x1*sin + x2*cos]`` with angle ``pos * theta^(-2i/d)``) and
grouped-query attention: query head ``j`` attends with key/value head ``j // (H / K)``.
The feed-forward is SwiGLU: ``w2(silu(w1(x)) * w3(x))``.

Tensor parallelism (see :mod:`tp_kernels.models.plans`) shards ``wq/wk/wv`` and ``w1/w3``
column-wise, so an attention layer sees only its local heads; it derives their count from the local
tensor shapes. Because local query heads ``[r*H/W, (r+1)*H/W)`` map to the local key/value heads
``[r*K/W, (r+1)*K/W)``, the grouping stays right on every rank when ``W`` divides ``K``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["Attention", "FeedForward", "Llama", "LlamaConfig", "TransformerBlock"]


@dataclass
class LlamaConfig:
    """Hyper-parameters of :class:`Llama`; the defaults make a model that trains in seconds on CPUs.

    ``dim`` must be a multiple of ``n_heads`` with an even head dim ``dim // n_heads`` (RoPE rotates
    pairs), and ``n_heads`` a multiple of ``n_kv_heads``.
    """

    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_hidden_dim: int = 128
    max_seq_len: int = 128
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "dim",
            "n_layers",
            "n_heads",
            "n_kv_heads",
            "ffn_hidden_dim",
            "max_seq_len",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"LlamaConfig.{name} must be a positive int, got {value!r}")
        if self.dim % self.n_heads:
            raise ValueError(
                f"LlamaConfig.dim ({self.dim}) must be a multiple of n_heads ({self.n_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"LlamaConfig: head dim dim/n_heads = {self.head_dim} must be even for RoPE"
            )
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"LlamaConfig.n_heads ({self.n_heads}) must be a multiple of n_kv_heads "
                f"({self.n_kv_heads}) for grouped-query attention"
            )
        if self.norm_eps <= 0 or self.rope_theta <= 0:
            raise ValueError(
                f"LlamaConfig: norm_eps and rope_theta must be > 0, got {self.norm_eps} and "
                f"{self.rope_theta}"
            )

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


def rope_tables(head_dim: int, seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE tables ``cos, sin [seq_len, head_dim/2]`` of the angles ``pos * theta^(-2i/head_dim)``.

    Computed in float64 so that every dtype of the model starts from correctly rounded tables.
    """
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [B, S, heads, d]`` by ``cos, sin [S, d/2]``; pairs are ``(i, i + d/2)``."""
    x1, x2 = x.chunk(2, dim=-1)
    cos = cos[:, None, :]
    sin = sin[:, None, :]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class Attention(nn.Module):
    """Causal grouped-query self-attention with RoPE.

    ``forward(x [B, S, D], rope=(cos, sin) [S, d/2]) -> [B, S, D]``:
    ``q = rope(x @ wq.T)``, ``k = rope(x @ wk.T)``, ``v = x @ wv.T`` split into heads of size ``d``;
    each query head attends to its key/value head with ``softmax(q k^T / sqrt(d) + causal) v``;
    the heads are concatenated and projected by ``wo``.

    ``x`` may be a plain tensor or a replicated DTensor (the output of a ``PrepareModuleInput``),
    and ``wq/wk/wv`` may be column-sharded: the local head counts come from the projections' local
    shapes, and their ratio must equal ``n_heads / n_kv_heads``.
    """

    def __init__(self, config: LlamaConfig, *, device: torch.device | str | None = None) -> None:
        super().__init__()
        d = config.head_dim
        self.head_dim = d
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.wq = nn.Linear(config.dim, config.n_heads * d, bias=False, device=device)
        self.wk = nn.Linear(config.dim, config.n_kv_heads * d, bias=False, device=device)
        self.wv = nn.Linear(config.dim, config.n_kv_heads * d, bias=False, device=device)
        self.wo = nn.Linear(config.n_heads * d, config.dim, bias=False, device=device)

    def _heads(self, y: torch.Tensor, name: str) -> torch.Tensor:
        if y.shape[-1] % self.head_dim:
            raise ValueError(
                f"Attention: {name} gives {y.shape[-1]} local features, not a multiple of the head "
                f"dim {self.head_dim}; a tensor-parallel degree must divide the head counts"
            )
        return y.view(*y.shape[:-1], -1, self.head_dim)

    def forward(self, x: torch.Tensor, *, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        q = self._heads(self.wq(x), "wq")  # [B, S, local heads, d]
        k = self._heads(self.wk(x), "wk")
        v = self._heads(self.wv(x), "wv")
        n_q, n_kv = q.shape[-2], k.shape[-2]
        group = self.n_heads // self.n_kv_heads
        if n_q != n_kv * group:
            raise ValueError(
                f"Attention: {n_q} local query heads and {n_kv} local key/value heads do not keep "
                f"the ratio n_heads/n_kv_heads = {group}; the tensor-parallel degree must divide "
                f"both n_heads ({self.n_heads}) and n_kv_heads ({self.n_kv_heads})"
            )
        cos, sin = rope
        q = apply_rope(q, cos, sin).transpose(1, 2)  # [B, local heads, S, d]
        k = apply_rope(k, cos, sin).transpose(1, 2).repeat_interleave(group, dim=1)
        v = v.transpose(1, 2).repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).flatten(2))


class FeedForward(nn.Module):
    """SwiGLU: ``forward(x [..., D]) = w2(silu(w1(x)) * w3(x))``, hidden width ``F``."""

    def __init__(self, config: LlamaConfig, *, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.ffn_hidden_dim, bias=False, device=device)
        self.w2 = nn.Linear(config.ffn_hidden_dim, config.dim, bias=False, device=device)
        self.w3 = nn.Linear(config.dim, config.ffn_hidden_dim, bias=False, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm block: ``h = x + attention(attention_norm(x))``, ``h + feed_forward(ffn_norm(h))``.

    ``forward(x [B, S, D], rope) -> [B, S, D]``; under sequence parallelism ``x`` and the output are
    the local sequence shards ``[B, S/W, D]``.
    """

    def __init__(self, config: LlamaConfig, *, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(config.dim, eps=config.norm_eps, device=device)
        self.attention = Attention(config, device=device)
        self.ffn_norm = nn.RMSNorm(config.dim, eps=config.norm_eps, device=device)
        self.feed_forward = FeedForward(config, device=device)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        # rope goes by keyword: a PrepareModuleInput on `attention` lays out positional inputs only.
        h = x + self.attention(self.attention_norm(x), rope=rope)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """A Llama-style decoder: ``forward(tokens [B, S] int64) -> logits [B, S, vocab_size]``.

    ``Llama(config, seed=s)`` initialises every weight from a CPU generator seeded with ``s`` (see
    :meth:`init_weights`), so the same seed gives bitwise-identical weights on every rank and in
    every process, whatever ``device`` and ``dtype``, and leaves the global RNG untouched.
    The RoPE tables ``rope_cos, rope_sin [max_seq_len, d/2]`` are non-persistent buffers (not in the
    state dict); like the weights, they follow the model's dtype. A later ``.to(dtype)`` casts the
    tables as they are, so build with ``dtype=`` (or call :meth:`init_weights`) for tables rounded
    once, straight from float64.
    """

    def __init__(
        self,
        config: LlamaConfig | None = None,
        *,
        seed: int = 0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.config = config = config if config is not None else LlamaConfig()
        if not isinstance(config, LlamaConfig):
            raise TypeError(f"Llama: config must be a LlamaConfig, got {type(config).__name__}")
        # Built on the meta device, then filled by init_weights: no default init, no global RNG use.
        meta = torch.device("meta")
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim, device=meta)
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(config, device=meta) for i in range(config.n_layers)}
        )
        self.norm = nn.RMSNorm(config.dim, eps=config.norm_eps, device=meta)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False, device=meta)
        half = config.head_dim // 2
        self.register_buffer(
            "rope_cos", torch.empty(config.max_seq_len, half, device=meta), persistent=False
        )
        self.register_buffer(
            "rope_sin", torch.empty(config.max_seq_len, half, device=meta), persistent=False
        )
        self.to_empty(device=device if device is not None else "cpu")
        if dtype is not None:
            self.to(dtype)
        self.init_weights(seed)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Fill every parameter and buffer deterministically from ``seed``.

        Draws in fp32 on the CPU in ``named_parameters`` order, then copies into each tensor's own
        device and dtype. RMSNorm weights are 1; embeddings ``N(0, 1)``; a Linear with fan-in ``n``
        gets ``N(0, 1/n)``, with the residual projections ``wo, w2`` further scaled by
        ``1/sqrt(2 * n_layers)`` so the residual stream does not grow with depth.
        Meant for an unsharded model: parallelize after initialising.
        """
        gen = torch.Generator(device="cpu").manual_seed(seed)
        residual_scale = 1.0 / math.sqrt(2 * self.config.n_layers)
        for name, p in self.named_parameters():
            owner = name.rsplit(".", 2)[-2]
            if owner.endswith("norm"):
                p.fill_(1.0)
                continue
            std = 1.0 if owner == "tok_embeddings" else 1.0 / math.sqrt(p.shape[1])
            if owner in ("wo", "w2"):
                std *= residual_scale
            p.copy_(torch.randn(p.shape, generator=gen) * std)
        cfg = self.config
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.dim() != 2 or tokens.dtype != torch.int64:
            raise ValueError(
                f"Llama.forward: tokens must be [batch, seq] int64, got {list(tokens.shape)} "
                f"{tokens.dtype}"
            )
        seq = tokens.shape[1]
        if seq > self.config.max_seq_len:
            raise ValueError(
                f"Llama.forward: sequence length {seq} exceeds max_seq_len "
                f"{self.config.max_seq_len}"
            )
        rope = (self.rope_cos[:seq], self.rope_sin[:seq])
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, rope)
        return self.output(self.norm(h))
