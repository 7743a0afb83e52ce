"""Tensor parallel over `torch.distributed`: each rank holds a shard of every layer and of every KV page.

Megatron-style sharding of the Llama block, as vLLM and SGLang do it:
- attention: the KV heads are split into `world` contiguous groups, one per rank, and each rank
  takes the query heads that read its KV heads (the q|k|v rows of `qkv`, column-parallel) and the
  matching input columns of `o_proj` (row-parallel);
- MLP: the `gate` and `up` rows are split (column-parallel), `down`'s input columns with them
  (row-parallel);
- one all-reduce (sum) after each row-parallel matmul (`o_proj`, `down`), so every rank holds the
  full hidden state again; embeddings, norms and the LM head are replicated (every rank computes
  the same logits; rank 0 samples);
- the KV cache of a rank holds only its KV heads: each rank holds its shard of every page.

The split does not need the head counts to divide by `world`: a rank may hold one KV head more
than another (SmolLM2-135M has 3 KV heads: with `--tp 2` rank 0 holds 2 and 6 query heads, rank
1 holds 1 and 3). The sums are the same sums in another order, so logits agree with one rank's
up to float rounding. A rank needs at least one KV head: `world` <= the model's KV heads.

Rank 0 receives each batch (from the host, through the engine process) and broadcasts it, as
msgpack bytes on a gloo group, to the other ranks, which build the same batch plan and run the
same layers; `TPWorker.serve` is their loop.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gpu_backend.backend import TorchBackend
from gpu_backend.engine.wire import decode_requests, encode_requests, pack, unpack
from gpu_backend.models.config import ModelConfig
from gpu_backend.types import ForwardRequest

__all__ = ["TPBackend", "TPContext", "TPWorker", "init_tp", "shard_config", "shard_weights", "split"]

log = logging.getLogger(__name__)

# collectives wait this long; rank 0 broadcasts a ping when idle for IDLE_PING_S, so an idle host
# never lets the others' waits run out
COLLECTIVE_TIMEOUT = timedelta(hours=1)
IDLE_PING_S = 60.0


def split(n: int, world: int) -> list[tuple[int, int]]:
    """`n` items in `world` contiguous (start, count) parts; the first `n % world` parts get one more."""
    base, extra = divmod(n, world)
    out, start = [], 0
    for r in range(world):
        c = base + (1 if r < extra else 0)
        out.append((start, c))
        start += c
    return out


def check_shardable(cfg: ModelConfig, world: int) -> None:
    """Raise ValueError unless `cfg` can run on `world` tensor-parallel ranks."""
    if world < 1:
        raise ValueError(f"tp must be >= 1, got {world}")
    if cfg.num_kv_heads < world:
        raise ValueError(
            f"tp={world}: the model has {cfg.num_kv_heads} KV heads and each rank needs at least one "
            f"(replicating KV heads across ranks is not supported); use tp <= {cfg.num_kv_heads}")
    if cfg.intermediate_size < world:
        raise ValueError(f"tp={world}: the MLP has only {cfg.intermediate_size} columns")


def shard_config(cfg: ModelConfig, rank: int, world: int) -> ModelConfig:
    """The architecture rank `rank` runs: its share of the heads and of the MLP columns."""
    check_shardable(cfg, world)
    group = cfg.num_heads // cfg.num_kv_heads
    kv = split(cfg.num_kv_heads, world)[rank][1]
    inter = split(cfg.intermediate_size, world)[rank][1]
    return replace(cfg, num_heads=kv * group, num_kv_heads=kv, intermediate_size=inter)


def shard_weights(cfg: ModelConfig, weights: dict[str, torch.Tensor], rank: int,
                  world: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s slices of the weights (HF names, full `cfg`); replicated tensors pass through."""
    check_shardable(cfg, world)
    d, group = cfg.head_dim, cfg.num_heads // cfg.num_kv_heads
    kv0, kvn = split(cfg.num_kv_heads, world)[rank]
    q_rows = slice(kv0 * group * d, (kv0 + kvn) * group * d)
    kv_rows = slice(kv0 * d, (kv0 + kvn) * d)
    i0, i_n = split(cfg.intermediate_size, world)[rank]
    m_rows = slice(i0, i0 + i_n)
    out: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        if ".self_attn.q_proj." in name:
            out[name] = w[q_rows]
        elif ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
            out[name] = w[kv_rows]
        elif name.endswith(".self_attn.o_proj.weight"):
            out[name] = w[:, q_rows]
        elif ".mlp.gate_proj." in name or ".mlp.up_proj." in name:
            out[name] = w[m_rows]
        elif name.endswith(".mlp.down_proj.weight"):
            out[name] = w[:, m_rows]
        else:
            out[name] = w
    return out


@dataclass
class TPContext:
    """This process's place in a tensor-parallel group.

    `group`: the group the all-reduces run on (NCCL on GPUs, gloo on CPU); `ctl`: a gloo group
    for the control messages (the batch broadcast), which must travel through host memory.
    """

    rank: int
    world: int
    group: Any = None
    ctl: Any = None

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, group=self.group)
        return t

    def shard(self, cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
        """This rank's share of the model (`gpu_backend.backend.Sharding`)."""
        return shard_config(cfg, self.rank, self.world), shard_weights(cfg, weights, self.rank, self.world)

    def wrap(self, backend: TorchBackend) -> TorchBackend:
        """Rank 0's backend broadcasts each pass to the other ranks first (`TPBackend`); theirs is plain
        (`TPWorker` runs what rank 0 sends)."""
        if self.rank != 0:
            return backend
        b = backend
        tb = TPBackend(b.model, b.tokenizer, b.info, b.cache, b.attention, b.graphs)
        tb.tp = self
        return tb

    def send(self, msg: Any) -> None:
        """Rank 0: broadcast one control message to the other ranks."""
        data = pack(msg)
        n = torch.tensor([len(data)], dtype=torch.int64)
        dist.broadcast(n, src=0, group=self.ctl)
        dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), src=0, group=self.ctl)

    def recv(self) -> Any:
        """The other ranks: the next control message from rank 0."""
        n = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(n, src=0, group=self.ctl)
        buf = torch.empty(int(n.item()), dtype=torch.uint8)
        dist.broadcast(buf, src=0, group=self.ctl)
        return unpack(buf.numpy().tobytes())


def init_tp(rank: int, world: int, init_method: str, device_type: str) -> TPContext:
    """Join the process group (gloo on CPU, NCCL on CUDA) and make the gloo control group."""
    backend = "nccl" if device_type == "cuda" else "gloo"
    kwargs: dict[str, Any] = {}
    if backend == "nccl":
        kwargs["device_id"] = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=COLLECTIVE_TIMEOUT, **kwargs)
    ctl = dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT) if backend != "gloo" else dist.group.WORLD
    log.info("rank %d/%d joined (%s)", rank, world, backend)
    return TPContext(rank=rank, world=world, group=dist.group.WORLD, ctl=ctl)


class TPBackend(TorchBackend):
    """Rank 0 of a tensor-parallel group: a `TorchBackend` over its shard that broadcasts each pass
    (and each KV copy) to the other ranks before running its own share of it."""

    tp: TPContext

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.feeds = False

    def _pass(self, reqs: list[ForwardRequest], patch: Any = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        if patch is not None:  # the other ranks would run the placeholder tokens
            raise ValueError("start_forward's feed is not supported with tensor parallel")
        self.tp.send(["pass", encode_requests(reqs)])  # (input embeddings included)
        return super()._pass(reqs)

    def copy_tokens(self, src_page: int, src_offset: int, dst_page: int, dst_offset: int, count: int) -> None:
        super().copy_tokens(src_page, src_offset, dst_page, dst_offset, count)  # validates first
        if count:
            self.tp.send(["copy", [src_page, src_offset, dst_page, dst_offset, count]])

    def ping(self) -> None:
        with self._lock:
            self.tp.send(["ping"])

    def stop_workers(self) -> None:
        with self._lock:
            self.tp.send(["stop"])


class TPWorker:
    """Ranks 1..N-1: run every pass rank 0 broadcasts, on this rank's shard, until told to stop."""

    def __init__(self, backend: TorchBackend, tp: TPContext) -> None:
        self.backend, self.tp = backend, tp

    def serve(self) -> None:
        b = self.backend
        while True:
            msg = self.tp.recv()
            op = msg[0]
            if op == "stop":
                return
            if op == "ping":
                continue
            with torch.inference_mode():
                if op == "pass":
                    reqs: Sequence[ForwardRequest] = decode_requests(msg[1])
                    b.model.forward(b.plan(list(reqs)), b.cache, b._embeds(list(reqs)))
                elif op == "copy":
                    s, so, d, do, n = msg[1]
                    TorchBackend.copy_tokens(b, s, so, d, do, n)
                else:
                    raise RuntimeError(f"rank {self.tp.rank}: unknown control message {op!r}")


def env_rank() -> tuple[int, int, int] | None:
    """(rank, world, local rank) from torchrun's environment, or None when not launched by it."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return rank, world, int(os.environ.get("LOCAL_RANK", rank))
