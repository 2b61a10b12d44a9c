"""Where weights come from: a local safetensors checkpoint, or seeded random weights.

Both answer `get(name, shape)` with the hub's tensor names, so every layer loads the same
way from either, and any subset of layers or experts can be loaded on its own (an expert
node loads only its experts).
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megainfer.config import ModelConfig
from megainfer.errors import CheckpointError
from megainfer.hf_config import read_json_object, to_hf_dict
from megainfer.model import mxfp4
from megainfer.model.checkpoint_names import all_tensors

INDEX_FILE = "model.safetensors.index.json"
RANDOM_INIT_STD = 0.02
# Tensors that only quantized checkpoints carry: scales (FP8, compressed-tensors), packed
# weights and their zero points and group indices (GPTQ, AWQ).
QUANTIZED_TENSOR_SUFFIXES = ("_scale", ".scales", ".qweight", ".qzeros", ".g_idx")
FP8_SCALE_SUFFIX = "_scale_inv"  # DeepSeek-V3's block-scaled FP8: `X.weight` float8 beside `X.weight_scale_inv`
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def quantized_checkpoint_error(directory: Path, detail: str) -> CheckpointError:
    return CheckpointError(f"{directory}: {detail}: the checkpoint is quantized, and megainfer runs unquantized "
                           "float32, bfloat16 or float16 weights only; use the model's unquantized release")


class WeightSource(Protocol):
    def get(self, name: str, shape: tuple[int, ...], rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The tensor `name` (its rows [begin, end) where given: a fused tensor's part, read
        without the rest); a CheckpointError naming it if missing or not of `shape`."""


class SafetensorsCheckpoint:
    """Tensors of a checkpoint directory: one or several *.safetensors, index file honoured."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        index = self.directory / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as exc:
                raise CheckpointError(f"{index}: not a safetensors index ({exc!r}); it needs a 'weight_map'") from None
            self.file_of = {name: self.directory / fname for name, fname in weight_map.items()}
        else:
            files = sorted(self.directory.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"{self.directory}: no *.safetensors files; megainfer reads safetensors "
                                      "checkpoints (save with save_pretrained(safe_serialization=True))")
            self.file_of = {}
            for f in files:
                with safe_open(f, framework="pt") as handle:
                    self.file_of.update({name: f for name in handle.keys()})
        # Block-scaled FP8 (DeepSeek-V3's release, config.json's quantization_config naming fp8 and
        # its block size, 128 x 128 there): dequantized as each tensor loads. Any other scale
        # tensor marks a quantization megainfer does not serve.
        quant = read_json_object(self.directory / "config.json").get("quantization_config") or {}
        block = quant.get("weight_block_size") if quant.get("quant_method") == "fp8" else None
        self.fp8_block = tuple(block) if block else None
        suffixes = QUANTIZED_TENSOR_SUFFIXES + (() if self.fp8_block else (FP8_SCALE_SUFFIX,))
        scales = sorted(name for name in self.file_of if name.endswith(suffixes))
        if scales:
            raise quantized_checkpoint_error(self.directory, f"{len(scales)} quantization tensors, e.g. {scales[0]!r}")
        self._handles: dict[Path, object] = {}

    def get(self, name: str, shape: tuple[int, ...], rows: tuple[int, int] | None = None) -> torch.Tensor:
        path = self.file_of.get(name)
        if path is None and f"{name}_blocks" in self.file_of:
            return self._dequantized(name, shape, rows)
        if path is None:
            raise CheckpointError(f"{self.directory}: tensor {name!r} is missing (expected shape {list(shape)})")
        handle = self._handle(path, name)
        if rows is not None:  # a slice of a fused tensor: safetensors reads only those rows
            part = handle.get_slice(name)
            if tuple(part.get_shape()) != tuple(shape):
                raise CheckpointError(f"{self.directory}: tensor {name!r} has shape {list(part.get_shape())}, "
                                      f"expected {list(shape)}")
            tensor = part[rows[0]:rows[1]]
            _check_float(self.directory, name, tensor)
            return tensor
        tensor = handle.get_tensor(name)
        if self.fp8_block and tensor.dtype in FP8_DTYPES and name + FP8_SCALE_SUFFIX in self.file_of:
            scale = self._handle(self.file_of[name + FP8_SCALE_SUFFIX], name).get_tensor(name + FP8_SCALE_SUFFIX)
            tensor = dequantize_fp8(tensor, scale, self.fp8_block)
        _check_float(self.directory, name, tensor)
        if tuple(tensor.shape) != tuple(shape):
            raise CheckpointError(f"{self.directory}: tensor {name!r} has shape {list(tensor.shape)}, "
                                  f"expected {list(shape)}")
        return tensor

    def _handle(self, path: Path, name: str):
        handle = self._handles.get(path)
        if handle is None:
            if not path.is_file():
                raise CheckpointError(f"{self.directory}: shard {path.name} (holding {name!r}) does not exist")
            handle = self._handles[path] = safe_open(path, framework="pt")
        return handle

    def _dequantized(self, name: str, shape: tuple[int, ...], rows: tuple[int, int] | None) -> torch.Tensor:
        """`name` stored in MXFP4 (gpt-oss's experts: `name_blocks`, `name_scales`, megainfer/model/
        mxfp4.py), dequantized to float32 in transformers' layout; only `rows` (experts) are read."""
        parts = []
        for suffix in ("_blocks", "_scales"):
            path = self.file_of.get(name + suffix)
            if path is None:
                raise CheckpointError(f"{self.directory}: tensor {name + '_blocks'!r} has no {name + suffix!r} beside "
                                      "it; an MXFP4 tensor is stored as both")
            part = self._handle(path, name + suffix).get_slice(name + suffix)
            parts.append(part[rows[0]:rows[1]] if rows is not None else part[:])
        blocks, scales = parts
        # Stored rows are the served columns: [E, cols, in / 32, 16] for a served [E, in, cols].
        want = (shape[0], shape[2], shape[1] // mxfp4.GROUP, mxfp4.GROUP // 2)
        full = (shape[0] if rows is None else None,) + want[1:]
        if len(shape) != 3 or tuple(blocks.shape[1:]) != want[1:] or \
                (full[0] is not None and blocks.shape[0] != full[0]):
            raise CheckpointError(f"{self.directory}: MXFP4 tensor {name + '_blocks'!r} has shape "
                                  f"{list(blocks.shape)}, expected {list(want)} for {name!r} of shape {list(shape)}")
        try:
            return mxfp4.dequantize(blocks, scales)
        except ValueError as exc:
            raise CheckpointError(f"{self.directory}: {name!r}: {exc}") from None


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """A block-scaled FP8 weight [out, in] -> float32: each (block x block) tile times its entry of
    `scale_inv` [ceil(out / b0), ceil(in / b1)] (DeepSeek-V3's format; the name is theirs: the
    factor that undoes the quantization's scale)."""
    rows, cols = weight.shape
    b0, b1 = block
    if scale_inv.shape != (-(-rows // b0), -(-cols // b1)):
        raise CheckpointError(f"FP8 scale {tuple(scale_inv.shape)} does not tile a {rows} x {cols} weight in "
                              f"{b0} x {b1} blocks (quantization_config.weight_block_size)")
    scale = scale_inv.float().repeat_interleave(b0, 0)[:rows].repeat_interleave(b1, 1)[:, :cols]
    return weight.float() * scale


def _check_float(directory: Path, name: str, tensor: torch.Tensor) -> None:
    if tensor.dtype not in FLOAT_DTYPES:  # float8 or int8/uint8/int32-packed: not plain float weights
        dtype = str(tensor.dtype).removeprefix("torch.")
        raise quantized_checkpoint_error(directory, f"tensor {name!r} is {dtype}")


class RandomWeights:
    """Seeded random weights. Each tensor's values depend only on (seed, name), so a node
    that loads a subset gets exactly the tensors the colocated model has."""

    def __init__(self, seed: int = 0, std: float = RANDOM_INIT_STD) -> None:
        self.seed = seed
        self.std = std

    def get(self, name: str, shape: tuple[int, ...], rows: tuple[int, int] | None = None) -> torch.Tensor:
        if "norm" in name.split(".")[-2]:  # a norm's weight (input_layernorm, q_norm, DBRX's norm_1, norm_f)
            tensor = torch.ones(shape)
        else:
            generator = torch.Generator().manual_seed(zlib.crc32(f"{self.seed}:{name}".encode()))
            tensor = torch.randn(shape, generator=generator) * self.std
        return tensor if rows is None else tensor[rows[0]:rows[1]]


def save_checkpoint(cfg: ModelConfig, source: WeightSource, directory: str | Path, dtype: str = "float32") -> Path:
    """Write a hub-style checkpoint (config.json + model.safetensors) of every tensor of `cfg`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    torch_dtype = getattr(torch, dtype)
    tensors = {name: source.get(name, shape).to(torch_dtype).contiguous() for name, shape in all_tensors(cfg)}
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    hf = to_hf_dict(cfg)
    hf["torch_dtype"] = dtype
    (directory / "config.json").write_text(json.dumps(hf, indent=2))
    return directory
