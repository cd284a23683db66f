"""The codecs of a run's gradient all-reduce (hparam ``compression``, names in ``protocol.spec.COMPRESSIONS``).

Every codec here is one of hivemind's (``hivemind.compression``) or a thin subclass with hivemind's wire format, so
a receiver decodes every message through hivemind's own table (``deserialize_torch_tensor``):

- ``none``: fp32 as is; ``fp16``: ``Float16Compression``;
- ``bf16``: fp32 rounded to bfloat16 and sent as its 2 bytes (hivemind's ``NONE`` format with dtype ``bfloat16``,
  which hivemind's ``NoCompression.extract`` reads by the buffer's length whatever ``USE_LEGACY_BFLOAT16`` says);
- ``8bit``: ``Uniform8BitQuantization`` (256 buckets over 6 sigma, each decoded as its bucket's mean) for tensors of
  at least ``EIGHT_BIT_MIN_VALUES`` values, fp16 below: the 1 KiB codebook of a part would outweigh what 8 bits save;
- ``quantile8bit``: the same with ``Quantile8BitQuantization`` (buckets at quantiles; slower to encode).

Every encoding is a deterministic function of the part's bits, and the exact round (``averaging``) uses the
decoded bits everywhere, so the codec changes what is averaged but never lets two participants differ.

``install_codecs`` repairs hivemind 1.1.12's 8-bit decoder for numpy 2 (it calls ``int()`` on a 1-element array,
which numpy 2 refuses): it replaces the two 8-bit entries of hivemind's decoding table with subclasses whose
``extract`` reads the codebook length as a scalar; the wire format is unchanged.
"""

from __future__ import annotations

import numpy as np
import torch
from hivemind.compression import (CompressionBase, CompressionInfo, Float16Compression, NoCompression,
                                  Quantile8BitQuantization, SizeAdaptiveCompression, Uniform8BitQuantization)
from hivemind.compression import serialization as _serialization
from hivemind.compression.adaptive import AdaptiveCompressionBase
from hivemind.proto import runtime_pb2

from swarmrun.protocol.spec import COMPRESSIONS

EIGHT_BIT_MIN_VALUES = 4096  # tensors smaller than this go as fp16 under ``8bit``/``quantile8bit``


class _Numpy2Extract:
    """hivemind's ``Quantization.extract`` with the codebook length read as a scalar (numpy 2)."""

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        codebook_size = int(np.frombuffer(serialized_tensor.buffer, count=1, dtype=np.int64)[0])
        codebook = np.frombuffer(serialized_tensor.buffer, offset=8, count=codebook_size, dtype=self.codebook_dtype)
        quantized = np.frombuffer(serialized_tensor.buffer, offset=8 + codebook.nbytes, dtype=self.indices_dtype)
        # copies: the buffer's views are read-only, which torch warns about (the decoded bits are the same)
        quantized = torch.from_numpy(quantized.astype(np.int64)).reshape(tuple(serialized_tensor.size))
        codebook = torch.from_numpy(codebook.copy()).to(dtype=getattr(torch, serialized_tensor.dtype))
        return codebook[quantized].requires_grad_(serialized_tensor.requires_grad)


class Uniform8Bit(_Numpy2Extract, Uniform8BitQuantization):
    """hivemind's uniform 8-bit quantization, decodable under numpy 2."""


class Quantile8Bit(_Numpy2Extract, Quantile8BitQuantization):
    """hivemind's quantile 8-bit quantization, decodable under numpy 2."""


class BFloat16(NoCompression):
    """fp32 rounded to bfloat16 (round to nearest even), sent as 2 bytes a value in hivemind's ``NONE`` format."""

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        if not torch.is_floating_point(tensor):
            raise ValueError(f"{self.__class__.__name__} does not support {tensor.dtype} tensors")
        raw = tensor.detach().cpu().to(torch.bfloat16).view(torch.int16)
        return runtime_pb2.Tensor(compression=self.compression_type, buffer=raw.numpy().tobytes(), size=tensor.shape,
                                  dtype="bfloat16", requires_grad=tensor.requires_grad)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return 0.5


def install_codecs() -> None:
    """Decode hivemind's 8-bit formats with the numpy-2 repair in this process (idempotent)."""
    table = _serialization._BASE_COMPRESSION_TYPES  # hivemind's decoding table: the receiver's only dispatch
    table["UNIFORM_8BIT"] = Uniform8Bit()
    table["QUANTILE_8BIT"] = Quantile8Bit()


def make_codec(name: str) -> CompressionBase:
    """The codec a run's spec names (``Spec.compression``).

    Raises:
        ValueError: a name not in ``protocol.spec.COMPRESSIONS`` (the spec refuses those already).
    """
    if name == "none":
        return NoCompression()
    if name == "fp16":
        return Float16Compression()
    if name == "bf16":
        return BFloat16()
    if name == "8bit":
        return SizeAdaptiveCompression(EIGHT_BIT_MIN_VALUES, less=Float16Compression(), greater_equal=Uniform8Bit())
    if name == "quantile8bit":
        return SizeAdaptiveCompression(EIGHT_BIT_MIN_VALUES, less=Float16Compression(), greater_equal=Quantile8Bit())
    raise ValueError(f"unknown compression {name!r} (known: {', '.join(COMPRESSIONS)})")


def chosen(codec: CompressionBase, info: CompressionInfo) -> CompressionBase:
    """The base codec ``codec`` applies to the tensor ``info`` describes."""
    while isinstance(codec, AdaptiveCompressionBase):
        codec = codec.choose_compression(info)
    return codec


def wire_format(codec: CompressionBase, info: CompressionInfo) -> tuple[int, str]:
    """(hivemind's compression type, dtype field) of a part of an fp32 tensor encoded by ``codec``: a sender's
    message must carry these, so the spec's codec binds every sender."""
    base = chosen(codec, info)
    return base.compression_type, ("bfloat16" if isinstance(base, BFloat16) else "float32")


def rounding_bound(codec: CompressionBase, info: CompressionInfo) -> float:
    """A bound on ``|decoded| / |x| - 1`` for a part ``x``: the slack of a sender's declared gradient norm (measured
    before encoding) when a reducer checks the decoded part against it. 8-bit bucket means never grow the norm
    (each bucket's mean squared, times its count, is at most the bucket's sum of squares)."""
    base = chosen(codec, info)
    if isinstance(base, BFloat16):
        return 2.0 ** -8
    if isinstance(base, Float16Compression):
        return 2.0 ** -11
    return 0.0
