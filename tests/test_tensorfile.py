"""One safetensors reader and writer (stoa.transport.tensorfile) for PULSE anchors, held states and
presets: every dtype of its one table round-trips through each, the third-party reader agrees,
and a streamed write hashes exactly the bytes it leaves on disk."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from stoa.fleet.trainer.heldstates import HeldStates
from stoa.transport import pulse, tensorfile


def every_dtype(rng: np.random.Generator) -> dict[str, np.ndarray]:
    out = {}
    for code, dt in tensorfile.DTYPES.items():
        raw = rng.integers(0, 256, 3 * 5 * dt.itemsize, dtype=np.uint8)
        a = raw.view(dt).reshape(3, 5) if code != "BOOL" else (raw[:15] & 1).astype(bool).reshape(3, 5)
        out[f"t.{code}"] = a
    out["empty"] = np.zeros((0, 4), tensorfile.DTYPES["BF16"])
    return out


def same(a, b) -> bool:
    return set(a) == set(b) and all(a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
                                    and a[k].tobytes() == b[k].tobytes() for k in a)


def test_every_dtype_round_trips_through_anchors_and_held_states(tmp_path):
    s = every_dtype(np.random.default_rng(0))
    assert same(pulse.decode_state(pulse.encode_state(s)), s)
    held = HeldStates(tmp_path, keep=1)
    held.put(1, s)
    assert same(HeldStates(tmp_path, keep=1).get(1), s)  # a fresh process re-hashes, then maps the file
    got = tensorfile.read((tmp_path / "v000000000001.safetensors").read_bytes())
    assert same(got.tensors, s) and got.metadata == {}


def test_a_streamed_write_hashes_what_it_wrote_and_others_read_it(tmp_path):
    rng = np.random.default_rng(1)
    arrays = {"a": rng.standard_normal((4, 6)).astype(np.float32), "b": np.arange(5, dtype=np.int64)}
    digest = hashlib.sha256()
    path = tmp_path / "x.safetensors"
    size = tensorfile.write(path, [(n, a.dtype, a.shape) for n, a in arrays.items()],
                            ([a[:2], a[2:]] for a in arrays.values()), metadata={"format": "pt"}, digest=digest)
    blob = path.read_bytes()
    assert size == len(blob) and digest.hexdigest() == hashlib.sha256(blob).hexdigest()
    assert blob == tensorfile.encode(arrays, {"format": "pt"})  # streamed and in-memory files are one format
    assert not list(tmp_path.glob("*.tmp"))
    st = pytest.importorskip("safetensors.numpy")
    assert same(st.load(blob), arrays)
    with pytest.raises(tensorfile.TensorFileError, match="wrote 8 bytes, expected 96"):
        tensorfile.write(tmp_path / "y.safetensors", [("a", np.dtype(np.float32), (4, 6))], [[b"\0" * 8]])
    assert not (tmp_path / "y.safetensors").exists()


def test_refusals_name_what_is_wrong():
    with pytest.raises(tensorfile.TensorFileError, match="unsupported dtype complex64"):
        tensorfile.encode({"c": np.zeros(2, np.complex64)})
    with pytest.raises(tensorfile.TensorFileError, match="invalid tensor name"):
        tensorfile.encode({"": np.zeros(2, np.float32)})
    blob = tensorfile.encode({"a": np.zeros(2, np.float32)})
    with pytest.raises(tensorfile.TensorFileError, match="no tensor claims"):
        tensorfile.read(blob + b"\0" * 8)
    with pytest.raises(tensorfile.TensorFileError, match="exceeds the file"):
        tensorfile.read(blob[:12])
