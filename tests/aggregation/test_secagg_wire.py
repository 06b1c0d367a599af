"""Secure aggregation messages survive the wire unchanged; malformed ones are refused."""

import numpy as np
import pytest

from shoal.aggregation.secagg import SecAggClient, SecAggParams, SecAggServer
from shoal.aggregation.secagg import crypto as C
from shoal.aggregation.secagg.tiers import SEALED_KIND, RootKey, open_message
from shoal.aggregation.secagg.wire import decode_message, encode_message
from shoal.errors import Malformed, WireError
from shoal.wire import encode


def over_the_wire(msg, size):
    return decode_message(encode_message(msg), size)


def test_a_whole_round_through_the_wire_codec_gives_the_exact_sum():
    size, ids = 50, ["a", "b", "c", "d"]
    params = SecAggParams(b"wire", size)
    server = SecAggServer(params, ids)
    clients = {c: SecAggClient(c, params, C.Randomness(c.encode())) for c in ids}
    inputs = {c: np.full(size, i + 1, np.uint32) for i, c in enumerate(ids)}
    for c in ids:
        server.receive_keys(over_the_wire(clients[c].advertise_keys(), size))
    for c, d in server.close_advertise().items():
        server.receive_shares(over_the_wire(clients[c].share_keys(over_the_wire(d, size)), size))
    for c, d in server.close_share().items():
        if c != "d":  # d drops before masking
            server.receive_masked(over_the_wire(clients[c].masked_input(over_the_wire(d, size), inputs[c]), size))
    for c, r in server.close_masked().items():
        server.receive_unmask(over_the_wire(clients[c].unmask(over_the_wire(r, size)), size))
    result = server.finish()
    assert result.dropped == ["d"]
    assert np.array_equal(result.total, np.full(size, 1 + 2 + 3, np.uint32))


def test_malformed_messages_raise_wire_errors():
    with pytest.raises(Malformed, match="not a secure aggregation message"):
        decode_message(encode({}, {"kind": "nonsense"}), 4)
    with pytest.raises(Malformed, match="enc_key: expected base64 of 32 bytes"):
        decode_message(encode({}, {"kind": "public_keys", "sender": "a", "enc_key": "AAAA", "mask_key": "AAAA"}), 4)
    with pytest.raises(Malformed, match="enc_key: expected base64 of 32 bytes"):  # not ASCII: was a 500 (fuzzer)
        decode_message(encode({}, {"kind": "public_keys", "sender": "a", "enc_key": "\u03cf" * 44, "mask_key": "A"}), 4)
    root = RootKey.new(C.Randomness())
    sealed = encode({}, {"kind": SEALED_KIND, "sender": "a", "sealed": "\u03cf" * 64, "meta": {}})
    with pytest.raises(Malformed, match="does not open under the root's key"):  # the sealed field, likewise
        open_message(sealed, root, b"session", "a", 1 << 16)
    with pytest.raises(Malformed, match=r"self_mask\['b'\]"):
        decode_message(
            encode({}, {"kind": "unmask_shares", "sender": "a", "self_mask": {"b": [2**31] * 16}, "mask_key": {}}), 4
        )
    from shoal.aggregation.secagg import MaskedInput

    body = encode_message(MaskedInput("a", np.zeros(8, np.uint32)))
    with pytest.raises(WireError, match="shape"):
        decode_message(body, 9)
