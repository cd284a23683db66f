"""The all-reduce codecs (``node.peer.codecs``): deterministic encodings, hivemind's wire format, decodable here."""

import pytest
import torch
from hivemind.compression import CompressionInfo, deserialize_torch_tensor
from hivemind.proto import runtime_pb2

from swarmrun.node.peer import codecs
from swarmrun.protocol.spec import COMPRESSIONS

codecs.install_codecs()


def encode(codec, x):
    return codec.compress(x, CompressionInfo.from_tensor(x))


@pytest.mark.parametrize("name", COMPRESSIONS)
@pytest.mark.parametrize("shape", [(5000,), (7, 13), (1,), (0,)])
def test_decoding_is_a_deterministic_function_of_the_bits(name, shape):
    codec = codecs.make_codec(name)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(3))
    first, second = encode(codec, x), encode(codec, x.clone())
    assert first.SerializeToString() == second.SerializeToString()
    decoded = deserialize_torch_tensor(first)
    assert decoded.shape == x.shape and bool(torch.isfinite(decoded).all())
    info = CompressionInfo.from_tensor(x)
    assert (first.compression, first.dtype) == codecs.wire_format(codec, info)
    if x.numel():
        bound = codecs.rounding_bound(codec, info)
        assert float(decoded.float().norm()) <= float(x.norm()) * (1 + bound) + 1e-6


@pytest.mark.parametrize("name", ["8bit", "quantile8bit"])
def test_eight_bit_sends_a_quarter_for_large_tensors_and_fp16_for_small(name):
    codec = codecs.make_codec(name)
    big, small = torch.randn(codecs.EIGHT_BIT_MIN_VALUES * 4), torch.randn(100)
    assert len(encode(codec, big).buffer) < 0.27 * 4 * big.numel()
    assert encode(codec, small).compression == runtime_pb2.FLOAT16
    err = (deserialize_torch_tensor(encode(codec, big)) - big).norm() / big.norm()
    assert float(err) < 0.05


@pytest.mark.parametrize("x", [torch.zeros(5000), torch.full((5000,), 2.5), torch.tensor([3.0])])
def test_eight_bit_degenerate_parts_decode_exactly(x):
    for base in (codecs.Uniform8Bit(), codecs.Quantile8Bit()):
        assert torch.equal(deserialize_torch_tensor(encode(base, x)), x)


def test_bf16_is_two_bytes_a_value_and_rounds_to_nearest():
    x = torch.randn(1000)
    message = encode(codecs.make_codec("bf16"), x)
    assert len(message.buffer) == 2 * x.numel() and message.dtype == "bfloat16"
    assert torch.equal(deserialize_torch_tensor(message).float(), x.to(torch.bfloat16).float())


def test_unknown_name_is_refused():
    with pytest.raises(ValueError, match="unknown compression"):
        codecs.make_codec("int4")
