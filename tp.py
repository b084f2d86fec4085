"""Tensor parallelism over the GPUs of one host: which slice of the model each rank holds, the
collectives that join the slices, and the messages that keep every rank's engine in step.

Run under torchrun, one process per GPU: `torchrun --nproc-per-node 2 engine.py generate --tp 2 ...`.

The split is Megatron's, applied by swapping modules of a Transformer that is still on the meta
device, so no rank ever allocates (or reads, see loading.py) more than its slice:
- q|k|v, gate|up and opt's fc1 are column-parallel: a rank holds the rows of its query heads,
  its KV heads and its share of the MLP's hidden units. Attention then needs no traffic: a
  rank's query heads read only its own KV heads, and its KV cache holds only those.
- o and down (opt's fc2) are row-parallel: each rank multiplies its columns, and one all-reduce
  per projection sums the partial outputs (the bias is added once, after the sum).
- The LM head is vocab-parallel: each rank computes the logits of a slice of the vocabulary and
  an all-gather joins them. A decode step reads the whole head, so splitting it halves the
  largest single read of an 8B model at tp 2.
- The embedding is replicated: a step reads one row per token, so splitting it would save
  memory but no time, and cost an all-reduce. Tied heads (small models) stay replicated with it.

Scheduling: rank 0 runs the scheduler of llm.py and the others follow. Before each step rank 0
broadcasts one small message over gloo on the host: what happened since the last step (requests
added or cancelled) and what to run next. Every rank then runs the same step on its slice; the
greedy tokens come out of the same gathered logits on every rank, so they agree without a word,
and sampled tokens are broadcast from rank 0. A rank that dies closes its sockets, and the others
fail at their next message with an error that says so, instead of hanging.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

import kernels
from model import FusedLinear, Linear, ModelConfig, Transformer

# A follower waits for rank 0's next message for as long as a server sits idle; a rank that dies
# is noticed at once all the same (gloo sees its socket close). Collectives on the GPU get a
# bound: NCCL's watchdog then turns a hang into an error.
CONTROL_TIMEOUT = timedelta(days=30)
COLLECTIVE_TIMEOUT = timedelta(minutes=10)
_FIRST_CHUNK = 8192  # bytes a step's message broadcast carries; a longer one (a prompt) takes a second


# torch 2.13 renamed all_gather_into_tensor (the GPU image's torch 2.11 has only the old name)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class RankLost(RuntimeError):
    """Another rank of the tensor-parallel group died."""


@dataclass(eq=False)
class Group:
    """This process's place in a tensor-parallel group."""

    rank: int
    size: int
    device: torch.device
    collectives: dist.ProcessGroup  # NCCL on GPUs, gloo on CPU
    control: dist.ProcessGroup  # gloo on the host: rank 0's messages

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks, in place."""
        self._call(dist.all_reduce, x, group=self.collectives)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' x side by side along the last dimension, on every rank."""
        parts = torch.empty((self.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        self._call(_all_gather, parts, x.contiguous(), group=self.collectives)  # the ranks' x, stacked along dim 0
        return parts.unflatten(0, (self.size, x.shape[0])).movedim(0, -2).flatten(-2)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x, on every rank."""
        self._call(dist.broadcast, x, 0, group=self.collectives)
        return x

    def smallest(self, n: int) -> int:
        """The smallest n of all ranks (each sizes its cache from its own free memory; all must agree)."""
        t = torch.tensor([n], dtype=torch.long)
        self._call(dist.all_reduce, t, op=dist.ReduceOp.MIN, group=self.control)
        return int(t)

    def barrier(self) -> None:
        """Wait until every rank is here. A rank must not exit while another is still finishing
        the last message: gloo then sometimes aborts a process at exit (torch 2.13)."""
        self._call(dist.barrier, group=self.control)

    def send(self, message: dict) -> None:
        """Rank 0: broadcast a JSON message to the followers (one broadcast if it is short)."""
        data = json.dumps(message, separators=(",", ":")).encode()
        first = torch.zeros(_FIRST_CHUNK, dtype=torch.uint8)
        first[:8] = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8)
        head = data[: _FIRST_CHUNK - 8]
        first[8:8 + len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
        self._call(dist.broadcast, first, 0, group=self.control)
        if len(data) > len(head):
            self._call(dist.broadcast, torch.frombuffer(bytearray(data[len(head):]), dtype=torch.uint8), 0, group=self.control)

    def receive(self) -> dict:
        """A follower: rank 0's next message."""
        first = torch.empty(_FIRST_CHUNK, dtype=torch.uint8)
        self._call(dist.broadcast, first, 0, group=self.control)
        length = int(first[:8].view(torch.int64))
        data = first[8:8 + min(length, _FIRST_CHUNK - 8)].numpy().tobytes()
        if length > len(data):
            rest = torch.empty(length - len(data), dtype=torch.uint8)
            self._call(dist.broadcast, rest, 0, group=self.control)
            data += rest.numpy().tobytes()
        return json.loads(data)

    def _call(self, collective, *args, **kwargs) -> None:
        """A collective, whose failure (a peer's socket closed, on gloo) names what happened. On
        GPUs NCCL reports nothing here: a dead peer is seen at rank 0's next message, or by
        NCCL's watchdog after COLLECTIVE_TIMEOUT, and torchrun takes the group down."""
        try:
            collective(*args, **kwargs)
        except RuntimeError as e:
            raise RankLost(f"tensor parallel: another rank is gone, so rank {self.rank} stops too ({e})") from e


_group: Group | None = None


def init(size: int, device: torch.device) -> Group:
    """Join (once per process) the group of `size` processes that torchrun started; device "cuda"
    becomes this process's GPU (LOCAL_RANK)."""
    global _group
    if _group is not None:
        if _group.size != size:
            raise ValueError(f"this process is already in a tensor-parallel group of {_group.size}, not {size}")
        return _group
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != size or "RANK" not in os.environ:
        raise ValueError(
            f"--tp {size} runs one process per GPU: start it as `torchrun --nproc-per-node {size} engine.py ... "
            f"--tp {size}` (this run has {world} process{'es' if world > 1 else ''})"
        )
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
    if device.type == "cuda":
        if torch.cuda.device_count() <= local_rank:
            raise ValueError(f"--tp {size}: rank {rank} needs GPU {local_rank}, but this machine has "
                             f"{torch.cuda.device_count()}")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if device.type == "cuda":
        if not dist.is_initialized():
            dist.init_process_group("nccl", rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT)
        control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    else:  # gloo carries both in one group: with a second gloo group, processes sometimes abort at exit
        if not dist.is_initialized():
            dist.init_process_group("gloo", rank=rank, world_size=size, timeout=CONTROL_TIMEOUT)
        control = dist.group.WORLD
    _group = Group(rank, size, device, dist.group.WORLD, control)
    return _group


def check_divisible(config: ModelConfig, size: int) -> None:
    """Refuse a split that does not give every rank whole KV heads (and their query heads and an
    equal share of the MLP), naming the sizes that do."""
    def fits(n: int) -> bool:
        return config.n_kv_heads % n == 0 and config.n_heads % n == 0 and config.ffn_dim % n == 0

    if not fits(size):
        allowed = [n for n in range(1, config.n_kv_heads + 1) if fits(n)]
        raise ValueError(
            f"--tp {size} does not divide this model: it has {config.n_kv_heads} KV heads, {config.n_heads} query "
            f"heads and {config.ffn_dim} MLP units, and each rank needs an equal whole share; use --tp "
            f"{' or '.join(map(str, allowed))}"
        )


def shard(model: Transformer, group: Group) -> Transformer:
    """Swap the model's modules for this rank's slices (on the meta device, before any memory is
    allocated; loading.py fills them from the checkpoint's matching slices). Returns the model,
    which remembers its group."""
    config, n = model.config, group.size
    check_divisible(config, n)
    with torch.device("meta"):
        for block in model.layers:
            attn, mlp = block.attn, block.mlp
            attn.n_heads //= n
            attn.n_kv_heads //= n
            attn.qkv_proj = _columns(attn.qkv_proj, n)
            attn.o_proj = RowParallelLinear.of(attn.o_proj, group)
            if mlp.gated:
                mlp.gate_up_proj = _columns(mlp.gate_up_proj, n)
                mlp.down_proj = RowParallelLinear.of(mlp.down_proj, group)
            else:
                mlp.fc1 = _columns(mlp.fc1, n)
                mlp.fc2 = RowParallelLinear.of(mlp.fc2, group)
        if not config.tie_embeddings:
            model.lm_head = VocabParallelLinear(model.lm_head, group)
    model.tp = group
    return model


def _columns(linear: Linear, n: int) -> Linear:
    """This rank's output rows of a column-parallel projection (of each part of a fused one)."""
    bias, dtype = linear.bias is not None, linear.weight.dtype
    if isinstance(linear, FusedLinear):
        return FusedLinear(linear.in_features, {part: rows // n for part, rows in linear.parts.items()}, bias).to(dtype)
    return Linear(linear.in_features, linear.out_features // n, bias=bias).to(dtype)


class RowParallelLinear(Linear):
    """This rank's input columns of a projection: the partial products of all ranks are summed
    by one all-reduce, then the (whole, replicated) bias is added once."""

    @classmethod
    def of(cls, linear: Linear, group: Group) -> RowParallelLinear:
        new = cls(linear.in_features // group.size, linear.out_features, bias=linear.bias is not None).to(linear.weight.dtype)
        new.group = group
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.group.all_reduce(kernels.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabParallelLinear(Linear):
    """This rank's slice of the LM head's rows: ceil(V / ranks) of them, the last rank's padded
    with zero rows; the gathered logits are cut back to V."""

    def __init__(self, head: Linear, group: Group):
        super().__init__(head.in_features, -(-head.out_features // group.size), bias=False)
        self.to(head.weight.dtype)
        self.vocab_size, self.group = head.out_features, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.gather_last_dim(kernels.linear(x, self.weight))[..., : self.vocab_size]
