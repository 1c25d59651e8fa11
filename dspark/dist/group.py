"""A process group of one engine's ranks, held as an object (no torch.distributed default group, so
several engines, or a test and an engine, can live in one process), and the few collectives
tensor parallelism needs."""

from __future__ import annotations

import datetime
import json
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

TIMEOUT = datetime.timedelta(seconds=120)  # a collective a dead peer leaves hanging fails after this


class PeerLost(RuntimeError):
    """A rank of the group died or stopped answering: the engine cannot go on."""


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Group:
    """rank of world, joined through a TCP store on 127.0.0.1:port."""

    rank: int
    world: int
    pg: object  # the tensor collectives: ProcessGroupGloo on CPU, ProcessGroupNCCL on CUDA
    ctrl: object  # the step messages (CPU tensors): always gloo
    store: object  # keeps the TCPStore (rank 0's server) alive as long as the group

    @classmethod
    def join(cls, rank: int, world: int, port: int, device: torch.device | None = None) -> Group:
        store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=TIMEOUT)
        ctrl = dist.ProcessGroupGloo(dist.PrefixStore("ctrl", store), rank, world, TIMEOUT)
        pg = ctrl
        if device is not None and device.type == "cuda":
            # NCCL moves the activations GPU to GPU; it cannot carry the CPU step messages
            pg = dist.ProcessGroupNCCL(dist.PrefixStore("nccl", store), rank, world)
        return cls(rank, world, pg, ctrl, store)

    def _wait(self, work) -> None:  # noqa: ANN001 - a c10d Work
        try:
            work.wait()
        except RuntimeError as e:  # gloo: connection closed by peer, or the timeout above
            raise PeerLost(f"tensor-parallel rank lost: {e}") from None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of x over the ranks, in place."""
        self._wait(self.pg.allreduce([x]))
        return x

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's x (all the same shape), in rank order."""
        out = [torch.empty_like(x) for _ in range(self.world)]
        self._wait(self.pg.allgather([out], [x.contiguous()]))
        return out

    def broadcast(self, header: dict | None = None, tensors: list[torch.Tensor] | None = None) -> tuple[dict, list]:
        """Rank 0's (header, tensors) on every rank: a JSON-able dict and CPU tensors, sent as a
        JSON header (with the tensors' shapes and dtypes) and then each tensor. Nothing is pickled."""
        if self.rank == 0:
            tensors = [t.contiguous() for t in tensors or []]
            shapes = [[list(t.shape), str(t.dtype).removeprefix("torch.")] for t in tensors]
            meta = {"header": header, "tensors": shapes}
            data = torch.frombuffer(bytearray(json.dumps(meta).encode()), dtype=torch.uint8)
            size = torch.tensor([data.numel()], dtype=torch.long)
        else:
            size = torch.zeros(1, dtype=torch.long)
        self._wait(self.ctrl.broadcast(size, 0))
        if self.rank != 0:
            data = torch.empty(int(size), dtype=torch.uint8)
        self._wait(self.ctrl.broadcast(data, 0))
        if self.rank != 0:
            meta = json.loads(data.numpy().tobytes().decode())
            header = meta["header"]
            tensors = [torch.empty(shape, dtype=getattr(torch, dt)) for shape, dt in meta["tensors"]]
        for t in tensors:
            self._wait(self.ctrl.broadcast(t, 0))
        return header, tensors
