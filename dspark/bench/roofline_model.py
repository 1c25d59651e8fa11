"""`dspark bench roofline --model FILE`: a real model's decode and verification passes, as the
engine runs them, against this machine's measured read bandwidth.

The model is loaded by ``load_model`` exactly as the engine loads it (a GGUF's kept int4/int8
blocks, the int8 or pre-packed LM head, ``--quantization`` and ``--dtype`` as given), and every
pass goes through ``LlamaModel.forward`` + ``logits`` with the attention backend the engine would
pick, so the fused CPU kernels and the one-call decoder stack run where the engine's would. For
each batch size B every request holds ``context`` cached tokens and a pass adds k rows per
request (k = 1: a plain decode step; k > 1: the anchor and k - 1 drafts of a verified chain),
each with its logits, as the engine computes them. The passes of all k are timed in interleaved
rounds, so drift on a shared machine hits every k alike and the ratios T(k)/T(1) stay fair.

Bytes a pass reads (``decode_read_bytes``; the roofline is those bytes at the read bandwidth a
``torch.sum`` over a large float32 tensor reaches):

* every parameter and buffer of the decoder layers, final norm and LM head that the forward reads,
  in the form it reads them: packed int4 codes with their scales, Q8_0 codes, pre-packed dense
  weights, norms, biases; each storage counted once;
* not the dense ``weight`` a packed or int8 head still exposes (tied to the embedding, read only
  by drafters), nor a quantized linear's dense prompt-row copy (``--prefill-dense-copy``; prompt
  rows only), nor the rotary tables (a few rows per position);
* of the embedding table only the rows the pass looks up (one per input row);
* each request's cached K/V: B x (context + k) tokens x the bytes per token of every layer.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import torch
from torch import nn

from dspark.bench.roofline import RooflineRow, _int_list, _pass_inputs, _sync
from dspark.config import QUANTIZATION_CHOICES, cpu_has_native_bf16
from dspark.engine.attention import make_backend
from dspark.engine.kv_cache import KVCache
from dspark.models.llama import LlamaModel

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
PAGE = 16  # the engine's default page size


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The ``--model`` options of ``dspark bench roofline`` (the shape's defaults stay its own)."""
    p.add_argument("--model", default=None,
                   help="time a real model as the engine runs it instead of a random shape: a .gguf file, an HF "
                        "folder or 'default' (the shipped SmolLM2-135M-Instruct); defaults then: --device cpu, "
                        "--dtype auto, --batch-sizes 1,8, --context 256, --reps 5")
    p.add_argument("--quantization", default="auto", choices=list(QUANTIZATION_CHOICES),
                   help="with --model: decoder-layer kernels, as `dspark serve --quantization` (default auto)")
    p.add_argument("--max-rows", type=int, default=16,
                   help="with --model: verification passes of k = 1..N rows per request (default %(default)s)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--bandwidth-mib", type=int, default=1024,
                   help="with --model: MiB of float32 the read-bandwidth probe sums (default %(default)s)")


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto`` as the engine resolves it: bf16 on CUDA and on CPUs with native bf16, else fp32."""
    if name != "auto":
        return DTYPES[name]
    return torch.bfloat16 if device.type == "cuda" or cpu_has_native_bf16() else torch.float32


def read_bandwidth(device: torch.device, nbytes: int = 1 << 30, reps: int = 5) -> float:
    """Bytes/s that a ``torch.sum`` over ``nbytes`` of float32 reads, median of reps (a tensor far
    larger than the caches: what streaming weights from memory can reach on this machine)."""
    x = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)  # written: every page mapped
    times = []
    for i in range(reps + 1):
        _sync(device)
        t = time.perf_counter()
        x.sum()
        _sync(device)
        if i:  # the first one pays for page-table walks and thread start-up
            times.append(time.perf_counter() - t)
    return x.numel() * 4 / statistics.median(times)


def _reads_own_weight(module: nn.Module) -> bool:
    """Whether a head's forward reads its ``weight``: packed and int8 heads keep it only for the
    embedding it is tied to and for drafters that share the head, and read their own copy."""
    return next(module.buffers(), None) is None  # a plain linear: no buffers, the weight itself


def decode_read_bytes(model: LlamaModel) -> dict[str, int]:
    """Bytes of the weights one decode or verification pass reads, by part (``layers``: linears
    and their biases, ``norms``, ``head``), each storage once; the embedding table and K/V are
    per-row costs (see the module docstring), counted by the caller."""
    parts = {"layers": 0, "norms": 0, "head": 0}
    seen: set[tuple[int, int]] = set()
    for mod_name, module in model.named_modules():
        top = mod_name.split(".")[0]
        if top in ("embed_tokens", "rotary") or ".prefill" in f".{mod_name}":
            continue  # rows looked up / position tables / prompt rows only
        tensors = list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False))
        for name, t in tensors:
            if mod_name == "lm_head" and name == "weight" and not _reads_own_weight(module):
                continue
            # the tensor's own bytes: a weight may view a larger storage (a mapped file's)
            key = (t.data_ptr() if not t.is_mkldnn else id(t), t.nbytes)  # oneDNN's blocked weights have no pointer
            if t.numel() == 0 or key in seen:
                continue
            seen.add(key)
            part = "head" if top == "lm_head" else "norms" if "norm" in mod_name.rsplit(".", 1)[-1] else "layers"
            parts[part] += t.nbytes
    return parts


def time_rows(model: LlamaModel, attn, kv: KVCache, batch_size: int, ks: list[int], context: int,  # noqa: ANN001
              reps: int, warmup: int = 1) -> dict[int, float]:
    """Median seconds of a pass of k rows per request (forward + logits of every row, as the engine
    verifies a chain) for each k; rounds interleave the k so load changes hit all alike."""
    inputs = {k: _pass_inputs(model, kv, batch_size, k, context)[:3] for k in ks}
    times: dict[int, list[float]] = {k: [] for k in ks}
    dev = kv.k.device
    with torch.inference_mode():
        for r in range(warmup + reps):
            for k in ks:
                batch, ids, pos = inputs[k]
                _sync(dev)
                t = time.perf_counter()
                attn.plan(batch)
                hidden, _ = model(ids, pos, attn, kv)
                model.logits(hidden)
                _sync(dev)
                if r >= warmup:
                    times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def _kernel_path(model: LlamaModel, attn, dtype: torch.dtype, device: torch.device) -> str:  # noqa: ANN001
    """Which forward the passes take: the one-call C++ decoder stack, the fused per-layer loop or
    the modules' own forward (what ``LlamaModel.forward`` picks for these rows)."""
    from dspark.models.fused import kernels_for, stack_plan

    with torch.inference_mode():
        ops = kernels_for(torch.empty(1, model.config.hidden_size, dtype=dtype, device=device), attn)
        if ops is None:
            return "modules"
        return "decode_stack" if stack_plan(model, ops) is not None else "fused_layers"


def run_model_roofline(model_arg: str | None, device: str, dtype: torch.dtype, quantization: str,
                       batch_sizes: list[int], max_rows: int, context: int, reps: int = 5,
                       attention_backend: str = "auto", bandwidth_bytes: int = 1 << 30) -> dict:
    """Passes of k = 1..max_rows rows per request at each batch size on a loaded model; a JSON-ready
    report (see the module docstring for what the bytes count)."""
    from dspark.models.loader import load_model

    dev = torch.device(device)
    bandwidth = read_bandwidth(dev, bandwidth_bytes)  # before the load: the probe's GiB is freed again
    t0 = time.perf_counter()
    model, folder = load_model(model_arg, dev, dtype, quantization)
    load_s = time.perf_counter() - t0
    c = model.config
    parts = decode_read_bytes(model)
    wbytes = sum(parts.values())
    emb = model.embed_tokens
    # a row looked up: from the mapped file's blocks (BlockRows) or from the dense table
    row_bytes = getattr(emb, "row_bytes", None) or emb.weight.shape[1] * emb.weight.element_size()
    per_token_kv = KVCache.bytes_per_token(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, dtype)
    pages = max(batch_sizes) * -(-(context + max_rows) // PAGE)
    kv = KVCache(c.num_hidden_layers, pages, PAGE, c.num_key_value_heads, c.head_dim, dtype, dev)
    attn = make_backend(attention_backend, dev)
    ks = list(range(1, max_rows + 1))
    rows: list[RooflineRow] = []
    ratios: dict[int, dict[int, float]] = {}
    for B in batch_sizes:
        secs = time_rows(model, attn, kv, B, ks, context, reps)
        for k in ks:
            moved = wbytes + B * k * row_bytes + B * (context + k) * per_token_kv
            rows.append(RooflineRow("decode" if k == 1 else "verify", "eager", B, k, secs[k], moved / bandwidth,
                                    moved))
        ratios[B] = {k: round(secs[k] / secs[1], 3) for k in ks}
    decode = {r.batch_size: r for r in rows if r.kind == "decode"}
    return {
        "model": "default" if model_arg is None else model_arg, "folder": folder,
        "config": {k: getattr(c, k) for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                              "num_attention_heads", "num_key_value_heads", "head_dim",
                                              "vocab_size", "tie_word_embeddings")},
        "device": "cpu" if dev.type == "cpu" else torch.cuda.get_device_name(dev),
        "dtype": str(dtype).removeprefix("torch."), "quantization": quantization,
        "kernels": model.quantization, "lm_head": type(model.lm_head).__name__,
        "forward": _kernel_path(model, attn, dtype, dev), "attention_backend": attn.name,
        "threads": torch.get_num_threads(), "context": context, "reps": reps, "load_s": round(load_s, 1),
        "read_bandwidth_gb_s": round(bandwidth / 1e9, 2),
        "read_bandwidth_probe": f"torch.sum over {bandwidth_bytes >> 20} MiB of float32, median of 5",
        "weight_bytes": wbytes, "weight_gbytes": round(wbytes / 1e9, 3), "weight_bytes_by_part": parts,
        "embedding_row_bytes": row_bytes, "kv_bytes_per_token": per_token_kv,
        "decode": {B: {"ms": round(1e3 * r.seconds, 3), "tok_s": round(r.tokens_per_s, 1),
                       "bytes_per_step": r.bytes_moved, "gb_s": round(r.bytes_moved / r.seconds / 1e9, 2),
                       "fraction_of_bandwidth": round(r.roofline_seconds / r.seconds, 3)}
                   for B, r in decode.items()},
        "rows": [{**r.as_dict(), "gb_s": round(r.bytes_moved / r.seconds / 1e9, 2)} for r in rows],
        "verify_over_decode": ratios,
    }


def format_model_table(report: dict) -> str:
    """The report as text: the model and bandwidth, decode's bytes and fraction, then T(k)/T(1)
    per batch size, one line per k."""
    bs = list(report["decode"])
    kernels = ", ".join(f"{n} x{v['count']}" for n, v in report["kernels"].items()) or "dense"
    lines = [f"{report['model']} on {report['device']} ({report['dtype']}, --quantization {report['quantization']}: "
             f"{kernels}, head "
             f"{report['lm_head']}, forward {report['forward']}, {report['attention_backend']} attention, "
             f"{report['threads']} threads, context {report['context']})",
             f"read bandwidth {report['read_bandwidth_gb_s']} GB/s ({report['read_bandwidth_probe']}); weights read "
             f"per pass {report['weight_gbytes']} GB {report['weight_bytes_by_part']}"]
    for B, d in report["decode"].items():
        lines.append(f"decode batch {B}: {d['ms']:.2f} ms, {d['tok_s']} tok/s, {d['bytes_per_step'] / 1e9:.3f} GB "
                     f"read, {d['gb_s']} GB/s = {d['fraction_of_bandwidth']:.3f} of the read bandwidth")
    ms = {(str(r["batch_size"]), str(r["tokens_per_request"])): r["ms"] for r in report["rows"]}
    lines.append(f"{'k':>3} " + " ".join(f"{f'B={B} ms':>10} {'T(k)/T(1)':>9}" for B in bs))
    for k in report["verify_over_decode"][bs[0]]:
        lines.append(f"{k:>3} " + " ".join(f"{ms[B, k]:>10.2f} {report['verify_over_decode'][B][k]:>9.3f}"
                                            for B in bs))
    return "\n".join(lines)


def cmd_model_roofline(args: argparse.Namespace, device: torch.device) -> int:
    """``dspark bench roofline --model`` on ``device`` (checked by the caller, threads set): the
    table to stderr, the JSON to stdout (and --output)."""
    reps = 5 if args.reps is None else args.reps
    context = 256 if args.context is None else args.context
    if reps < 1 or context < 0 or args.max_rows < 1 or args.bandwidth_mib < 1:
        raise ValueError("--reps, --max-rows and --bandwidth-mib must be >= 1, --context >= 0")
    from dspark.cli import check_output_path  # the CLI imports this module

    check_output_path(args.output)  # before a load of minutes, not after it
    report = run_model_roofline(None if args.model == "default" else args.model, str(device),
                                resolve_dtype(args.dtype or "auto", device), args.quantization,
                                _int_list(args.batch_sizes or "1,8"), args.max_rows, context, reps,
                                args.attention_backend, args.bandwidth_mib << 20)
    text = json.dumps(report, indent=2)
    print(format_model_table(json.loads(text)), file=sys.stderr)  # the JSON's string keys, as a reader sees them
    print(text)
    if args.output:
        pathlib.Path(args.output).write_text(text + "\n", encoding="utf-8")
    return 0
