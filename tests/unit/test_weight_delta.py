"""Deltas between weight versions (arlo/model/weight_delta.py) and their files
(arlo/model/weight_files.py): a delta applied onto its base gives the next version's exact bytes,
the layout reader finds every array the packer wrote (flax's chunked arrays too), and a torn,
corrupted or misplaced envelope is refused before it is applied."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from arlo.model import weights
from arlo.model.weight_delta import (
    apply_delta,
    encode_delta,
    full,
    pack,
    payload_regions,
    sha256_hex,
    unpack,
)
from arlo.model.weight_files import VersionFiles, read_version, storage_dir


def _state(scale: float = 1.0, bump: int = 0) -> nnx.State:
    a = jnp.linspace(-1, 1, 3000, dtype=jnp.float32) * scale
    if bump:
        a = a.at[::bump].add(1e-2)
    return nnx.State({"a": nnx.Param(a.reshape(30, 100)), "b": {"c": nnx.Param(jnp.ones((7, 5), jnp.bfloat16))},
                      "i": nnx.Variable(jnp.arange(9, dtype=jnp.int32))})


def test_a_delta_applied_onto_its_base_is_the_next_version_exactly() -> None:
    old, new = (weights.state_to_bytes(_state(bump=b), "bfloat16") for b in (0, 7))
    env = encode_delta(old, new, version=5, base_version=4, sha256=sha256_hex(new))
    assert env is not None and env.kind == "delta"
    # Counted independently of the layout reader: the arrays as msgpack restores them, bit for bit.
    a, b = weights._unpack(old), weights._unpack(new)
    changed = sum(int(np.count_nonzero(a[k].view(np.uint8).reshape(a[k].size, -1)
                                       != b[k].view(np.uint8).reshape(b[k].size, -1), axis=1).astype(bool).sum())
                  for k in a)
    assert env.changed == changed > 0 and env.elements == 3000 + 35 + 9
    buf = bytearray(old)
    got = unpack(pack(env))
    assert (got.version, got.base_version, got.sha256) == (5, 4, sha256_hex(new))
    apply_delta(buf, got)
    assert bytes(buf) == new


def test_the_layout_reader_finds_every_array_the_packer_wrote(monkeypatch: pytest.MonkeyPatch) -> None:
    # Arrays above flax's chunk size are written as maps of chunks: made small here to see one.
    monkeypatch.setattr(weights, "CHUNKED_ABOVE", 1024)
    state = _state()
    data = weights.state_to_bytes(state, "bfloat16")
    regions = payload_regions(data)
    assert [r.nbytes for r in regions] == [1024, 1024, 1024, 1024, 1024, 880, 70, 36]  # a: 6000 B in chunks
    assert all(data[r.offset : r.offset + r.nbytes] == data[r.offset : r.offset + r.nbytes] for r in regions)
    restored = weights.state_from_bytes(data, nnx.State({"a": nnx.Param(jnp.zeros((30, 100), jnp.bfloat16)),
                                                         "b": {"c": nnx.Param(jnp.zeros((7, 5), jnp.bfloat16))},
                                                         "i": nnx.Variable(jnp.zeros(9, jnp.int32))}))
    # Zeroing every region the reader found zeroes every array: nothing of an array lies outside.
    zeroed = bytearray(data)
    for r in regions:
        zeroed[r.offset : r.offset + r.nbytes] = bytes(r.nbytes)
    assert float(jnp.abs(restored["a"][...].astype(jnp.float32)).sum()) > 0
    blank = weights.state_from_bytes(bytes(zeroed), restored)
    assert all(not np.asarray(leaf).any() for leaf in (blank["a"][...], blank["b"]["c"][...], blank["i"][...]))


def test_payloads_of_other_layouts_get_no_delta() -> None:
    old = weights.state_to_bytes(_state(), "bfloat16")
    other = weights.state_to_bytes(nnx.State({"z": nnx.Param(jnp.ones(3029, jnp.bfloat16))}), "bfloat16")
    assert encode_delta(old, other[: len(old)] if len(other) >= len(old) else other, version=2, base_version=1,
                        sha256="x") is None


def test_bad_envelopes_are_refused_before_they_are_applied() -> None:
    old, new = (weights.state_to_bytes(_state(bump=b), "bfloat16") for b in (0, 3))
    packed = bytearray(pack(encode_delta(old, new, version=2, base_version=1, sha256=sha256_hex(new))))
    with pytest.raises(ValueError, match="torn"):
        unpack(packed[:-3])
    flipped = bytearray(packed)
    flipped[-5] ^= 0xFF
    with pytest.raises(ValueError, match="corrupted"):
        unpack(flipped)
    with pytest.raises(ValueError, match="bad magic"):
        unpack(b"garbage" * 4)
    with pytest.raises(ValueError, match="fits a"):
        apply_delta(bytearray(old[:-1]), unpack(packed))
    with pytest.raises(ValueError, match="not a delta"):
        apply_delta(bytearray(old), unpack(pack(full(new, version=2, sha256=sha256_hex(new)))))


def test_files_are_whole_or_absent_and_pruned_behind_the_previous_full(tmp_path) -> None:
    uri = f"file://{tmp_path}/w"
    files = VersionFiles(uri)
    for v in range(1, 6):
        files.write(v, "full" if v in (1, 4) else "delta", b"x" * v)
    assert read_version(uri, 3, "delta") == b"xxx"
    (storage_dir(uri) / "000000000009.full.999999.tmp").write_bytes(b"half")  # a writer killed mid-write
    files.prune(4)
    assert sorted(p.name for p in storage_dir(uri).iterdir()) == ["000000000004.full", "000000000005.delta"]
    with pytest.raises(ValueError, match="file:///"):
        VersionFiles("s3://bucket/w")


def test_a_writer_killed_mid_write_leaves_no_version(tmp_path) -> None:
    uri = f"file://{tmp_path}"
    # The writer's file object stops after its first part, saying so: killed there, mid-write.
    code = ("import builtins, time; from arlo.model.weight_files import VersionFiles\n"
            f"f = VersionFiles({uri!r})\n"
            "orig = open\n"
            "class W:\n"
            "    def __init__(s, f): s.f = f\n"
            "    def __enter__(s): return s\n"
            "    def __exit__(s, *a): s.f.close()\n"
            "    def write(s, b): s.f.write(b); s.f.flush(); print('writing', flush=True); time.sleep(60)\n"
            "    def flush(s): s.f.flush()\n"
            "    def fileno(s): return s.f.fileno()\n"
            "builtins.open = lambda p, m='r', *a, **k: W(orig(p, m))\n"
            "f.write(7, 'full', b'y' * (1 << 20), b'z')\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "writing"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    names = [p.name for p in tmp_path.iterdir()]
    assert names and all(n.endswith(".tmp") for n in names)  # the half-written file never took the name
    with pytest.raises(FileNotFoundError):
        read_version(uri, 7, "full")
    VersionFiles(uri).prune(0)
    deadline = time.monotonic() + 5
    while any(tmp_path.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(tmp_path.iterdir())


def test_prune_keeps_a_live_writers_temporary_file_and_two_writers_never_share_one(tmp_path) -> None:
    """Two trainers of a run can write the same version for a moment (one that lost the run while
    paused, and its successor), both often pid 1 in their containers: their temporary files must
    differ, and neither's prune may remove the other's file mid-write."""
    uri = f"file://{tmp_path}"
    mine, theirs = VersionFiles(uri), VersionFiles(uri)
    assert mine.tag != theirs.tag and mine.tag.split("_")[1] == theirs.tag.split("_")[1]  # one pid, two writers
    writing = tmp_path / "000000000003.full.otherhost_1_0123abcd.tmp"  # another pod's write in progress
    writing.write_bytes(b"half")
    dead_here = tmp_path / "000000000003.full.{}_{}_89abcdef.tmp".format(mine.tag.split("_")[0], 2**22 + 7)
    dead_here.write_bytes(b"half")  # a writer of this host whose pid is gone
    abandoned = tmp_path / "000000000002.full.otherhost_1_fedcba98.tmp"
    abandoned.write_bytes(b"half")
    old = time.time() - 2 * 3600
    os.utime(abandoned, (old, old))
    mine.write(3, "full", b"x")
    mine.prune(0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["000000000003.full", writing.name]
