"""The in-place safetensors staging file that the vLLM engine reloads weights from."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from echo2.engines.staging import SafetensorsStaging

LAYOUT = {"embed.weight": ((7, 5), "float32"), "norm.weight": ((5,), "float32"), "head.bias": ((3,), "float32")}


def wire(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal(shape).astype(np.float32) for name, (shape, _) in LAYOUT.items()}


def test_each_version_is_readable_by_safetensors_and_overwrites_the_last(tmp_path) -> None:  # type: ignore[no-untyped-def]
    staging = SafetensorsStaging(tmp_path, LAYOUT, torch.bfloat16)
    try:
        for seed in (0, 1):
            tensors = wire(seed)
            for array in tensors.values():
                array.flags.writeable = False  # a received snapshot's views are read-only
            staging.write(tensors)
            loaded = load_file(str(staging.path))
            assert set(loaded) == set(LAYOUT)
            for name, array in tensors.items():
                assert loaded[name].dtype == torch.bfloat16 and tuple(loaded[name].shape) == array.shape
                torch.testing.assert_close(loaded[name], torch.from_numpy(array.copy()).to(torch.bfloat16))
    finally:
        staging.close()
    assert not staging.path.exists()


def test_bf16_bits_and_fp16_wire_forms(tmp_path) -> None:  # type: ignore[no-untyped-def]
    tensors = wire(2)
    as_bf16 = {name: torch.from_numpy(a).to(torch.bfloat16) for name, a in tensors.items()}
    mixed = {
        "embed.weight": as_bf16["embed.weight"].view(torch.uint16).numpy(),  # bf16 bits on the wire
        "norm.weight": tensors["norm.weight"].astype(np.float16),
        "head.bias": tensors["head.bias"],
    }
    staging = SafetensorsStaging(tmp_path, LAYOUT, torch.bfloat16)
    try:
        staging.write(mixed)
        loaded = load_file(str(staging.path))
    finally:
        staging.close()
    assert torch.equal(loaded["embed.weight"], as_bf16["embed.weight"])
    torch.testing.assert_close(loaded["norm.weight"], torch.from_numpy(mixed["norm.weight"]).to(torch.bfloat16))
    assert torch.equal(loaded["head.bias"], as_bf16["head.bias"])


def test_fp32_staging_is_exact_and_unknown_dtype_refused(tmp_path) -> None:  # type: ignore[no-untyped-def]
    tensors = wire(3)
    staging = SafetensorsStaging(tmp_path, LAYOUT, torch.float32)
    try:
        staging.write(tensors)
        loaded = load_file(str(staging.path))
    finally:
        staging.close()
    for name, array in tensors.items():
        np.testing.assert_array_equal(loaded[name].numpy(), array)
    with pytest.raises(ValueError, match="staging dtype"):
        SafetensorsStaging(tmp_path, LAYOUT, torch.int8)
