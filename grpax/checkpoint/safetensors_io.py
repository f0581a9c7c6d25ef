"""A minimal safetensors reader that copies each tensor into ordinary memory with ``pread`` (no mmap, no torch).

``safetensors.safe_open`` memory-maps the file: every page a conversion touches stays in the process's resident
set until the file is closed, so streaming a 2.5 GB checkpoint costs 2.5 GB of RSS on top of the output. Reading
each tensor with ``os.pread`` keeps only the tensor being converted. Format: 8-byte little-endian header length,
a JSON header ``{name: {"dtype", "shape", "data_offsets": [begin, end]}}``, then the data
(https://github.com/huggingface/safetensors#format).
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


class SafetensorsFile:
    """Random access to the tensors of one ``.safetensors`` file.

    Raises:
      ValueError: if the header is truncated, not JSON, or describes data beyond the end of the file.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise ValueError(f"{self.path} is not a valid safetensors file (shorter than its header)")
            (n,) = struct.unpack("<Q", raw)
            if n > size - 8:
                raise ValueError(
                    f"{self.path} is not a valid safetensors file (header length {n} > file size)"
                )
            try:
                header = json.loads(f.read(n))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ValueError(f"{self.path} is not a valid safetensors file (bad header: {e})") from None
        self.metadata = header.pop("__metadata__", None) or {}
        self.entries = header
        self._data_start = 8 + n
        for name, entry in header.items():
            begin, end = entry["data_offsets"]
            if entry["dtype"] not in DTYPES:
                raise ValueError(f"{self.path}: tensor {name!r} has unsupported dtype {entry['dtype']}")
            expected = (
                int(np.prod(entry["shape"], dtype=np.int64)) * np.dtype(DTYPES[entry["dtype"]]).itemsize
            )
            if end - begin != expected or self._data_start + end > size:
                raise ValueError(
                    f"{self.path} is not a valid safetensors file (tensor {name!r} is truncated)"
                )

    def keys(self) -> list[str]:
        return list(self.entries)

    def get_tensor(self, name: str) -> np.ndarray:
        """Reads tensor ``name`` into a new numpy array (its stored dtype and shape)."""
        entry = self.entries[name]
        begin, end = entry["data_offsets"]
        out = np.empty(entry["shape"], DTYPES[entry["dtype"]])
        view = memoryview(out.reshape(-1).view(np.uint8))
        fd = os.open(self.path, os.O_RDONLY)
        try:
            done = 0
            while done < end - begin:
                chunk = os.preadv(fd, [view[done:]], self._data_start + begin + done)
                if chunk <= 0:
                    raise ValueError(f"{self.path}: unexpected end of file in tensor {name!r}")
                done += chunk
        finally:
            os.close(fd)
        return out
