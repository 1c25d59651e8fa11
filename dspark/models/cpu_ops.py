"""The fused CPU kernels of ``dspark/csrc/``, compiled on first use.

On CPU a decode step of a small model is mostly per-op overhead: RMS norms computed in several
float64 ops, rotary in six, attention gathered and padded for SDPA. ``cpu_ops.cpp`` does each in
one call with a fixed summation order per row (see the source's header for why that keeps
speculative output exact). Where the CPU has AMX, the same library also holds ``quant_amx.cpp``'s
int4 and int8 matmuls, whose cost hardly grows with the number of rows (verification), and
``decode_stack.cpp``, which runs a whole decoder stack's pass in one call. The library is built
once per machine with the system C++ compiler into ``<cache dir>/cpu_ops/`` (torch's JIT
extension loader; about a minute) and reused after. A CPU without AMX but with AVX512-VNNI and
AVX512-BF16 (AMD Zen 4 and later, Intel Cooper Lake) gets the same matmuls and
decoder stack built without tiles: every row count takes the VNNI path, which gives a row the
same bits as the tile path. A CPU with AVX2 but neither (AMD Zen 2/3, Intel Haswell to Ice Lake)
has no fast bf16, so its models run in float32; it gets ``quant_avx2.cpp``'s float32
versions of the same matmuls on the same packed weights, and the same decoder stack. Without a
compiler, or with ``DSPARK_CPU_OPS=0``, the model runs its pure-torch layers and torch's int4
kernel.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pathlib
import shutil

import torch

log = logging.getLogger(__name__)

# extension name -> why its build failed (torch's message, which holds the compiler's output):
# a failure with a toolchain present is a bug, and the tests show this instead of skipping
build_errors: dict[str, str] = {}

CSRC = pathlib.Path(__file__).resolve().parent.parent / "csrc"
SOURCES = [CSRC / "module.cpp", CSRC / "cpu_ops.cpp", CSRC / "attend.cpp"]
_QUANT_COMMON = [CSRC / "quant_pack.cpp", CSRC / "decode_stack.cpp"]
AMX_SOURCES = [*SOURCES, *_QUANT_COMMON, CSRC / "quant_amx.cpp", CSRC / "quant_q8_rows.cpp", CSRC / "quant_prompt.cpp"]
AVX2_SOURCES = [*SOURCES, *_QUANT_COMMON, CSRC / "quant_avx2.cpp"]
# No contraction of a product and a sum into an FMA the source did not write: the kernels' sums
# run in the order written, so two kernels written alike (attend, attend_causal) give equal bits.
CFLAGS = ["-O3", "-ffp-contract=off", "-fopenmp"]
_ARCH_FLAGS = {"AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mavx2"],
               "AVX2": ["-mavx2", "-mfma"]}


def enabled() -> bool:
    """False when ``DSPARK_CPU_OPS=0`` asks for the pure-torch layers."""
    return os.environ.get("DSPARK_CPU_OPS", "1") != "0"


def _compile(name: str, sources: list[pathlib.Path], flags: list[str], optional: bool = False):  # noqa: ANN202
    """The compiled module, or None (logged with the compiler's output, kept in build_errors).
    optional: a build with a fallback of its own (AMX: an older compiler lacks -mamx-*), whose
    failure is a warning rather than an error."""
    from torch.utils import cpp_extension

    from dspark.models.loader import cache_dir

    build = cache_dir() / "cpu_ops" / f"torch{torch.__version__.split('+')[0]}"
    build.mkdir(parents=True, exist_ok=True)
    if not any(build.glob(f"{name}*.so")):
        log.info("building %s into %s (once per machine and torch version)", name, build)
    try:
        return cpp_extension.load(name=name, sources=[str(s) for s in sources],
                                  extra_cflags=[*CFLAGS, *flags], extra_include_paths=[str(CSRC)],
                                  extra_ldflags=["-fopenmp"], build_directory=str(build), verbose=False)
    except Exception as e:  # fall back to torch's kernels, but never quietly
        build_errors[name] = str(e)
        missing = toolchain_missing()
        if missing is not None:  # expected on a machine without build tools: one line is enough
            log.warning("%s unavailable (%s); torch's own kernels run instead", name, missing)
        else:  # a compiler is there, so this is a broken source, flag or cache: show its output
            level = logging.WARNING if optional else logging.ERROR
            log.log(level, "%s failed to build in %s; torch's own (slower) kernels run instead:\n%s", name, build, e)
        return None


def toolchain_missing() -> str | None:
    """Why no kernels can be built on this machine (no C++ compiler, or no ninja for torch's JIT
    loader), or None: then a failed build is a bug, not an expected fallback."""
    from torch.utils import cpp_extension

    cxx = os.environ.get("CXX", "c++")  # what torch's loader compiles with
    if shutil.which(cxx) is None:
        return f"no C++ compiler ({cxx}) on PATH"
    if not cpp_extension.is_ninja_available():
        return "no ninja on PATH"
    return None


@functools.cache
def _build():  # noqa: ANN202 - the compiled module
    cap = torch.backends.cpu.get_cpu_capability()
    return _compile(f"dspark_cpu_ops_{cap.lower()}", SOURCES, _ARCH_FLAGS.get(cap, []))


def load():  # noqa: ANN201 - the compiled module or None
    """The compiled kernels (the matmul build where :func:`quant` has one, so that every caller
    runs the same code), or None when disabled or when they cannot be built here."""
    if not enabled():
        return None
    return quant() or _build()


@functools.cache
def sources_digest() -> str:
    """A short hash of the kernels' sources (csrc/): what a record measured with these kernels,
    such as the start-up cost profile, is keyed by, so that a changed kernel measures again."""
    h = hashlib.sha256()
    for path in sorted(CSRC.glob("*")):
        if path.suffix in (".cpp", ".h"):
            h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:12]


def _cpu_flags() -> set[str]:
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux: no AMX path
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())


_AMX_FLAGS = {"amx_tile", "amx_bf16", "amx_int8", "avx512_bf16", "avx512_vnni", "avx512bw"}
_VNNI_FLAGS = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni"}
_AVX2_FLAGS = {"avx2", "fma", "f16c"}
_QUANT_FLAGS = [*_ARCH_FLAGS["AVX512"], "-mavx512bf16", "-mavx512vnni", "-DDSPARK_QUANT"]


@functools.cache
def _build_quant(tiles: bool):  # noqa: ANN202 - the compiled module
    flags = _cpu_flags()
    if tiles and _AMX_FLAGS <= flags:
        mod = _compile("dspark_cpu_ops_amx", AMX_SOURCES,
                       [*_QUANT_FLAGS, "-mamx-tile", "-mamx-bf16", "-mamx-int8", "-DDSPARK_AMX"], optional=True)
        if mod is not None and mod.enable():
            return mod
        log.warning("no AMX build here (no compiler support, or the kernel refused the AMX registers); "
                    "trying the VNNI build")
    if _VNNI_FLAGS <= flags:
        return _compile("dspark_cpu_ops_vnni", AMX_SOURCES, _QUANT_FLAGS)
    if _AVX2_FLAGS <= flags:  # also AVX512 CPUs without BF16 (Skylake-SP, Cascade Lake): float32 models there
        return _compile("dspark_cpu_ops_avx2q", AVX2_SOURCES, [*_ARCH_FLAGS["AVX2"], "-mf16c", "-DDSPARK_QUANT"])
    return None


def quant_expected() -> bool:
    """Whether this CPU's flags call for a :func:`quant` build (AMX, AVX512-VNNI with BF16, or AVX2)."""
    flags = _cpu_flags()
    return _VNNI_FLAGS <= flags or _AVX2_FLAGS <= flags


def quant():  # noqa: ANN201 - the compiled module or None
    """The kernels with the int4/int8 weight matmuls and the decoder stack: for bf16 rows on AMX
    tiles where the CPU has AMX (BF16 and INT8) and ``DSPARK_CPU_AMX=0`` is not set, else on
    AVX512-VNNI alone where the CPU has it and AVX512-BF16 (``csrc/quant_amx.cpp``,
    ``quant_q8_rows.cpp``); for float32 rows on AVX2 where the CPU has neither
    (``quant_avx2.cpp``: such CPUs have no fast bf16, so the model runs in float32); None
    otherwise or where ``DSPARK_CPU_OPS=0`` is set."""
    if not enabled():
        return None
    return _build_quant(os.environ.get("DSPARK_CPU_AMX", "1") != "0")


def quant_kind() -> str | None:
    """"amx", "vnni", "avx2" or None: which build :func:`quant` is (for profiles and reports)."""
    mod = quant()
    if mod is None:
        return None
    return next(kind for kind in ("amx", "vnni", "avx2") if kind in mod.__name__)


def quant_dtype() -> torch.dtype | None:
    """The activation dtype :func:`quant`'s matmuls take and return (bf16, or float32 on AVX2)."""
    kind = quant_kind()
    if kind is None:
        return None
    return torch.float32 if kind == "avx2" else torch.bfloat16


def for_tensor(x: torch.Tensor):  # noqa: ANN201 - the compiled module or None
    """The kernels when x is a CPU tensor they handle (bf16, fp16, fp32), else None."""
    if x.device.type != "cpu" or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return None
    return load()
