"""A GGUF's 2-D weights re-encoded as Q8_0 (the default model as a Q8_0 file, for measuring the
kept-Q8_0 path on a real model; llama.cpp's own quantize tool is not available here).

    .venv/bin/python scripts/requantize_gguf.py OUT.gguf [--src FILE.gguf]

Metadata (tokenizer, chat template, hyper-parameters) is copied as it is; every 2-D tensor is
de-quantized and written again as Q8_0, 1-D tensors (norms) stay as they were.
"""

from __future__ import annotations

import argparse

import gguf
import numpy as np
from gguf.quants import dequantize, quantize

from dspark.models.loader import default_model_path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--src", default=None, help="source GGUF (default: the default model's)")
    args = ap.parse_args()
    reader = gguf.GGUFReader(args.src or default_model_path())
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    writer = gguf.GGUFWriter(args.out, arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # written by GGUFWriter itself
        if field.name == gguf.Keys.General.FILE_TYPE:
            writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape))
        if len(shape) == 2 and shape[1] % 32 == 0:
            w = dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
            writer.add_tensor(t.name, quantize(w, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


if __name__ == "__main__":
    main()
