"""GGUF copies for `npuspec bench peers`: the same weights as another llama.cpp file type.

llama.cpp runs a GGUF file as it is stored. To compare it with npuspec at the same precision,
the bench writes the shipped file's tensors dequantised (F32: what npuspec's loader holds
after `npuspec.models.gguf` dequantises them) or re-quantised (Q8_0), metadata copied
unchanged but `general.file_type`. The copy goes to a directory the caller owns (the bench's
--work-dir, by default a fresh temporary one), never to a shared one.
"""
from __future__ import annotations

import os

import numpy as np

# general.file_type values (llama.cpp's LLAMA_FTYPE_*) of the copies we write
FILE_TYPES = {"F32": 0, "Q8_0": 7}


def converted_copy(src: str, dst: str, target: str) -> str:
    """Write src's tensors as `target` ("F32" or "Q8_0") to dst; 1-D tensors (norms) and
    tensors whose row length is not a multiple of Q8_0's block stay F32, as llama.cpp's own
    quantiser leaves them. -> dst."""
    import gguf
    from gguf import GGMLQuantizationType as Q

    assert target in FILE_TYPES, target
    r = gguf.GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(dst + ".part", arch)
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        if name == "general.file_type":
            w.add_uint32(name, FILE_TYPES[target])
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(name, f.contents(), f.types[0], sub)
    block = gguf.GGML_QUANT_SIZES[Q.Q8_0][0]
    for t in r.tensors:
        x = np.asarray(t.data)
        if t.tensor_type != Q.F32:
            x = gguf.quants.dequantize(x, t.tensor_type)     # [.., ne0] float32
        x = np.ascontiguousarray(x, dtype=np.float32)
        if target == "Q8_0" and x.ndim > 1 and x.shape[-1] % block == 0:
            w.add_tensor(t.name, gguf.quants.quantize(x, Q.Q8_0), raw_dtype=Q.Q8_0)
        else:
            w.add_tensor(t.name, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(dst + ".part", dst)
    return dst
