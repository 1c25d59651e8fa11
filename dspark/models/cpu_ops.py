"""The fused CPU kernels of ``dspark/csrc/cpu_ops.cpp``, compiled on first use.

On CPU a decode step of a small model is mostly per-op overhead: RMS norms computed in several
float64 ops, rotary in six, attention gathered and padded for SDPA. The extension does each in
one call with a fixed summation order per row (see the source's header for why that keeps
speculative output exact). It is built once per machine with the system C++ compiler into
``<cache dir>/cpu_ops/`` (torch's JIT extension loader; about a minute) and reused after.
Without a compiler, or with ``DSPARK_CPU_OPS=0``, the model runs its pure-torch layers.
"""

from __future__ import annotations

import functools
import logging
import os
import pathlib

import torch

log = logging.getLogger(__name__)

SOURCE = pathlib.Path(__file__).resolve().parent.parent / "csrc" / "cpu_ops.cpp"
_ARCH_FLAGS = {"AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mavx2"],
               "AVX2": ["-mavx2", "-mfma"]}


def enabled() -> bool:
    """False when ``DSPARK_CPU_OPS=0`` asks for the pure-torch layers."""
    return os.environ.get("DSPARK_CPU_OPS", "1") != "0"


@functools.cache
def _build():  # noqa: ANN202 - the compiled module
    from torch.utils import cpp_extension

    from dspark.models.loader import cache_dir

    cap = torch.backends.cpu.get_cpu_capability()
    flags = ["-O3", "-fopenmp", *_ARCH_FLAGS.get(cap, [])]
    name = f"dspark_cpu_ops_{cap.lower()}"
    build = cache_dir() / "cpu_ops" / f"torch{torch.__version__.split('+')[0]}"
    build.mkdir(parents=True, exist_ok=True)
    if not any(build.glob(f"{name}*.so")):
        log.info("building the fused CPU kernels into %s (once per machine and torch version)", build)
    try:
        return cpp_extension.load(name=name, sources=[str(SOURCE)], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                                  build_directory=str(build), verbose=False)
    except Exception as e:  # no compiler, no ninja, a read-only cache: fall back, say why
        log.warning("fused CPU kernels unavailable (%s); the pure-torch layers run instead", e)
        return None


def load():  # noqa: ANN201 - the compiled module or None
    """The compiled kernels, or None when disabled or when they cannot be built here."""
    return _build() if enabled() else None


def for_tensor(x: torch.Tensor):  # noqa: ANN201 - the compiled module or None
    """The kernels when x is a CPU tensor they handle (bf16, fp16, fp32), else None."""
    if x.device.type != "cpu" or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return None
    return load()
