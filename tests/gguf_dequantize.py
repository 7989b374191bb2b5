"""A GGUF file with every quantized tensor dequantized to f32 by gguf-py (the decoder that HF
transformers loads GGUF files with, independent of Tandem's), every other tensor and every
metadata entry as they are: the reference that the k-quant golden checks compare the engine's
native kernels with (engine/tests/kquant_golden.rs, made by scripts/kquant-golden).

    python tests/gguf_dequantize.py IN.gguf OUT.gguf
"""

import sys

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize


def main(src: str, dst: str) -> None:
    r = GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    w = GGUFWriter(dst, arch)
    for name, f in r.fields.items():
        # The writer writes the header fields and the architecture itself.
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == GGUFValueType.ARRAY else None
        w.add_key_value(name, f.contents(), vtype, sub)
    kept = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16}
    for t in r.tensors:
        if t.tensor_type in kept:
            w.add_tensor(t.name, np.array(t.data), raw_shape=list(reversed(t.shape.tolist())),
                         raw_dtype=t.tensor_type)
            continue
        v = dequantize(t.data, t.tensor_type).astype(np.float32)
        # GGUF lists dimensions fastest first; numpy's shape is the reverse.
        v = v.reshape(list(reversed(t.shape.tolist())))
        w.add_tensor(t.name, v)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
