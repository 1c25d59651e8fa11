// The Python module of the CPU kernels. Built without DSPARK_QUANT: the fused layer kernels
// (cpu_ops.cpp). With it: those, the packing (quant_pack.cpp), the int4/int8 matmuls and the
// whole decoder stack in one call (decode_stack.cpp), all in one library. The matmuls are
// quant_amx.cpp and quant_q8_rows.cpp for bf16 rows on a CPU with AMX (DSPARK_AMX set too) or with
// AVX512-VNNI and AVX512-BF16, or quant_avx2.cpp for float32 rows on a CPU with AVX2 alone.
#include <torch/extension.h>

#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace dspark;
  m.def("markov_walk", &cpu::markov_walk, "a drafter's greedy Markov-head walk over a block");
  m.def("argmax_rows", &cpu::argmax_rows, "each row's first maximum (torch's argmax rules)");
  m.def("rms_norm", &cpu::rms_norm, "RMS norm of rows");
  m.def("add_rms_norm", &cpu::add_rms_norm, "residual add, then RMS norm");
  m.def("silu_mul", &cpu::silu_mul, "silu(gate) * up of a fused gate/up output");
  m.def("rope_store", &cpu::rope_store, "rotary on q and k in place; k and v into the paged caches");
  m.def("attend", &cpu::attend, "masked attention over paged keys, one fixed order per row");
#ifdef DSPARK_REGISTER_ATTENTION
  m.def("attend_causal", &cpu::attend_causal, "attend's bits for causal rows (prompt chunks, chains), keys "
        "shared by the rows that read them");
#endif
#ifdef DSPARK_QUANT
  m.def("enable", &amx::enable, "request the AMX register state from the kernel (true without tiles)");
  m.def("pack", &amx::pack, "int4 (uint8) codes with scales and offsets, or int8 codes with scales -> the AMX layout",
        pybind11::arg("q"), pybind11::arg("d"), pybind11::arg("m") = pybind11::none());
  m.def("pack_q4k", &amx::pack_q4k, "GGUF Q4_K as it is: int4 codes, super-block d and dmin, 6-bit scales and mins "
        "-> the AMX layout and its scale bytes");
  m.def("mm", &amx::mm, "bf16 rows times a packed int4 or int8 weight (a pack8 one: with its code sums)",
        pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("dm"), pybind11::arg("sums") = pybind11::none());
  m.def("pack8", &amx::pack8, "int8 codes with scales (per 32 inputs, or per 16: k-quants) and optional offsets "
        "-> the int8-rows layout, scales and code sums", pybind11::arg("q"), pybind11::arg("d"),
        pybind11::arg("m") = pybind11::none());
  m.def("mm8", &amx::mm8, "bf16 rows, quantized to int8, times a pack8 weight");
#ifdef DSPARK_AMX
  m.def("mm_prompt", &amx::mm_prompt, "prompt rows (bf16) times a packed int4 weight (or a pack8 one, with its code "
        "sums) on AMX-BF16 tiles, as a GEMM", pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("dm"),
        pybind11::arg("sums") = pybind11::none());
#endif
  m.def("decode_stack", &decode_stack, "a decoder stack's decode or verification pass, every layer in one call");
#endif
}
