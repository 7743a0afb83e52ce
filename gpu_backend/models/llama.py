"""The decoder (Llama, Qwen2/3, Mistral, Gemma 2/3, Phi-3) over the paged KV cache.

Weights are fused at build time (q|k|v into one matrix, gate|up into another) so a layer is four
matmuls; RoPE tables are precomputed. What differs between families and layers is data read from
`ModelConfig` when the model is built (optional norms, the activation, the embedding scale, each
layer's `AttnSpec` and RoPE table), so the forward has one body. The layer loop touches no
per-request Python: everything request-specific lives in the BatchPlan.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from gpu_backend.attention import AttnSpec, BatchPlan
from gpu_backend.kv_cache import KVCache
from gpu_backend.models.config import ModelConfig
from gpu_backend.models.rope import cos_sin_table

ACTIVATION_FNS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_tanh": partial(F.gelu, approximate="tanh"),
}


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o_proj: torch.Tensor
    mlp_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    attn: AttnSpec  # the layer's window, softmax scale and soft-cap
    rope: int  # index of the layer's RoPE table
    qk_norm: torch.Tensor | None = None  # [H + KVH, D]: q_norm per query head, then k_norm per KV head
    attn_out_norm: torch.Tensor | None = None  # sandwich norms (Gemma): on the attention output
    mlp_out_norm: torch.Tensor | None = None  # and on the MLP output


class LlamaModel:
    """Weights plus the batched forward pass (every supported family; see the module docstring)."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], device: torch.device,
                 dtype: torch.dtype) -> None:
        """Build from `weights` (HF names), which it consumes: each tensor leaves the dict as it is
        placed (moved, cast, fused), so the checkpoint's copy of the model and the built one are not
        both held at the peak of a load."""
        self.cfg = cfg
        self.group = cfg.num_heads // cfg.num_kv_heads  # query heads per KV head
        self.device, self.dtype = device, dtype
        self.window = cfg.window  # the sliding layers' window (what the batch plan builds masks for)
        self.act = ACTIVATION_FNS[cfg.activation]
        # tensor parallel (gpu_backend/engine/tp.py): sums the partial outputs of the row-parallel matmuls
        # (o_proj, down) across ranks, in place; None on a single rank
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
        # compiled layers (`hidden(compiled=True)`): False = the batch dimension is marked dynamic, so
        # one compile serves every batch size but 1 (which dynamo specializes): 2 compiles per model
        # instead of one per CUDA-graph bucket (9); True = a compile per batch size (static kernels)
        self.compile_static_batch = False

        def take(name: str) -> torch.Tensor:
            if name not in weights:
                raise KeyError(f"weight {name} missing from the checkpoint")
            return weights.pop(name)

        def w(name: str) -> torch.Tensor:
            return take(name).to(device=device, dtype=dtype).contiguous()

        def norm(name: str) -> torch.Tensor:
            # Gemma's norms scale by (1 + weight): fold the offset in once, in float32
            if not cfg.norm_offset:
                return w(name)
            return (take(name).float() + cfg.norm_offset).to(device=device, dtype=dtype).contiguous()

        self.embed = w("model.embed_tokens.weight")
        self.norm = norm("model.norm.weight")
        self.lm_head = self.embed if cfg.tie_embeddings else w("lm_head.weight")
        specs = cfg.layer_specs()
        self.layers: list[LayerWeights] = []
        for i, spec in enumerate(specs):
            p = f"model.layers.{i}."
            att = p + "self_attn."
            bias = None
            if cfg.qkv_bias:
                bias = torch.cat([w(att + f"{x}_proj.bias") for x in "qkv"])
            qk_norm = None
            if cfg.qk_norm:
                qk_norm = torch.cat([norm(att + "q_norm.weight").expand(cfg.num_heads, -1),
                                     norm(att + "k_norm.weight").expand(cfg.num_kv_heads, -1)])
            # Gemma names its norms by place: post_attention_layernorm is on the attention output
            # there, where Llama's is the norm before the MLP
            sandwich = cfg.sandwich_norms
            self.layers.append(
                LayerWeights(
                    attn_norm=norm(p + "input_layernorm.weight"),
                    qkv=torch.cat([w(att + f"{x}_proj.weight") for x in "qkv"]),
                    qkv_bias=bias,
                    o_proj=w(att + "o_proj.weight"),
                    mlp_norm=norm(p + ("pre_feedforward_layernorm" if sandwich else "post_attention_layernorm")
                                  + ".weight"),
                    gate_up=torch.cat([w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")]),
                    down=w(p + "mlp.down_proj.weight"),
                    attn=AttnSpec(local=spec.window > 0, scale=cfg.attn_scale, softcap=cfg.attn_softcap),
                    rope=spec.rope,
                    qk_norm=qk_norm,
                    attn_out_norm=norm(p + "post_attention_layernorm.weight") if sandwich else None,
                    mlp_out_norm=norm(p + "post_feedforward_layernorm.weight") if sandwich else None,
                )
            )
        half = cfg.head_dim // 2
        freq_factors = weights.pop("rope_freqs", None)
        # longrope's long factors: rows [switch, switch + max_position) of each table, where the plan
        # points the positions of a request that reaches the switch (`build_plan`'s rope_switch)
        self.rope_switch = switch = cfg.long_rope_from
        self.cos: list[torch.Tensor] = []
        self.sin_signed: list[torch.Tensor] = []
        for ti, (theta, scaling) in enumerate(cfg.rope_tables()):
            # GGUF's rope_freqs divisors belong to the model's own table (0)
            table = partial(cos_sin_table, cfg.head_dim, theta, scaling, device=device, dtype=dtype,
                            freq_factors=freq_factors if ti == 0 else None)
            cos, sin = table(switch or cfg.max_position)
            if switch:
                cos_long, sin_long = table(cfg.max_position, long=True)
                cos, sin = torch.cat([cos, cos_long]), torch.cat([sin, sin_long])
            self.cos.append(cos)
            # rotate_half(x) * sin == flip-halves(x) * [-sin_lo, sin_hi]
            self.sin_signed.append(torch.cat([-sin[:, :half], sin[:, half:]], dim=-1))
        # multiplied in the weights' dtype, as transformers does
        self.embed_scale = None if cfg.embed_scale == 1.0 else torch.tensor(cfg.embed_scale, dtype=dtype)

    def weight_bytes(self) -> int:
        """Bytes of weights a decode step reads (each matrix once; tied embeddings count once)."""
        tensors = [self.embed, self.norm] + ([] if self.lm_head is self.embed else [self.lm_head])
        for lw in self.layers:
            tensors += [lw.attn_norm, lw.qkv, lw.o_proj, lw.mlp_norm, lw.gate_up, lw.down]
            tensors += [t for t in (lw.qkv_bias, lw.attn_out_norm, lw.mlp_out_norm) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)

    def forward(self, plan: BatchPlan, cache: KVCache,
                embeds: tuple[torch.Tensor, torch.Tensor] | None = None, *, compiled: bool = False) -> torch.Tensor:
        """Run all layers, write the new K/V, return float32 logits of `plan.output_rows` [M, vocab].
        `embeds`: (rows of the batch, their input vectors) in place of those rows' token embeddings.
        `compiled`: the layers' parts around attention through torch.compile (`hidden`)."""
        return self.logits(self.hidden(plan, cache, embeds, compiled=compiled))

    def forward_hidden(self, plan: BatchPlan, cache: KVCache,
                       embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward`, and the output rows' hidden states (after the final norm) [M, hidden]."""
        x = self.hidden(plan, cache, embeds)
        return self.logits(x), x

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Float32 logits of normed hidden states."""
        logits = F.linear(x, self.lm_head).float()
        if self.cfg.final_softcap is not None:
            logits = torch.tanh(logits / self.cfg.final_softcap) * self.cfg.final_softcap
        return logits

    def hidden(self, plan: BatchPlan, cache: KVCache,
               embeds: tuple[torch.Tensor, torch.Tensor] | None = None, *, compiled: bool = False) -> torch.Tensor:
        """Run all layers, write the new K/V, return the output rows' hidden states after the final norm.

        Each layer is `pre_attn` (norm, q|k|v, q/k norms, RoPE, the K/V write), attention (always
        eager), then `post_attn` (o_proj, residual, the MLP, residual). `compiled`: run the parts
        between attentions through `torch.compile`d functions (`compiled_parts`): one region from each
        attention to the next (this layer's `post_attn` + the next one's `pre_attn`), so inductor fuses
        the residual adds with the norms after them, RoPE with the q/k norms and the K/V write into the
        cache (in place), and SiLU with the up product. Only for the CUDA-graph decode buckets (`DecodeGraphs(compile_layers=
        True)`, which compiles in its warm-up): the batch dimension is marked dynamic (one compile for
        batch 1, one for the rest), unless `compile_static_batch` (one per batch size); a new model
        shape compiles again. Single rank only."""
        cfg = self.cfg
        x = self.embed[plan.tokens]
        if self.embed_scale is not None:
            x = x * self.embed_scale
        if embeds is not None:
            x = x.index_copy(0, embeds[0], embeds[1].to(x.dtype))
        cos = [c[plan.positions].unsqueeze(1) for c in self.cos]
        sin = [s[plan.positions].unsqueeze(1) for s in self.sin_signed]
        if compiled:
            return self._hidden_compiled(plan, cache, x, cos, sin)
        dims = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size, cfg.intermediate_size, cfg.rms_eps)
        reduce, act = self.reduce, self.act
        for li, lw in enumerate(self.layers):
            layer_cache = cache.data[li]
            q = pre_attn(x, lw.attn_norm, lw.qkv, lw.qkv_bias, lw.qk_norm, cos[lw.rope], sin[lw.rope], layer_cache,
                         plan.write_slots, dims)
            o = plan.attend(q, layer_cache, lw.attn)
            x = post_attn(x, o, lw.o_proj, lw.attn_out_norm, lw.mlp_norm, lw.gate_up, lw.down, lw.mlp_out_norm,
                          dims, act, reduce)
        return F.rms_norm(x[plan.output_rows], (cfg.hidden_size,), self.norm, cfg.rms_eps)

    def _hidden_compiled(self, plan: BatchPlan, cache: KVCache, x: torch.Tensor, cos: list[torch.Tensor],
                         sin: list[torch.Tensor]) -> torch.Tensor:
        if self.reduce is not None:
            raise RuntimeError("compiled layers run on a single rank (tensor parallel's all-reduce is eager)")
        cfg = self.cfg
        dims = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size, cfg.intermediate_size, cfg.rms_eps)
        act = self.cfg.activation
        first, between, last = compiled_parts()
        mark = (lambda t: t) if self.compile_static_batch else _dynamic_rows
        x, rows, slots = mark(x), mark(plan.output_rows), mark(plan.write_slots)
        cos, sin = [mark(c) for c in cos], [mark(c) for c in sin]
        lw = self.layers[0]
        q = first(x, lw.attn_norm, lw.qkv, lw.qkv_bias, lw.qk_norm, cos[lw.rope], sin[lw.rope], cache.data[0], slots,
                  dims)
        for li, lw in enumerate(self.layers):
            o = mark(plan.attend(q, cache.data[li], lw.attn))
            post = (lw.o_proj, lw.attn_out_norm, lw.mlp_norm, lw.gate_up, lw.down, lw.mlp_out_norm)
            if li + 1 < len(self.layers):
                nw = self.layers[li + 1]
                x, q = between(x, o, *post, nw.attn_norm, nw.qkv, nw.qkv_bias, nw.qk_norm, cos[nw.rope], sin[nw.rope],
                               cache.data[li + 1], slots, dims, act)
            else:
                x = last(x, o, *post, self.norm, rows, dims, act)
        return x


def _dynamic_rows(t: torch.Tensor) -> torch.Tensor:
    """`t` with its first (batch) dimension marked dynamic for torch.compile (a hint: dynamo may
    still specialize it, e.g. a batch of 1)."""
    torch._dynamo.maybe_mark_dynamic(t, 0)
    return t


Dims = tuple[int, int, int, int, int, float]  # heads, KV heads, head dim, hidden, intermediate, RMS eps


def pre_attn(x: torch.Tensor, attn_norm: torch.Tensor, qkv_w: torch.Tensor, qkv_bias: torch.Tensor | None,
             qk_norm: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, layer_cache: torch.Tensor,
             write_slots: torch.Tensor, dims: Dims) -> torch.Tensor:
    """A layer's work before attention: its input norm, q|k|v, q/k norms, RoPE, and the new K/V
    written into `layer_cache` [slots, 2, KVH, D] at `write_slots` (in place). Returns the queries
    [N, H, D]."""
    h, kvh, d, hid, _, eps = dims
    n = x.shape[0]
    y = F.rms_norm(x, (hid,), attn_norm, eps)
    qkv = F.linear(y, qkv_w, qkv_bias).view(n, h + 2 * kvh, d)
    qk = qkv[:, : h + kvh]
    if qk_norm is not None:
        qk = F.rms_norm(qk, (d,), None, eps) * qk_norm
    qk = qk * cos + qk.view(n, h + kvh, 2, d // 2).flip(2).view(n, h + kvh, d) * sin
    kv_new = torch.cat([qk[:, h:], qkv[:, h + kvh :]], dim=1).view(n, 2, kvh, d)
    layer_cache.index_copy_(0, write_slots, kv_new)
    return qk[:, :h]


def post_attn(x: torch.Tensor, attn_out: torch.Tensor, o_proj: torch.Tensor, attn_out_norm: torch.Tensor | None,
              mlp_norm: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, mlp_out_norm: torch.Tensor | None,
              dims: Dims, act: Callable[[torch.Tensor], torch.Tensor],
              reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """A layer's work after attention: o_proj, the residual, the MLP (gate|up, act * up, down), the
    residual; `reduce` sums the row-parallel matmuls' partial outputs across ranks (tensor parallel)."""
    _, _, _, hid, inter, eps = dims
    o = F.linear(attn_out, o_proj)
    o = o if reduce is None else reduce(o)
    x = x + (o if attn_out_norm is None else F.rms_norm(o, (hid,), attn_out_norm, eps))
    y = F.rms_norm(x, (hid,), mlp_norm, eps)
    gu = F.linear(y, gate_up)
    o = F.linear(act(gu[:, :inter]) * gu[:, inter:], down)
    o = o if reduce is None else reduce(o)
    return x + (o if mlp_out_norm is None else F.rms_norm(o, (hid,), mlp_out_norm, eps))


def _between(x: torch.Tensor, attn_out: torch.Tensor, o_proj: torch.Tensor, attn_out_norm: torch.Tensor | None,
             mlp_norm: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, mlp_out_norm: torch.Tensor | None,
             attn_norm: torch.Tensor, qkv_w: torch.Tensor, qkv_bias: torch.Tensor | None,
             qk_norm: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, layer_cache: torch.Tensor,
             write_slots: torch.Tensor, dims: Dims, act: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's `post_attn` and the next one's `pre_attn` (its K/V written): (x, q)."""
    x = post_attn(x, attn_out, o_proj, attn_out_norm, mlp_norm, gate_up, down, mlp_out_norm, dims,
                  ACTIVATION_FNS[act])
    return x, pre_attn(x, attn_norm, qkv_w, qkv_bias, qk_norm, cos, sin, layer_cache, write_slots, dims)


def _last(x: torch.Tensor, attn_out: torch.Tensor, o_proj: torch.Tensor, attn_out_norm: torch.Tensor | None,
          mlp_norm: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, mlp_out_norm: torch.Tensor | None,
          norm: torch.Tensor, rows: torch.Tensor, dims: Dims, act: str) -> torch.Tensor:
    """The last layer's `post_attn` and the final norm of the output rows."""
    x = post_attn(x, attn_out, o_proj, attn_out_norm, mlp_norm, gate_up, down, mlp_out_norm, dims,
                  ACTIVATION_FNS[act])
    return F.rms_norm(x[rows], (dims[3],), norm, dims[5])


CompiledParts = tuple[Callable[..., torch.Tensor], Callable[..., tuple[torch.Tensor, torch.Tensor]],
                      Callable[..., torch.Tensor]]
_compiled: CompiledParts | None = None
# recompiles a compiled function may take before dynamo gives up on it (runs it eagerly): each batch
# bucket of each model shape is one (9 buckets x the kit's 4 shapes), layers share theirs
RECOMPILE_LIMIT = 64


def compiled_parts() -> CompiledParts:
    """`pre_attn` (the first layer's), `_between` and `_last` through `torch.compile` (inductor, one
    graph each, no inductor CUDA graphs: the decode graphs capture them), made once
    per process. Weights are arguments, so every layer of every model of one shape shares the
    compiled kernels; their shapes are static (`dynamic=False`: weights never become dynamic), the
    batch dimension dynamic where the caller marks it (`LlamaModel.compile_static_batch`). Dynamo's
    recompile limit is raised to `RECOMPILE_LIMIT` for the bucket shapes of several models."""
    global _compiled
    if _compiled is None:
        import torch._dynamo

        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)

        def comp(fn: Callable[..., object]) -> Callable[..., object]:
            return torch.compile(fn, fullgraph=True, dynamic=False)

        _compiled = (comp(pre_attn), comp(_between), comp(_last))  # type: ignore[assignment]
    assert _compiled is not None
    return _compiled
