"""Tensor parallelism's primitives: heads and experts split across ranks, sums completed by all-reduce.

- `TPGroup` is what the model is built with: this rank, the world size and the process group. At world size 1
  `all_reduce` is the identity, so the single-process model is the TP model with one rank.
- `Split` says how a full (checkpoint) tensor is cut: along one dim, each of its segments evenly (a fused q|k|v
  weight is cut per segment so every rank keeps whole heads of each).
- The processes (rank 0's `LeaderModel` and the ranks it drives) are `tandem/engine/tensor_parallel.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Split:
    """Cut `dim` of a full tensor into world-size equal parts, within each of `segments` (their full sizes;
    None: the dim is one segment)."""

    dim: int
    segments: tuple[int, ...] | None = None

    def ranges(self, full_size: int, rank: int, world: int) -> list[tuple[int, int]]:
        """The [start, end) ranges of the full dim that `rank` keeps, in order."""
        out, offset = [], 0
        for size in self.segments or (full_size,):
            part = size // world
            out.append((offset + rank * part, offset + (rank + 1) * part))
            offset += size
        return out

    def cut(self, full: torch.Tensor, world: int) -> list[torch.Tensor]:
        """Every rank's part of `full`, in rank order (each what `TPGroup.shard` keeps on that rank)."""
        return [full] if world == 1 else [TPGroup(r, world).shard(full, self) for r in range(world)]

    def join(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every rank's part (rank order): the inverse of `cut`."""
        if len(parts) == 1:
            return parts[0]
        if self.segments is None:
            return torch.cat(parts, self.dim)
        pieces = [p.split([size // len(parts) for size in self.segments], self.dim) for p in parts]
        return torch.cat([piece[i] for i in range(len(self.segments)) for piece in pieces], self.dim)


def _by_dtype(tensors: list[torch.Tensor]) -> list[list[int]]:
    """Indices of `tensors` grouped by dtype (in a fixed order): each group travels as one flat buffer."""
    groups: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(i)
    return [groups[dt] for dt in sorted(groups, key=str)]


def _pack(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _unpack(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    return [v.view(t.shape) for v, t in zip(flat.split([t.numel() for t in like]), like)]


@dataclass(frozen=True, eq=False)
class TPGroup:
    rank: int = 0
    world_size: int = 1
    group: object = None  # a torch.distributed ProcessGroup; None at world size 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums x over the ranks in place (every rank gets the same bits); identity on one rank."""
        if self.world_size > 1:
            self.group.allreduce([x]).wait()
        return x

    def part(self, n: int, what: str) -> int:
        """This rank's share of n heads / experts / channels."""
        if n % self.world_size:
            raise ValueError(f"tensor_parallel_size {self.world_size} does not divide {what} ({n})")
        return n // self.world_size

    def shard(self, full: torch.Tensor, split: Split) -> torch.Tensor:
        parts = [full.narrow(split.dim, a, b - a) for a, b in split.ranges(full.shape[split.dim], self.rank,
                                                                          self.world_size)]
        return parts[0] if len(parts) == 1 else torch.cat(parts, split.dim)

    def gather(self, local: list[torch.Tensor]) -> list[list[torch.Tensor]] | None:
        """Every rank calls it with its tensors (the same shapes and dtypes on every rank): rank 0 gets, per
        tensor, every rank's one in rank order; the other ranks None. One collective per dtype."""
        if self.world_size == 1:
            return [[t] for t in local]
        out = [[None] * self.world_size for _ in local]
        for idx in _by_dtype(local):
            flat = _pack([local[i] for i in idx])
            parts = [torch.empty_like(flat) for _ in range(self.world_size)] if self.rank == 0 else []
            self.group.gather(parts, flat, 0).wait()
            for r, part in enumerate(parts):
                for i, t in zip(idx, _unpack(part, [local[i] for i in idx])):
                    out[i][r] = t
        return out if self.rank == 0 else None

    def scatter(self, parts: list[list[torch.Tensor]] | None, like: list[torch.Tensor] | None) -> list[torch.Tensor]:
        """The inverse of `gather`: rank 0 calls it with, per tensor, every rank's one in rank order, the other
        ranks with None; each rank gets its own. `like`: this rank's tensors of those shapes, dtypes and device
        (their contents are not read; not needed on one rank)."""
        if self.world_size == 1:
            return [p[0] for p in parts]
        out = [None] * len(like)
        for idx in _by_dtype(like):
            flat = torch.empty(sum(like[i].numel() for i in idx), dtype=like[idx[0]].dtype, device=like[idx[0]].device)
            sent = [_pack([parts[i][r].to(flat.device) for i in idx]) for r in range(self.world_size)] \
                if self.rank == 0 else []
            self.group.scatter(flat, sent, 0).wait()
            for i, t in zip(idx, _unpack(flat, [like[i] for i in idx])):
                out[i] = t
        return out


SINGLE = TPGroup()


def check_divisible(cfg, world_size: int) -> None:
    """Raises ValueError naming every size of `cfg` that `world_size` ranks cannot split evenly."""
    if world_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {world_size}")
    sizes = {"num_key_value_heads": cfg.num_kv_heads, "linear_num_key_heads": cfg.gdn_num_k_heads}
    if not all(cfg.moe_layers):
        sizes["intermediate_size"] = cfg.intermediate_size
    if any(cfg.moe_layers):
        sizes.update(num_experts=cfg.num_experts, shared_expert_intermediate_size=cfg.shared_expert_intermediate_size)
    bad = [f"{k} ({v})" for k, v in sizes.items() if v % world_size]
    if bad:
        # query heads and value heads are multiples of the KV / key heads, so they follow
        raise ValueError(f"tensor_parallel_size {world_size} does not divide " + ", ".join(bad))


def rank_device(device: str, rank: int) -> str:
    """Rank r's device: the r-th GPU from `device` ("cuda" is "cuda:0"; a serving worker on "cuda:2" with two
    ranks uses cuda:2 and cuda:3), or the CPU."""
    if not device.startswith("cuda"):
        return device
    first = int(device.partition(":")[2] or 0)
    return f"cuda:{first + rank}"


def process_group(store, rank: int, world: int, device: str, timeout: float):
    td = timedelta(seconds=timeout)
    if device.startswith("cuda"):
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = td
        return dist.ProcessGroupNCCL(store, rank, world, opts)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = td
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return dist.ProcessGroupGloo(store, rank, world, opts)
