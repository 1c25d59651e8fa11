"""Tensor-parallel worker processes: rank 0 (the engine) spawns ranks 1..N-1 with
torch.multiprocessing (on CUDA, rank r uses GPU r), each loads its shard and KV heads, then
mirrors every call rank 0 makes on its model: a forward (a StepInput), LM-head logits of some
rows, or a K/V slot copy. Rank 0 schedules, samples and drafts; the workers only compute.

A worker that dies makes rank 0's next collective fail (gloo closes its connections), and rank 0
checks the processes before each call too: either way the engine raises PeerLost and the server
answers 503 and exits, never hanging or answering from a partial model. A normal end (close(),
the engine dropped, the interpreter exiting) sends the workers a "stop" and joins them: silent.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import weakref
from dataclasses import dataclass

import torch

from dspark.dist.group import Group, PeerLost, free_port
from dspark.dist.tensor_parallel import build_shard, local_config
from dspark.models.llama import LlamaConfig
from dspark.models.loader import load_config

log = logging.getLogger(__name__)


@dataclass
class ShardSpec:
    """What a rank needs to build its part of the engine (plain data: it crosses a process spawn)."""

    folder: str  # the target's HF folder (a GGUF is converted to one before the workers start)
    dtype: str
    device: str
    kv_pages: int
    page_size: int
    attention_backend: str
    threads: int


def build_rank(spec: ShardSpec, group: Group):  # noqa: ANN201 - (model, kv, attn)
    """The model shard, its KV cache (this rank's KV heads) and an attention backend."""
    from dspark.engine.attention import make_backend
    from dspark.engine.kv_cache import KVCache

    device, dtype = torch.device(spec.device), getattr(torch, spec.dtype)
    c = LlamaConfig.from_hf(load_config(spec.folder))
    model = build_shard(spec.folder, c, group, device, dtype)
    lc = local_config(c, group.world)
    kv = KVCache(c.num_hidden_layers, spec.kv_pages, spec.page_size, lc.num_key_value_heads, c.head_dim,
                 dtype, device)
    return model, kv, make_backend(spec.attention_backend, device)


def rank_device(device: str, rank: int) -> torch.device:
    """Rank r's device: the CPU, or GPU r (one GPU per rank)."""
    d = torch.device(device)
    return torch.device("cuda", rank) if d.type == "cuda" else d


def _worker_main(rank: int, world: int, port: int, spec: ShardSpec) -> None:
    from dspark.engine.model_runner import copy_slots
    from dspark.engine.step_input import StepInput, run_step

    torch.set_num_threads(spec.threads)
    device = rank_device(spec.device, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    spec = dataclasses.replace(spec, device=str(device))
    group = Group.join(rank, world, port, device)
    model, kv, attn = build_rank(spec, group)
    with torch.inference_mode():
        while True:
            header, tensors = group.broadcast()
            op = header["op"]
            if op == "stop":
                return
            if op == "forward":
                run_step(model, kv, attn, StepInput.from_message(header, tensors, device))
            elif op == "logits":
                model.logits(tensors[0].to(device))
            elif op == "copy":
                copy_slots(kv, tensors[0].to(device), tensors[1].to(device))


class Workers:
    """Rank 0's handle on ranks 1..N-1: start them, send each call, watch them, stop them.

    The workers are stopped (a "stop" message, then joined) by close(), and also when this handle
    is garbage-collected or the interpreter exits without close(): dropping the engine used to
    destroy rank 0's gloo groups under workers waiting for their next call, which they took for a
    lost peer and printed PeerLost tracebacks about."""

    def __init__(self, spec: ShardSpec, world: int):
        self.world = world
        port = free_port()
        ctx = mp.get_context("spawn")  # fork would copy the engine's threads and locks
        self.procs = [ctx.Process(target=_worker_main, args=(r, world, port, spec), daemon=True,
                                  name=f"dspark-tp-{r}") for r in range(1, world)]
        for p in self.procs:
            p.start()
        try:
            self.group = Group.join(0, world, port, torch.device(spec.device))
        except BaseException:
            _stop(self.procs, None)
            raise
        # holds the group (not self), so its connections stay open until the stop message is out
        self._finalizer = weakref.finalize(self, _stop, self.procs, self.group)

    def check(self) -> None:
        """PeerLost when a worker process has exited."""
        dead = [p for p in self.procs if not p.is_alive()]
        if dead:
            raise PeerLost(f"tensor-parallel worker {dead[0].name} exited (code {dead[0].exitcode})")

    def send(self, header: dict, tensors: list[torch.Tensor]) -> None:
        """Every worker runs this call now (rank 0 runs it right after, joining its collectives)."""
        self.check()
        self.group.broadcast(header, tensors)

    def close(self) -> None:
        """Stop the workers and reap them (idempotent; best effort: a dead group is left to the OS)."""
        self._finalizer()


def _stop(procs: list, group: Group | None, grace_s: float = 5.0) -> None:  # noqa: ANN001 - mp.Process
    """Tell live workers to return, then join every one (killing one that does not return in
    grace_s), so none is left running or as a zombie. A module function, not a method: it runs
    from weakref.finalize, which must not hold the Workers it finalizes."""
    try:
        # all alive or none told: a broadcast some rank cannot join would wait out the group's timeout
        if group is not None and procs and all(p.is_alive() for p in procs):
            group.broadcast({"op": "stop"}, [])
    except PeerLost:
        pass  # a worker died in between: the joins below reap it
    for p in procs:
        p.join(timeout=grace_s)
        if p.is_alive():
            p.kill()
            p.join(timeout=grace_s)


def start_tensor_parallel(config, folder: str, device: torch.device, dtype: torch.dtype,  # noqa: ANN001
                          kv_pages: int):  # noqa: ANN201 - (Workers, model, kv, attn, VocabView)
    """Rank 0's side of an engine with config.tensor_parallel_size ranks: the workers started,
    this rank's shard, KV cache and attention backend, and the full-vocabulary view proposers use.
    The decoder layers run dense (weight-only quantized shards are not built)."""
    from dspark.dist.tensor_parallel import check_divisible, vocab_view

    world = config.tensor_parallel_size
    check_divisible(LlamaConfig.from_hf(load_config(folder)), world)  # before any process starts
    if config.quantization not in ("auto", "none"):
        log.warning("--quantization %s: tensor-parallel shards run dense layers", config.quantization)
    # the ranks share the machine's cores: N processes each with every core would oversubscribe
    threads = max(1, torch.get_num_threads() // world)
    torch.set_num_threads(threads)
    device = rank_device(str(device), 0)
    if device.type == "cuda" and torch.cuda.device_count() < world:
        raise ValueError(f"--tensor-parallel-size {world} needs {world} GPUs (one per rank); "
                         f"{torch.cuda.device_count()} visible")
    spec = ShardSpec(folder, str(dtype).removeprefix("torch."), str(device), kv_pages, config.page_size,
                     config.attention_backend, threads)
    workers = Workers(spec, world)
    try:
        model, kv, attn = build_rank(spec, workers.group)
    except BaseException:
        workers.close()
        raise
    return workers, model, kv, attn, vocab_view(folder, model.config, device, dtype)
