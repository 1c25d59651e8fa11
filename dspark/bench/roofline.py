"""`dspark bench roofline`: decode and verification passes of a randomly initialised model of a
named shape, timed against the memory-bandwidth roofline.

No weights are downloaded: the model is built on the meta device and filled in place with
random values, so a Qwen3-8B-shaped target fits on one GPU in seconds. Every request in a
batch holds `context` cached tokens; a decode pass adds one token per request, a verification
pass adds `verify_tokens + 1` (the anchor and its drafts, as the engine verifies a chain) and
computes logits for every row. The roofline is the time to read every weight once plus each
request's K/V, at the bandwidth a large device-to-device copy reaches on this device.

On CUDA with the flashinfer backend each pass is also timed from a CUDA graph (plan on the
host, then one replay), the way the engine runs uniform batches, less its padding and input
copies: eager PyTorch launches ~50 kernels a layer, and at small batches their launch cost,
not the GPU, sets the time.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dspark.engine.attention import AttnBatch, make_backend
from dspark.engine.cuda_graphs import capture_graph
from dspark.engine.flashinfer_backend import StaticBatch
from dspark.engine.kv_cache import KVCache
from dspark.models.llama import LlamaConfig, LlamaModel

SHAPES = {  # HF config.json fields of each named shape
    "qwen3-8b": dict(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     rope_theta=1000000.0, max_position_embeddings=40960, rms_norm_eps=1e-6),
    "smollm2-135m": dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                         rope_theta=100000.0, max_position_embeddings=8192, rms_norm_eps=1e-5,
                         tie_word_embeddings=True),
    "tiny": dict(model_type="qwen3", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10000.0,
                 max_position_embeddings=2048, rms_norm_eps=1e-6),
}


@dataclass
class RooflineRow:
    """One timed pass: eager or graph mode, batch size, tokens per request, median seconds and
    the roofline."""

    kind: str  # "decode" | "verify"
    mode: str  # "eager" | "graph"
    batch_size: int
    tokens_per_request: int
    seconds: float
    roofline_seconds: float
    bytes_moved: int

    @property
    def tokens_per_s(self) -> float:
        return self.batch_size / self.seconds  # one committed token per request per plain step

    def as_dict(self) -> dict:
        return {"kind": self.kind, "mode": self.mode, "batch_size": self.batch_size,
                "tokens_per_request": self.tokens_per_request,
                "ms": round(1e3 * self.seconds, 3), "roofline_ms": round(1e3 * self.roofline_seconds, 3),
                "fraction_of_roofline": round(self.roofline_seconds / self.seconds, 3),
                "decode_tok_s": round(self.tokens_per_s, 1) if self.kind == "decode" else None,
                "gbytes_per_step": round(self.bytes_moved / 1e9, 3),
                "bytes_per_step": self.bytes_moved}  # exact: a small model's GB round to 0.000


def random_model(shape: str, device: torch.device, dtype: torch.dtype, seed: int = 0) -> LlamaModel:
    """A LlamaModel of a named shape with random weights, allocated directly on `device`."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}: choose from {', '.join(SHAPES)}")
    cfg = LlamaConfig.from_hf(SHAPES[shape])
    with torch.device("meta"):
        model = LlamaModel(cfg).to(dtype)  # dtype first: an 8B model never exists in fp32
    model = model.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)
    return model.eval()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, nbytes: int, reps: int = 10) -> float:
    """Bytes/s of a device-to-device copy (read + write counted), median of reps."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).fill_(1)
    dst = torch.empty_like(src)
    times = []
    for _ in range(reps + 2):
        _sync(device)
        t = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        times.append(time.perf_counter() - t)
    return 2 * nbytes / statistics.median(times[2:])


def weight_bytes(model: LlamaModel) -> int:
    """Bytes a forward reads from the weights: all of them but the embedding table (one row per token)."""
    seen, total = set(), 0
    for name, p in model.named_parameters():
        if name.startswith("embed_tokens") and not model.config.tie_word_embeddings:
            continue
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def _pass_inputs(model: LlamaModel, kv: KVCache, batch_size: int, q_len: int,
                 context: int) -> tuple[AttnBatch, torch.Tensor, torch.Tensor, int]:
    dev = kv.k.device
    ps = kv.page_size
    per_req = -(-(context + q_len) // ps)
    tables = [list(range(r * per_req, (r + 1) * per_req)) for r in range(batch_size)]
    batch = AttnBatch(q_lens=[q_len] * batch_size, kv_lens=[context + q_len] * batch_size, page_tables=tables,
                      page_size=ps)
    ids = torch.randint(0, model.config.vocab_size, (batch_size * q_len,), device=dev)
    pos = (context + torch.arange(q_len, device=dev)).repeat(batch_size)
    return batch, ids, pos, per_req


def _median_seconds(step: Callable[[], object], device: torch.device, reps: int, warmup: int = 3) -> float:
    times = []
    for i in range(reps + warmup):
        _sync(device)
        t = time.perf_counter()
        step()
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def eager_pass(model: LlamaModel, attn, kv: KVCache, batch_size: int, q_len: int,
               context: int) -> Callable[[], None]:
    """One eager forward + logits for every row, batch_size requests of q_len new tokens after
    `context` cached ones, as a callable to repeat (under torch.inference_mode)."""
    batch, ids, pos, _ = _pass_inputs(model, kv, batch_size, q_len, context)

    def step() -> None:
        attn.plan(batch)
        hidden, _ = model(ids, pos, attn, kv)
        model.logits(hidden)

    return step


def time_pass(model: LlamaModel, attn, kv: KVCache, batch_size: int, q_len: int, context: int,
              reps: int) -> float:
    """Median seconds of eager_pass."""
    with torch.inference_mode():
        return _median_seconds(eager_pass(model, attn, kv, batch_size, q_len, context), kv.k.device, reps)


def time_graph_pass(model: LlamaModel, attn, kv: KVCache, batch_size: int, q_len: int, context: int,
                    reps: int) -> float:
    """The same pass captured in a CUDA graph: median seconds of plan + replay. attn is the eager
    flashinfer backend, whose scratch workspace the graph's static backend borrows."""
    batch, ids, pos, per_req = _pass_inputs(model, kv, batch_size, q_len, context)
    dev = kv.k.device
    static = make_backend(attn.name, dev, StaticBatch(batch_size, q_len, per_req), attn.workspace)
    with torch.inference_mode():
        static.plan(batch)
        graph, _ = capture_graph(lambda: model.logits(model(ids, pos, static, kv)[0]), dev)

        def step():
            static.plan(batch)
            graph.replay()

        return _median_seconds(step, dev, reps)


def run_roofline(shape: str, device: str, dtype: torch.dtype, batch_sizes: list[int], verify_tokens: int,
                 context: int, reps: int = 10, attention_backend: str = "auto",
                 bandwidth_bytes: int | None = None, graphs: bool = True) -> dict:
    """Decode and verification passes at each batch size; a JSON-ready report."""
    dev = torch.device(device)
    model = random_model(shape, dev, dtype)
    c = model.config
    bandwidth = copy_bandwidth(dev, bandwidth_bytes or (1 << 30 if dev.type == "cuda" else 1 << 26))
    wbytes = weight_bytes(model)
    page = 16
    max_tokens = context + verify_tokens + 1
    pages = max(batch_sizes) * -(-max_tokens // page)
    kv = KVCache(c.num_hidden_layers, pages, page, c.num_key_value_heads, c.head_dim, dtype, dev)
    attn = make_backend(attention_backend, dev)
    modes = ["eager", "graph"] if graphs and attn.name == "flashinfer" else ["eager"]
    per_token_kv = KVCache.bytes_per_token(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, dtype)
    rows = []
    for mode in modes:
        timer = time_graph_pass if mode == "graph" else time_pass
        for B in batch_sizes:
            for kind, q in (("decode", 1), ("verify", verify_tokens + 1)):
                moved = wbytes + B * (context + q) * per_token_kv
                sec = timer(model, attn, kv, B, q, context, reps)
                rows.append(RooflineRow(kind, mode, B, q, sec, moved / bandwidth, moved))
    best = modes[-1]  # what the engine runs: graphs where it has them
    by = {(r.kind, r.batch_size): r for r in rows if r.mode == best}
    return {
        "shape": shape, "config": SHAPES[shape], "device": _device_name(dev),
        "dtype": str(dtype).removeprefix("torch."),
        "attention_backend": attn.name, "context": context, "verify_tokens": verify_tokens,
        "copy_bandwidth_gb_s": round(bandwidth / 1e9, 1), "weight_gbytes": round(wbytes / 1e9, 3),
        "rows": [r.as_dict() for r in rows], "verify_over_decode_mode": best,
        "verify_over_decode": {B: round(by["verify", B].seconds / by["decode", B].seconds, 3) for B in batch_sizes},
    }


def _device_name(dev: torch.device) -> str:
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"


def format_table(report: dict) -> str:
    """The report as a fixed-width table (one line per pass)."""
    lines = [f"{report['shape']} on {report['device']} ({report['dtype']}, {report['attention_backend']} attention,"
             f" context {report['context']}, copy bandwidth {report['copy_bandwidth_gb_s']} GB/s)",
             f"{'pass':>7} {'mode':>6} {'batch':>5} {'tok/req':>7} {'ms':>9} {'roofline ms':>11} {'fraction':>8} "
             f"{'tok/s':>9}"]
    for r in report["rows"]:
        tps = f"{r['decode_tok_s']:.1f}" if r["decode_tok_s"] is not None else "-"
        lines.append(f"{r['kind']:>7} {r['mode']:>6} {r['batch_size']:>5} {r['tokens_per_request']:>7} {r['ms']:>9.3f} "
                     f"{r['roofline_ms']:>11.3f} {r['fraction_of_roofline']:>8.3f} {tps:>9}")
    ratios = ", ".join(f"batch {b}: {v}" for b, v in report["verify_over_decode"].items())
    lines.append(f"T_verify / T_decode ({report['verify_over_decode_mode']}): {ratios}")
    return "\n".join(lines)


def _int_list(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{text!r} is not a comma list of whole numbers") from None
    if not out or any(v < 1 for v in out):
        raise ValueError(f"batch sizes must be >= 1, got {text!r}")
    return out


def add_roofline_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``roofline`` to the sub-modes of ``dspark bench``."""
    from dspark.bench.roofline_model import add_model_args  # imports this module: here, not at the top
    p = subparsers.add_parser(
        "roofline", help="decode and verification passes of a random model of a named shape (or of --model) vs "
                         "the roofline",
        description="Time plain decode passes and chain-verification passes of a randomly initialised model "
                    "(no download) at several batch sizes, each against the memory-bandwidth roofline (weights "
                    "+ K/V bytes / measured copy bandwidth); with --model, of a real model loaded as the engine "
                    "loads it, k = 1..--max-rows rows per request, against the measured read bandwidth. The "
                    "table goes to stderr, the JSON to stdout.")
    p.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    p.add_argument("--device", default=None, help="default cuda (--model: cpu)")
    p.add_argument("--dtype", default=None, choices=["auto", "bf16", "fp16", "fp32"],
                   help="default bf16 (--model: auto, as the engine)")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "flashinfer"])
    p.add_argument("--batch-sizes", default=None, help="comma list (default 1,8,64; --model: 1,8)")
    p.add_argument("--verify-tokens", type=int, default=8, help="draft tokens per request in a verify pass")
    p.add_argument("--context", type=int, default=None, help="cached tokens per request (default 1024; --model: 256)")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions per pass, median reported (default "
                                                          "10; --model: 5)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="time eager passes only (default on CUDA with flashinfer: eager and CUDA-graph passes)")
    p.add_argument("--output", default=None, help="also write the JSON report to this file")
    add_model_args(p)
    p.set_defaults(func=cmd_roofline)
    return p


def cmd_roofline(args: argparse.Namespace) -> int:
    """Run the random-shape roofline, or the real model's with --model (``roofline_model.py``)."""
    from dspark.bench.roofline_model import cmd_model_roofline, resolve_dtype

    try:
        device = torch.device(args.device or ("cpu" if args.model is not None else "cuda"))
    except RuntimeError as e:
        raise ValueError(f"--device {args.device}: {e}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: CUDA is not available here (pass --device cpu to time this CPU)")
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    if args.model is not None:
        return cmd_model_roofline(args, device)
    args.context = 1024 if args.context is None else args.context
    args.reps = 10 if args.reps is None else args.reps
    if args.verify_tokens < 1 or args.context < 0 or args.reps < 1:
        raise ValueError("--verify-tokens and --reps must be >= 1, --context >= 0")
    dtype = resolve_dtype(args.dtype or "bf16", device)
    report = run_roofline(args.shape, str(device), dtype, _int_list(args.batch_sizes or "1,8,64"), args.verify_tokens,
                          args.context, args.reps, args.attention_backend, graphs=not args.enforce_eager)
    print(format_table(report), file=sys.stderr)
    text = json.dumps(report, indent=2)
    print(text)
    if args.output:
        pathlib.Path(args.output).write_text(text + "\n", encoding="utf-8")
    return 0
