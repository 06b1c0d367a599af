"""Signed task bundles, the format (shoal/bundle.py) and the model a server runs from one
(shoal/bundle_model.py): round trips, every limit, and a fuzz of the verifier (byte flips,
truncations, hostile manifests signed with a trusted key): a BundleError each time, never
another exception, never a bundle accepted that differs from what was signed."""

from __future__ import annotations

import hashlib
import os
import random
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from shoal import bundle as fmt
from shoal.bundle_cli import read_folder
from shoal.bundle_model import BundledModel, initial_state, state_module
from shoal.params import ParamSpec

KEY = fmt.new_private_key()
TRUSTED = [fmt.public_key_text(KEY)]
CODE = {"task.py": b"from lib.util import X\n", "lib/util.py": b"X = 1\n"}


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.Flatten(), nn.Linear(2 * 4 * 4, 3))


MODEL = initial_state(small_model())
BLOB = fmt.pack(CODE, "task.py:task", KEY, MODEL)


def resigned(manifest: fmt.Manifest, files: dict[str, bytes], key=KEY) -> bytes:
    return fmt.assemble(manifest, key.sign(fmt.SIGNED_CONTEXT + manifest.to_bytes()), files)


def test_a_bundle_round_trips_with_its_hashes_and_identity():
    b = fmt.verify(BLOB, TRUSTED)
    assert b.files == {**CODE, fmt.MODEL_FILE: MODEL}
    assert b.sha256 == hashlib.sha256(BLOB).hexdigest() and b.entry_file == "task.py"
    assert [f.name for f in b.manifest.files] == ["lib/util.py", "task.py", fmt.MODEL_FILE]
    assert fmt.pack(CODE, "task.py:task", KEY, MODEL) == BLOB  # Ed25519 is deterministic: same files, same bundle


def test_untrusted_unsigned_and_forged_bundles_are_refused_with_their_reason():
    with pytest.raises(fmt.BundleError, match="a key this node does not trust"):
        fmt.verify(BLOB, [fmt.public_key_text(fmt.new_private_key())])
    with pytest.raises(fmt.BundleError, match="does not trust"):
        fmt.verify(BLOB, [])
    m, sig, b = fmt.read(BLOB)
    with pytest.raises(fmt.BundleError, match="unsigned"):
        fmt.read(fmt.assemble(m, b"", b.files))
    with pytest.raises(fmt.BundleError, match="signature does not verify"):  # another key's signature, this key named
        other = fmt.new_private_key()
        fmt.verify(fmt.assemble(m, other.sign(fmt.SIGNED_CONTEXT + m.to_bytes()), b.files), TRUSTED)
    with pytest.raises(fmt.BundleError, match="signature does not verify"):  # the signature without the context
        fmt.verify(fmt.assemble(m, KEY.sign(m.to_bytes()), b.files), TRUSTED)


@pytest.mark.parametrize(
    "name",
    ["/etc/passwd", "../x.py", "a/../b.py", "a//b.py", ".hidden.py", "-x.py", "a/./b.py", "a\\b.py", "é.py", ""]
    + ["x" * 161, "/".join(["d"] * 9) + ".py", "a b.py", "a\x00.py"],
)
def test_names_are_relative_plain_and_bounded(name):
    with pytest.raises(fmt.BundleError):
        fmt.check_name(name)
    with pytest.raises(fmt.BundleError):
        fmt.pack({name: b"x", "task.py": b""}, "task.py:task", KEY, MODEL)


def test_every_limit_and_field_is_checked():
    with pytest.raises(fmt.BundleError, match="1 to 64 files"):
        fmt.pack({f"m{i}.py": b"" for i in range(64)}, "m0.py:task", KEY, MODEL)
    with pytest.raises(fmt.BundleError, match="over the limit"):
        fmt.pack({"task.py": b"x" * (fmt.MAX_CODE_BYTES + 1)}, "task.py:task", KEY, MODEL)
    with pytest.raises(fmt.BundleError, match="over the limit of 1000"):
        fmt.read(BLOB, max_bytes=1000)
    for entry in ("task.py", "nope.py:task", "lib/util.py:1x", "task.py:a.b", fmt.MODEL_FILE + ":x"):
        with pytest.raises(fmt.BundleError, match="entry"):
            fmt.pack(CODE, entry, KEY, MODEL)
    with pytest.raises(fmt.BundleError, match="twice"):
        fmt.pack({"Task.py": b"", "task.py": b""}, "task.py:task", KEY, MODEL)
    with pytest.raises(fmt.BundleError, match="also a folder"):
        fmt.pack({"lib": b"", "lib/x.py": b"", "task.py": b""}, "task.py:task", KEY, MODEL)
    with pytest.raises(fmt.BundleError, match="own name"):
        fmt.pack({fmt.MODEL_FILE: b"", "task.py": b""}, "task.py:task", KEY, MODEL)
    m, _, b = fmt.read(BLOB)
    files = dict(b.files)
    reordered = fmt.Manifest(m.publisher, m.entry, (m.files[2], m.files[0], m.files[1]))
    with pytest.raises(fmt.BundleError, match="last file"):
        fmt.verify(resigned(reordered, files), TRUSTED)
    with pytest.raises(fmt.BundleError, match="canonical"):
        body = m.to_bytes().replace(b'{"entry"', b'{ "entry"')
        blob = fmt.MAGIC + struct.pack(">I", len(body)) + body + BLOB[len(fmt.MAGIC) + 4 + len(m.to_bytes()) :]
        fmt.read(blob)


def test_publisher_keys_are_written_one_way():
    text = fmt.public_key_text(KEY)
    assert fmt.parse_public_key(text) is not None and text.startswith("ed25519:") and len(text) == 52
    for bad in ("", "ed25519:", text[:-1] + "A", "rsa:" + text[8:], text + "A", None, 7, "ed25519:" + "!" * 44):
        with pytest.raises(fmt.BundleError):
            fmt.parse_public_key(bad)
    with pytest.raises(fmt.BundleError):
        fmt.load_private_key(b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n")
    assert fmt.public_key_text(fmt.load_private_key(fmt.private_key_pem(KEY))) == text


def test_a_folder_is_packed_without_links_hidden_files_or_caches(tmp_path):
    (tmp_path / "lib").mkdir()
    (tmp_path / "task.py").write_text("x = 1\n")
    (tmp_path / "lib" / "util.py").write_text("y = 2\n")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "config").write_text("secret")
    (tmp_path / "__pycache__").mkdir()
    (tmp_path / "__pycache__" / "task.cpython-311.pyc").write_bytes(b"\0")
    assert read_folder(tmp_path) == {"task.py": b"x = 1\n", "lib/util.py": b"y = 2\n"}
    assert read_folder(tmp_path / "task.py") == {"task.py": b"x = 1\n"}
    os.symlink("/etc/passwd", tmp_path / "passwd.py")
    with pytest.raises(fmt.BundleError, match="symbolic link"):
        read_folder(tmp_path)
    os.unlink(tmp_path / "passwd.py")
    os.symlink("/etc", tmp_path / "etc")
    with pytest.raises(fmt.BundleError, match="symbolic link"):
        read_folder(tmp_path)


def test_every_byte_flip_and_truncation_is_refused():
    """Seeded: 400 random single-bit flips anywhere, and a cut at 300 random lengths (and at every
    length of the head): each one a BundleError from verify."""
    rng = random.Random(7)
    head = len(BLOB) - len(MODEL) - sum(map(len, CODE.values()))
    spots = list(range(head)) + [rng.randrange(len(BLOB)) for _ in range(400)]
    for at in spots:
        bad = bytearray(BLOB)
        bad[at] ^= 1 << rng.randrange(8)
        with pytest.raises(fmt.BundleError):
            fmt.verify(bytes(bad), TRUSTED)
    for n in list(range(head + 1)) + [rng.randrange(len(BLOB)) for _ in range(300)]:
        with pytest.raises(fmt.BundleError):
            fmt.verify(BLOB[:n], TRUSTED)
    with pytest.raises(fmt.BundleError):
        fmt.verify(BLOB + b"\0", TRUSTED)


JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)
FIELD = st.sampled_from(["name", "size", "sha256"])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    what=st.sampled_from(["entry", "publisher", "format", "files", "file", "extra", "size"]),
    value=JSONISH,
    field=FIELD,
)
def test_hostile_manifests_signed_by_a_trusted_key_are_refused_not_crashed(what, value, field):
    """The signature holds (a trusted publisher's own mistakes, or a stolen key): every field is
    still checked; anything else than a valid bundle is a BundleError."""
    import json

    m, _, b = fmt.read(BLOB)
    doc = json.loads(m.to_bytes())
    if what == "file":
        doc["files"][0][field] = value
    elif what == "extra":
        doc["x"] = value
    elif what == "size":
        doc["files"][1]["size"] = value if isinstance(value, int) else 10**12
    else:
        doc[what] = value
    body = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    sig = KEY.sign(fmt.SIGNED_CONTEXT + body)
    blob = fmt.MAGIC + struct.pack(">I", len(body)) + body + struct.pack(">H", 64) + sig + b"".join(b.files.values())
    try:
        out = fmt.verify(blob, TRUSTED + [str(value)])
    except fmt.BundleError:
        return
    assert out.manifest.to_bytes() == body  # accepted only as exactly what was signed, files matching
    assert all(hashlib.sha256(out.files[f.name]).hexdigest() == f.sha256 for f in out.manifest.files)


def test_the_servers_stand_in_model_has_the_real_models_layout():
    model = small_model()
    m = state_module(MODEL)
    assert ParamSpec.of(m).with_base(m).hash == ParamSpec.of(model).with_base(model).hash
    assert torch.equal(m.state_dict()["3.weight"], model.state_dict()["3.weight"])
    assert ParamSpec.of(BundledModel(MODEL).model()).numel == ParamSpec.of(model).numel
    with pytest.raises(fmt.BundleError, match="over the limit of 10"):
        state_module(MODEL, max_parameters=10)
    frozen = small_model()
    frozen[0].weight.requires_grad_(False)
    with pytest.raises(fmt.BundleError, match="frozen"):
        initial_state(frozen)


@pytest.mark.parametrize(
    "tensors, spec",
    [
        ({"a": torch.tensor([float("nan")])}, [["a", [1]]]),
        ({"a": torch.zeros(2, dtype=torch.float64)}, [["a", [2]]]),
        ({"a": torch.zeros(2)}, [["a", [3]]]),
        ({"a": torch.zeros(2)}, [["b", [2]]]),
        ({"a.b": torch.zeros(1), "a": torch.zeros(1)}, [["a.b", [1]], ["a", [1]]]),
        ({"a.b": torch.zeros(1), "c": torch.zeros(1)}, [["a.b", [1]], ["c", [1]]]),  # not a module's state order
        ({"__class__": torch.zeros(1)}, [["__class__", [1]]]),
        ({"a": torch.zeros(1)}, "not json"),
        ({"a": torch.zeros(1)}, [["a", [-1]]]),
        ({"a": torch.zeros(1)}, []),
    ],
)
def test_a_hostile_initial_model_is_refused(tensors, spec):
    import json

    from safetensors.torch import save

    data = save(tensors, metadata={"spec": spec if isinstance(spec, str) else json.dumps(spec)})
    with pytest.raises(fmt.BundleError):
        state_module(data)
    with pytest.raises(fmt.BundleError):
        state_module(data[: len(data) // 2])
