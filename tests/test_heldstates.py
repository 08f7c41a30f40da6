"""HeldStates: int8 states on disk, memory-mapped, atomic, pruned, surviving a restart, and
refusing a file that no longer matches its recorded hash."""

import ml_dtypes
import numpy as np
import pytest

from stoa.fleet.trainer.heldstates import CorruptStateError, HeldStates


def state(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "model.embed_tokens.weight": rng.integers(0, 256, (64, 128), dtype=np.uint8),
        "model.embed_tokens.scales": rng.standard_normal((64, 2)).astype(np.float32),
        "model.embed_tokens.biases": rng.standard_normal((64, 2)).astype(ml_dtypes.bfloat16),
        "model.norm.weight": np.ones(128, np.float32),
        "empty": np.zeros((0, 4), np.float16),
    }


def same(a, b) -> bool:
    return set(a) == set(b) and all(a[k].dtype == b[k].dtype and np.array_equal(a[k].view(np.uint8), b[k].view(np.uint8))
                                    for k in a)


def test_roundtrip_is_memory_mapped_and_read_only(tmp_path):
    h = HeldStates(tmp_path, keep=3)
    h.put(5, state(5))
    got = h.get(5)
    assert same(got, state(5)) and h.versions() == [5] and 5 in h and h.get(4) is None
    arr = got["model.embed_tokens.weight"]
    assert not arr.flags.writeable and not arr.flags.owndata
    with pytest.raises(ValueError):
        arr[0, 0] = 1
    with pytest.raises(ValueError, match="already held"):
        h.put(5, state(6))


def test_keeps_the_newest_and_prunes(tmp_path):
    h = HeldStates(tmp_path, keep=2)
    for v in range(5):
        h.put(v, state(v))
    assert h.versions() == [3, 4] and h.get(2) is None
    view = h.get(3)
    assert h.prune(4) == [3] and h.versions() == [4]
    assert same(view, state(3))  # a mapping taken before the prune stays readable
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v000000000004.json", "v000000000004.safetensors"]


def test_reopens_after_restart_and_cleans_half_writes(tmp_path):
    h = HeldStates(tmp_path, keep=4)
    h.put(1, state(1))
    h.put(2, state(2))
    # A crash after the data rename but before the marker, and a crash mid-write.
    (tmp_path / "v000000000003.safetensors").write_bytes((tmp_path / "v000000000002.safetensors").read_bytes())
    (tmp_path / "v000000000004.safetensors.tmp").write_bytes(b"partial")
    again = HeldStates(tmp_path, keep=4)
    assert again.versions() == [1, 2] and same(again.get(2), state(2))
    assert not (tmp_path / "v000000000003.safetensors").exists() and not list(tmp_path.glob("*.tmp"))
    assert HeldStates(tmp_path, keep=1).versions() == [2]  # a smaller keep trims on open


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corrupt_file_is_refused_and_quarantined(tmp_path, damage):
    HeldStates(tmp_path, keep=3).put(7, state(7))
    path = tmp_path / "v000000000007.safetensors"
    raw = bytearray(path.read_bytes())
    if damage == "flip":
        raw[-100] ^= 0xFF
        path.write_bytes(bytes(raw))
        h = HeldStates(tmp_path, keep=3)  # a fresh process verifies before its first read
        with pytest.raises(CorruptStateError, match="hash"):
            h.get(7)
    else:
        path.write_bytes(bytes(raw[:-10]))
        h = HeldStates(tmp_path, keep=3)
    assert h.versions() == [] and h.get(7) is None
    assert (tmp_path / "quarantine" / "v000000000007.reason").exists()


def test_rejects_bad_input(tmp_path):
    with pytest.raises(ValueError):
        HeldStates(tmp_path, keep=0)
    h = HeldStates(tmp_path, keep=2)
    with pytest.raises(ValueError, match="dtype"):
        h.put(1, {"x": np.array(["a"])})
    with pytest.raises(ValueError, match="version"):
        h.put(-1, state(0))
    assert h.versions() == []


def test_a_held_state_recorded_with_another_hash_is_replaced_when_that_version_is_published(tmp_path):
    from stoa.fleet.config import RolloutConfig
    from stoa.fleet.trainer.policies import HeldPolicies

    policies = HeldPolicies(tmp_path / "model", RolloutConfig(), max_lag=2, directory=tmp_path / "held")
    policies.keep(3, state(1), "hash-of-1")
    policies.keep(3, state(2), "hash-of-2")  # the store serves label 3 with other weights
    reopened = HeldStates(tmp_path / "held", keep=3)
    assert same(reopened.get(3), state(2)) and reopened.state_hash(3) == "hash-of-2"
    data = tmp_path / "held" / "v000000000003.safetensors"
    inode = data.stat().st_ino
    policies.keep(3, state(2), "hash-of-2")  # the same: nothing rewritten
    assert data.stat().st_ino == inode and same(HeldStates(tmp_path / "held", keep=3).get(3), state(2))
    policies.keep(3, state(1))  # no hash to compare: the state given replaces what is held
    assert same(HeldStates(tmp_path / "held", keep=3).get(3), state(1))
