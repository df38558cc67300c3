"""A safetensors file rewritten in place, for engines that install weights by reloading a file.

vLLM's portable weight update reads a checkpoint directory. Writing a fresh file per version
costs a conversion into new tensors, then a serialisation, then fresh tmpfs pages: about
1 s for a 135M model here, half the install budget. The layout of a policy never changes
between versions, so the file is laid out once (header, then every tensor at a fixed
offset) and each version is converted straight into its mapped pages: one pass, no
allocation. Readers of the file (the engine's loader) see the bytes through the shared
page cache; the engine reads only after ``write`` returned and never while it runs.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import warnings
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

from echo2.engines.base import TensorLayout

_ST_DTYPES = {torch.bfloat16: ("BF16", 2), torch.float16: ("F16", 2), torch.float32: ("F32", 4)}
_ALIGN = 64  # the data section starts on a cache line


class SafetensorsStaging:
    """One ``model.safetensors`` in ``directory`` with ``layout``'s tensors as ``dtype``."""

    def __init__(self, directory: Path, layout: TensorLayout, dtype: torch.dtype = torch.bfloat16) -> None:
        if dtype not in _ST_DTYPES:
            raise ValueError(f"staging dtype must be one of {list(_ST_DTYPES)}, got {dtype}")
        self.path = Path(directory) / "model.safetensors"
        self.dtype = dtype
        code, itemsize = _ST_DTYPES[dtype]
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        self._slots: dict[str, tuple[int, int, tuple[int, ...]]] = {}
        end = 0
        for name, (shape, _wire_dtype) in layout.items():
            nbytes = math.prod(shape) * itemsize
            header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [end, end + nbytes]}
            self._slots[name] = (end, nbytes, tuple(shape))
            end += nbytes  # the format wants tensors back to back, no gaps
        encoded = json.dumps(header, separators=(",", ":")).encode()
        # Pad with spaces (allowed by the format) so that the data section is aligned too.
        encoded += b" " * (-(8 + len(encoded)) % _ALIGN)
        self._data_start = 8 + len(encoded)
        total = self._data_start + end
        with open(self.path, "wb") as f:
            f.write(len(encoded).to_bytes(8, "little"))
            f.write(encoded)
            f.truncate(total)
        self._file = open(self.path, "r+b")
        self._map = mmap.mmap(self._file.fileno(), total)
        self._bytes = np.frombuffer(self._map, dtype=np.uint8)
        # Allocate the file's pages now (tmpfs hands them out on first write), so that the
        # first version's install pays only its conversion.
        self._bytes[self._data_start :: mmap.PAGESIZE] = 0

    def write(self, tensors: Mapping[str, np.ndarray]) -> None:
        """Convert each wire array (float32, float16, or bf16 bits as uint16) into its slot.

        ``tensors`` must hold exactly the layout's names with its shapes (checked by the
        caller); arrays may be read-only views (a received snapshot), they are only read.
        """
        for name, (offset, nbytes, shape) in self._slots.items():
            array = tensors[name]
            start = self._data_start + offset
            destination = torch.from_numpy(self._bytes[start : start + nbytes]).view(self.dtype).view(shape)
            with warnings.catch_warnings():
                # torch warns on read-only arrays because a tensor could write to them;
                # this one is only read by copy_.
                warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
                source = torch.from_numpy(np.ascontiguousarray(array))
            if source.dtype == torch.uint16:
                source = source.view(torch.bfloat16)
            destination.copy_(source)

    def close(self) -> None:
        if self._map.closed:
            return
        del self._bytes  # the map refuses to close while a view of it is alive
        self._map.close()
        self._file.close()
        os.unlink(self.path)
