"""The library's files: written atomically and readable by others, read with errors that name the file."""

import errno
import io
import os
import re
import stat
import struct
import zipfile
import zlib

import numpy as np
import pytest

import moelayers as ml
from moelayers.files import atomic_write, file_mode, read_npz
from moelayers.planning.gem import LatencyCurves, evaluate, score
from moelayers.planning.steps import LoadWindow
from moelayers.trace import RoutingTrace, load_trace, save_trace


def _trace(seq_offsets=(0, 5, 20), dtype=np.int64) -> RoutingTrace:
    ids = np.zeros((20, 1, 2), dtype)
    ids[:, 0, 1] = 1
    return RoutingTrace(ids, np.arange(20) % 7, np.asarray(seq_offsets, dtype), 4)


def test_atomic_write_gives_plain_permissions_and_leaves_nothing_on_failure(tmp_path):
    old = os.umask(0o022)
    try:
        save_trace(_trace(), tmp_path / "t.npz")
        LatencyCurves.preset("high", 2).save(tmp_path / "c.npz")
        ml.ExpertPlacement.linear(4, 2).save(tmp_path / "p.npz")
    finally:
        os.umask(old)
    for name in ("t.npz", "c.npz", "p.npz"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o644, name
    (tmp_path / "keep.bin").write_bytes(b"old")

    def boom(f):
        f.write(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(tmp_path / "keep.bin", boom)
    assert (tmp_path / "keep.bin").read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.npz", "keep.bin", "p.npz", "t.npz"]
    with pytest.raises(FileNotFoundError, match="does not exist"):
        atomic_write(tmp_path / "no" / "x.bin", lambda f: None)


def test_atomic_write_never_changes_the_umask(tmp_path, monkeypatch):
    """Reading the umask with os.umask sets it for a moment: other threads would create files with
    the wrong permissions. A new file still gets a plain open()'s 0o666 & ~umask."""
    old = os.umask(0o027)

    def no_umask(mask):
        raise AssertionError("os.umask called")

    try:
        monkeypatch.setattr(os, "umask", no_umask)
        assert file_mode() == 0o640
        atomic_write(tmp_path / "new.bin", lambda f: f.write(b"x"))
        monkeypatch.undo()
        os.umask(0o002)  # group-writable: 0o666 & ~umask, not a fixed 0o644
        atomic_write(tmp_path / "group.bin", lambda f: f.write(b"x"))
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "new.bin").stat().st_mode) == 0o640
    assert stat.S_IMODE((tmp_path / "group.bin").stat().st_mode) == 0o664


def test_atomic_write_keeps_the_permissions_of_an_existing_file(tmp_path):
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"old")
    secret.chmod(0o600)
    atomic_write(secret, lambda f: f.write(b"new"))
    assert secret.read_bytes() == b"new" and stat.S_IMODE(secret.stat().st_mode) == 0o600


def test_atomic_write_writes_through_a_symlink(tmp_path):
    (tmp_path / "target.bin").write_bytes(b"old")
    (tmp_path / "latest.bin").symlink_to("target.bin")
    assert atomic_write(tmp_path / "latest.bin", lambda f: f.write(b"new")) == tmp_path / "latest.bin"
    assert (tmp_path / "latest.bin").is_symlink() and (tmp_path / "target.bin").read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest.bin", "target.bin"]


def test_atomic_write_a_name_at_the_length_limit(tmp_path):
    """The temporary file's name does not grow with the destination's."""
    long = tmp_path / ("t" * (os.pathconf(tmp_path, "PC_NAME_MAX") - 4) + ".npz")
    save_trace(_trace(), long)
    assert load_trace(long).num_tokens == 20 and [p.name for p in tmp_path.iterdir()] == [long.name]


def _damaged_deflate(path):
    """A compressed npz with bytes flipped inside the deflate stream of a.npy (zlib.error)."""
    np.savez_compressed(path, a=np.arange(2000) % 7)
    with zipfile.ZipFile(path) as z:
        info = z.getinfo("a.npy")
    start = info.header_offset + 30 + len(info.filename) + len(info.extra)
    data = bytearray(path.read_bytes())
    for i in range(start + 5, start + 25):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def _huge_header(path):
    """A .npy member whose header claims 2**40 rows (reading it would allocate terabytes)."""
    raw = io.BytesIO()
    np.save(raw, np.zeros((3, 2), np.int16))
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("a.npy", raw.getvalue().replace(b"(3, 2)", b"(1099511627776, 2)"))


def _raw_member(path):
    """A member that is not a .npy array: np.load would return its bytes."""
    with zipfile.ZipFile(path, "w") as z:
        raw = io.BytesIO()
        np.save(raw, np.arange(4))
        z.writestr("phy2log.npy", raw.getvalue())
        z.writestr("num_experts", b"4")


@pytest.mark.parametrize("make, member", [(_damaged_deflate, "a.npy"), (_huge_header, "a.npy"),
                                          (_raw_member, "num_experts")])
def test_read_npz_damaged_members_name_the_file_and_member(tmp_path, make, member):
    make(tmp_path / "bad.npz")
    with pytest.raises(ValueError, match=rf"bad\.npz: cannot read member '{member}'"):
        read_npz(tmp_path / "bad.npz", "thing")


def test_read_npz_names_the_file(tmp_path):
    np.save(tmp_path / "a.npy", np.zeros(3))
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    for name in ("a.npy", "junk.npz"):
        for load in (lambda p: read_npz(p, "thing"), LatencyCurves.load, ml.ExpertPlacement.load, load_trace):
            with pytest.raises(ValueError, match=name):
                load(tmp_path / name)
    with pytest.raises(FileNotFoundError, match="missing.npz"):
        LatencyCurves.load(tmp_path / "missing.npz")


def test_unsigned_fields_do_not_wrap_around():
    with pytest.raises(ValueError, match="non-decreasing"):
        _trace((0, 15, 5, 20), np.uint64)
    t = _trace((0, 5, 20), np.uint64)
    assert t.topk_ids.dtype == np.int16 and t.seq_offsets.dtype == np.int64
    with pytest.raises(ValueError, match="strictly ascending"):
        LatencyCurves(np.array([0, 256, 128], np.uint64), np.ones((1, 3)))


def test_tiled_curve_files_must_be_whole_and_consistent(tmp_path):
    good = LatencyCurves.preset("high", 4)
    good.save(tmp_path / "good.npz")
    assert LatencyCurves.load(tmp_path / "good.npz").tiled_params is not None
    arrays = read_npz(tmp_path / "good.npz", "curves")
    np.savez(tmp_path / "partial.npz", **{k: v for k, v in arrays.items() if k != "base_s"})
    with pytest.raises(ValueError, match=r"partial\.npz: tiled curve parameters .* without \['base_s'\]"):
        LatencyCurves.load(tmp_path / "partial.npz")
    np.savez(tmp_path / "mismatch.npz", **{**arrays, "scale": np.ones(2)})
    with pytest.raises(ValueError, match=r"mismatch\.npz: the tiled parameters \(scale for 2 ranks\) disagree"):
        LatencyCurves.load(tmp_path / "mismatch.npz")
    np.savez(tmp_path / "tile.npz", **{**arrays, "tile": np.float64(128.7)})
    with pytest.raises(ValueError, match=r"tile\.npz: 'tile' must be an integer"):
        LatencyCurves.load(tmp_path / "tile.npz")
    with pytest.raises(ValueError, match=r"good\.npz: latency curves are for 4 ranks"):
        LatencyCurves.load(tmp_path / "good.npz").check_ranks(8)


def test_scores_refuse_assignments_they_cannot_mean():
    curves = LatencyCurves.preset("moderate", 8)
    loads = np.ones((3, 8))
    with pytest.raises(ValueError, match="integers"):
        score(np.arange(8) / 8 + 0.9, loads, curves)  # float ranks are not truncated
    trace = _trace()
    with pytest.raises(ValueError, match="2 of the curves' 8 ranks"):
        evaluate(trace, np.array([[0, 0, 1, 1]]), curves, 4)  # an EP2 assignment scored with EP8 curves
    assert evaluate(trace, np.array([[0, 1, 0, 1]]), LatencyCurves.preset("high", 2), 4) > 0


def test_load_window_checks_expert_ids():
    w = LoadWindow(1, 4)
    with pytest.raises(ValueError, match="expert id 9 outside"):
        w.push_topk(np.array([[[0, 9]]]))
    with pytest.raises(ValueError, match="expert id -1 outside"):
        w.push_topk([np.array([[0, -1]])])
    with pytest.raises(TypeError, match="integers"):
        w.push_topk([np.array([[0.0, 1.0]])])
    w.push_topk([np.array([[0, 3], [3, 1]])])
    np.testing.assert_array_equal(w.loads()[0, 0], [1, 1, 0, 2])


def test_placement_file_checks_its_scalars(tmp_path):
    np.savez(tmp_path / "p.npz", phy2log=np.arange(4).reshape(2, 2), num_experts=np.float64(4.9))
    with pytest.raises(ValueError, match=r"p\.npz: 'num_experts' must be an integer scalar"):
        ml.ExpertPlacement.load(tmp_path / "p.npz")
    np.savez(tmp_path / "q.npz", phy2log=np.arange(4).reshape(2, 2), num_experts=np.int64(3))
    with pytest.raises(ValueError, match=r"q\.npz: invalid placement"):
        ml.ExpertPlacement.load(tmp_path / "q.npz")


def test_read_npz_says_what_a_foreign_file_is_not(tmp_path):
    """A text or empty file named .npz was reported as 'pickled (object) data' by np.load."""
    for name, content in (("notes.npz", b"rows,latency\n1,2\n"), ("empty.npz", b""), ("pk.npz", b"PK")):
        (tmp_path / name).write_bytes(content)
        with pytest.raises(ValueError, match=rf"{name}: not an npz archive \(it starts with b'") as info:
            read_npz(tmp_path / name, "thing")
        assert "pickle" not in str(info.value)


def test_read_npz_refuses_sizes_the_stored_bytes_cannot_hold(tmp_path):
    """A 300-byte file whose zip entry and .npy header agree on 2 TiB: a bare MemoryError naming no file."""
    n = 2 ** 41
    npy = _npy_header(n)
    path = tmp_path / "placement.npz"
    path.write_bytes(_zip64_member("phy2log.npy", npy + b"\x00" * 8, len(npy) + n, method=0))
    with pytest.raises(ValueError, match=r"placement\.npz: .*claims 2199023255\d+ bytes from \d+ stored bytes"):
        ml.ExpertPlacement.load(path)


def test_paths_that_are_not_files(tmp_path):
    """A folder or a pipe was 'not found'; atomic_write into a folder named its temporary file, after
    writing everything."""
    with pytest.raises(IsADirectoryError, match=rf"{tmp_path} is a directory, not a placement file"):
        ml.ExpertPlacement.load(tmp_path)
    fifo = tmp_path / "pipe.npz"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="is not a regular file"):
        read_npz(fifo, "latency curve file")
    (tmp_path / "out.npz").mkdir()
    written = []
    with pytest.raises(IsADirectoryError, match=r"out\.npz is a directory"):
        atomic_write(tmp_path / "out.npz", written.append)
    assert written == [] and sorted(p.name for p in tmp_path.iterdir()) == ["out.npz", "pipe.npz"]


def test_atomic_write_names_the_destination_on_os_errors(tmp_path, monkeypatch):
    import moelayers.files as files

    def denied(folder, name):
        raise PermissionError(13, "Permission denied", str(folder / f".{name}.0123.tmp"))

    monkeypatch.setattr(files, "_create_temp", denied)
    with pytest.raises(PermissionError, match=rf"{tmp_path / 'new.npz'}: cannot write \(Permission denied\)"):
        ml.ExpertPlacement.linear(4, 2).save(tmp_path / "new.npz")


def test_placements_of_many_experts_and_big_endian_tables(tmp_path):
    """num_experts beyond the slots was refused only after allocating E (500 MiB at 10**7, an
    allocator error at 2**40); a big-endian table (numpy on such a host) did not load."""
    import time

    np.savez(tmp_path / "huge.npz", phy2log=np.arange(4).reshape(2, 2), num_experts=np.int64(2 ** 40))
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=r"huge\.npz: invalid placement \(a placement of \(2, 2\) = 4 slots cannot hold"):
        ml.ExpertPlacement.load(tmp_path / "huge.npz")
    assert time.perf_counter() - t0 < 1.0
    np.savez(tmp_path / "be.npz", phy2log=np.arange(4).reshape(2, 2).astype(">i8"), num_experts=np.int64(4))
    assert ml.ExpertPlacement.load(tmp_path / "be.npz") == ml.ExpertPlacement.linear(4, 2)
    for bad in (3.0, True):
        with pytest.raises(ValueError, match="slots_per_rank must be a positive int"):
            ml.ExpertPlacement.linear(2, 2, slots_per_rank=bad)
    p = ml.ExpertPlacement.linear(4, 2)
    with pytest.raises(ValueError, match=r"rank must be an int in \[0, 2\), got -1"):
        p.experts_on(-1)  # answered for the last rank
    with pytest.raises(TypeError, match="moves_to needs an ExpertPlacement, got NoneType"):
        p.moves_to(None)


def test_eplb_arguments_are_checked():
    from moelayers.planning.eplb import balanced_packing, plan_eplb

    for bad in (True, 2.0, 1.5, -1):
        with pytest.raises(ValueError, match="num_replicas must be an int >= 0"):
            plan_eplb(np.ones((2, 4)), 2, num_replicas=bad)
    with pytest.raises(ValueError, match="weights must be"):
        balanced_packing(np.array([1.0, np.nan, 2.0, 3.0]), 2)
    with pytest.raises(ValueError, match=r"item_group must be \[N=4\]"):
        balanced_packing(np.ones(4), 2, item_group=np.array([0, 1]))


def _zip64_member(name: str, data: bytes, claimed_size: int, method: int) -> bytes:
    """A zip of one member (method 0: stored, 8: deflated; ``data`` already compressed) whose zip64
    sizes claim ``claimed_size`` bytes uncompressed."""
    fname, crc = name.encode(), zlib.crc32(data) if method == 0 else 0  # a deflated one is never read to its end
    extra = struct.pack("<HHQQ", 1, 16, claimed_size, len(data))
    local = struct.pack("<IHHHHHIIIHH", 0x04034B50, 45, 0, method, 0, 0x21, crc, 0xFFFFFFFF, 0xFFFFFFFF,
                        len(fname), len(extra)) + fname + extra
    central = struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 45, 45, 0, method, 0, 0x21, crc, 0xFFFFFFFF, 0xFFFFFFFF,
                          len(fname), len(extra), 0, 0, 0, 0, 0) + fname + extra
    body = local + data
    return body + central + struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, 1, 1, len(central), len(body), 0)


def _npy_header(n: int) -> bytes:
    header = ("{'descr': '|i1', 'fortran_order': False, 'shape': (%d,), }" % n).encode("latin1")
    header += b" " * (64 - (10 + len(header) + 1) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header


def _deflated_npz(path, ratio: float) -> None:
    """An npz of one deflated member whose zip entry and .npy header agree on ``ratio`` times its
    compressed size (real deflate gives at most about 1032:1)."""
    n = 10 ** 6
    for _ in range(3):  # the compressed size depends (barely) on the claimed size written in the header
        comp = zlib.compressobj(9, zlib.DEFLATED, -15)
        raw = comp.compress(_npy_header(n) + b"\x00" * 4096) + comp.flush()
        n = int(ratio * len(raw)) + 1024 - len(_npy_header(n))
    path.write_bytes(_zip64_member("phy2log.npy", raw, len(_npy_header(n)) + n, method=8))


@pytest.mark.parametrize("ratio", [1500.0, 2.0 ** 41 / 100])
def test_read_npz_refuses_a_deflated_member_claiming_more_than_deflate_can_give(tmp_path, ratio):
    """The deflate bound (_MAX_DEFLATE_RATIO = 1100, about 1032:1 in real deflate): a deflated member
    whose zip entry and .npy header agree on 1500x (or 2 TiB from ~100 bytes) its compressed size is
    refused by its sizes, before numpy allocates and inflates it."""
    path = tmp_path / "placement.npz"
    _deflated_npz(path, ratio)
    with pytest.raises(ValueError, match=r"placement\.npz: .*claims \d+ bytes from \d+ stored bytes, "
                                         r"more than its compression can give"):
        ml.ExpertPlacement.load(path)


def test_read_npz_names_the_file_when_numpy_runs_out_of_memory(tmp_path, monkeypatch):
    """A member within the size bounds that still cannot be allocated: a ValueError naming the file
    and member, not a bare MemoryError."""
    ml.ExpertPlacement.linear(4, 2).save(tmp_path / "p.npz")

    def no_memory(*args, **kwargs):
        raise MemoryError("Unable to allocate 1.00 TiB")

    monkeypatch.setattr(np.lib.format, "read_array", no_memory)
    with pytest.raises(ValueError, match=r"p\.npz: cannot read member 'phy2log\.npy'.*Unable to allocate"):
        read_npz(tmp_path / "p.npz", "placement file")


def test_atomic_write_fsyncs_the_folder_after_the_rename(tmp_path, monkeypatch):
    """By default the file is flushed and then the folder holding the rename; fsync=False flushes nothing."""
    kinds = []
    real = os.fsync

    def spy(fd):
        kinds.append("dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        return real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    atomic_write(tmp_path / "a.bin", lambda f: f.write(b"x"))
    assert kinds == ["file", "dir"]
    kinds.clear()
    atomic_write(tmp_path / "b.bin", lambda f: f.write(b"x"), fsync=False)
    assert kinds == []


@pytest.mark.parametrize("code", [errno.EINVAL, errno.EOPNOTSUPP])
def test_a_file_system_that_cannot_flush_still_takes_the_file(tmp_path, monkeypatch, code):
    """fsync by default failed every save on a mount that refuses fsync (EINVAL), where commit_files'
    own flush passed over it; a disk error (EIO) still fails the save, naming the file."""
    from recipes._outputs import commit_files

    def refuse(fd):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "fsync", refuse)
    ml.ExpertPlacement.linear(4, 2).save(tmp_path / "p.npz")
    assert ml.ExpertPlacement.load(tmp_path / "p.npz").num_experts == 4
    commit_files(tmp_path / "run", {"a.json": lambda p: p.write_text("{}")})
    assert (tmp_path / "run" / "a.json").read_text() == "{}"

    def eio(fd):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fsync", eio)
    with pytest.raises(OSError, match=re.escape(f"{tmp_path / 'q.npz'}: cannot write (Input/output error)")):
        ml.ExpertPlacement.linear(4, 2).save(tmp_path / "q.npz")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.npz", "run"]


def test_atomic_write_names_the_destination_when_the_rename_fails(tmp_path, monkeypatch):
    """A failing os.replace names the caller's file (not the temporary one) and leaves no temporary file."""
    def refused(src, dst):
        raise PermissionError(13, "Permission denied", str(src))

    monkeypatch.setattr(os, "replace", refused)
    with pytest.raises(PermissionError, match=rf"{tmp_path / 'new.npz'}: cannot write \(Permission denied\)"):
        ml.ExpertPlacement.linear(4, 2).save(tmp_path / "new.npz")
    assert list(tmp_path.iterdir()) == []


def test_experts_on_refuses_a_rank_past_the_last():
    """experts_on(num_ranks) is refused like experts_on(-1) (the upper bound of [0, R))."""
    p = ml.ExpertPlacement.linear(4, 2)
    assert p.experts_on(1) == [2, 3]
    for bad in (2, 3, True, 1.0):
        with pytest.raises(ValueError, match=rf"rank must be an int in \[0, 2\), got {bad!r}"):
            p.experts_on(bad)


def test_balanced_packing_refuses_negative_weights_and_non_int_pack_counts():
    """Negative weights packed 'lighter than empty'; num_packs=2.0 / True passed the divisibility test."""
    from moelayers.planning.eplb import balanced_packing

    with pytest.raises(ValueError, match=r"weights must be \[N\] finite numbers >= 0, got shape \[4\] with min -1\.0"):
        balanced_packing(np.array([1.0, -1.0, 2.0, 3.0]), 2)
    for bad in (2.0, True, "2"):
        with pytest.raises(ValueError, match=rf"num_packs must be an int, got {bad!r}"):
            balanced_packing(np.ones(4), bad)
    balanced_packing(np.ones(4), np.int64(2))  # numpy ints are fine


def test_a_damaged_zip_directory_is_refused_not_read_short(tmp_path):
    """A damaged central-directory entry (here its comment length) made zipfile stop listing members
    early: load_trace returned the trace without its weights and with another vocab_size, no error."""
    from moelayers.trace import RoutingTrace, load_trace, save_trace

    t = RoutingTrace(np.array([[[0, 1]], [[2, 3]]]), np.array([5, 7]), np.array([0, 2]), 4,
                     topk_weights=np.full((2, 1, 2), 0.5, np.float32), vocab_size=1000)
    save_trace(t, tmp_path / "t.npz")
    raw = bytearray((tmp_path / "t.npz").read_bytes())
    entries = [i for i in range(len(raw)) if raw[i:i + 4] == b"PK\x01\x02"]
    struct.pack_into("<H", raw, entries[3] + 32, 0xFFFF)
    (tmp_path / "damaged.npz").write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=r"damaged\.npz: damaged zip directory: it lists 4 of the 7 members"):
        load_trace(tmp_path / "damaged.npz")
    assert load_trace(tmp_path / "t.npz").vocab_size == 1000


def test_expert_ids_are_kept_compact(tmp_path):
    """A recorded trace holds int64 expert ids: planning a 1M-token one peaked at 3.3 GB for 1.3 GB of
    ids. They are now int16 in memory and in the file (int32 beyond 32,768 experts); narrower stays."""
    t = _trace()
    assert t.topk_ids.dtype == np.int16
    save_trace(t, tmp_path / "t.npz")
    assert np.load(tmp_path / "t.npz")["topk_ids"].dtype == np.int16
    np.testing.assert_array_equal(load_trace(tmp_path / "t.npz").topk_ids, _trace().topk_ids.astype(np.int64))
    wide = RoutingTrace(np.full((4, 1, 2), 40_000, np.int64) + np.arange(2), np.arange(4), np.array([0, 4]), 40_002)
    assert wide.topk_ids.dtype == np.int32 and int(wide.topk_ids.max()) == 40_001
    small = RoutingTrace(np.zeros((4, 1, 2), np.uint8) + np.arange(2, dtype=np.uint8), np.arange(4), np.array([0, 4]), 8)
    assert small.topk_ids.dtype == np.uint8


def test_a_file_name_that_is_not_utf8_can_be_saved(tmp_path):
    """A name as os.listdir returns it for Latin-1 bytes (caf\\udce9.npz) could be loaded but not
    saved: the temporary file's name was made with str.encode (an environment journey)."""
    import os

    from moelayers.files import atomic_write

    long = ("a" + "\u00e9" * 40).encode() + b".npz"  # byte 64 falls inside a character
    for raw in (b"caf\xe9.npz", long):
        path = tmp_path / os.fsdecode(raw)
        atomic_write(path, lambda f: f.write(b"x"))
        assert path.read_bytes() == b"x"
    assert sorted(os.fsencode(p.name) for p in tmp_path.iterdir()) == sorted([b"caf\xe9.npz", long])


# ------------------------------------------------------------------------- format versions
def _with(path, **entries):
    """Rewrite the npz at ``path`` with ``entries`` added or replaced (``None`` removes one)."""
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    for k, v in entries.items():
        if v is None:
            arrays.pop(k, None)
        else:
            arrays[k] = v
    np.savez(path, **arrays)
    return path


def _written(tmp_path):
    """One file of each kind the library reads, written by its writer: name -> (path, reader)."""
    from moelayers.planning.semantic import SemanticPlan, plan_semantic
    from moelayers.trace import synthetic_trace

    plan = plan_semantic(synthetic_trace(24, 2, 8, 2, 50, seq_len=(4, 12), seed=0), 2, "dp", progress=False)
    files = {"trace": (save_trace, _trace(), load_trace), "placement": (None, ml.ExpertPlacement.linear(4, 2),
                                                                       ml.ExpertPlacement.load),
             "curves": (None, LatencyCurves.preset("high", 2), LatencyCurves.load),
             "plan": (None, plan, SemanticPlan.load)}
    out = {}
    for name, (save, obj, load) in files.items():
        path = tmp_path / f"{name}.npz"
        save(obj, path) if save else obj.save(path)
        out[name] = (path, load)
    return out


def test_every_file_records_its_format_and_a_newer_one_is_told_as_such(tmp_path):
    """A file of a newer moelayers was refused for its new field ("unknown field(s)"), read while
    ignoring it (curves, placements: a changed meaning read the old way), or read as the current
    format (the plan when the number came after the field check)."""
    from moelayers import __version__

    for name, (path, load) in _written(tmp_path).items():
        with np.load(path) as z:
            version = int(z["format_version"])
        assert version >= 1, name
        assert load(path) is not None
        _with(path, format_version=np.int64(version + 1), added_in_a_later_version=np.arange(3))
        with pytest.raises(ValueError, match=rf"{path.name}: this .* is of format {version + 1}, written by a newer "
                                             rf"moelayers; this one \({__version__}\) reads formats up to {version}"):
            load(path)
        for bad in (np.int64(0), np.int64(-7), np.float64(1.0), np.arange(2)):
            _with(path, format_version=bad, added_in_a_later_version=None)
            with pytest.raises(ValueError, match="format_version must be a positive integer scalar"):
                load(path)


def test_a_file_of_another_kind_is_told_as_such(tmp_path):
    """plan.py writes plan.npz, assignment.npz and curves.npz side by side; plan.npz (format 3)
    handed to the trace, placement or curve reader (format 1) was "written by a newer moelayers:
    upgrade", and the others got "missing key(s)" without a word of what the file was."""
    from recipes.serve import layer_placements

    files = _written(tmp_path)
    assignment = tmp_path / "assignment.npz"
    np.savez(assignment, expert_rank=np.zeros((2, 4), np.int64), token_rank=np.zeros((6, 2), np.int64),
             seq_offsets=np.array([0, 6]), num_ranks=np.int64(2), format_version=np.int64(1))
    files["assignment"] = (assignment, lambda path: layer_placements(str(path), 4, 2))
    said = {"trace": "a routing trace", "plan": r"a semantic plan \(plan.py's plan.npz\)",
            "placement": r"a placement file \(ExpertPlacement.save\)", "curves": "a latency curve file",
            "assignment": "plan.py's assignment.npz"}
    for reader, (_, load) in files.items():
        for kind, (path, _) in files.items():
            if kind == reader or (reader, kind) == ("assignment", "placement"):  # serve.py reads either
                assert load(path) is not None, (reader, kind)
                continue
            with pytest.raises(ValueError, match=rf"{path.name}: not a .* but {said[kind]}.*: (read it|pass it)"):
                load(path)


def test_a_placement_handed_to_another_reader_is_sent_where_it_is_read(tmp_path):
    """The message named bench.py's layer.placement_path, which bench.py refuses ("read by
    recipes/serve.py only")."""
    files = _written(tmp_path)
    placement, _ = files["placement"]
    with pytest.raises(ValueError, match=r"serve.py as layer.placement_path=FILE") as caught:
        LatencyCurves.load(placement)
    assert "bench.py as" not in str(caught.value)


def test_files_written_before_the_format_version_still_load(tmp_path):
    import warnings

    for name, (path, load) in _written(tmp_path).items():
        first = load(path)
        _with(path, format_version=None)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            again = load(path)
        if name in ("trace", "placement", "plan"):
            assert again == first, name


def test_unknown_entries_of_placements_and_curves_are_named_in_a_warning(tmp_path):
    """They were dropped silently: an entry a newer version added would be read the old way."""
    files = _written(tmp_path)
    for name, kind in (("placement", "placement files"), ("curves", "latency curve files")):
        path, load = files[name]
        _with(path, units=np.str_("ms"))
        with pytest.warns(UserWarning, match=rf"{path.name}: ignoring key\(s\) \['units'\] that {kind} do not have"):
            load(path)


def test_a_profile_curves_file_loads_without_warnings(tmp_path):
    import warnings

    from recipes.profile import save_curves

    save_curves(str(tmp_path / "c.npz"), [1, 128], np.array([[1e-5, 2e-5]] * 2), ["cpu", "cpu"],
                np.array([[1e-5, 2.1e-5]] * 2), config={"a": 1})
    with np.load(tmp_path / "c.npz") as z:
        assert int(z["format_version"]) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert LatencyCurves.load(tmp_path / "c.npz").num_ranks == 2


def test_a_trace_compares_by_content_with_its_saved_copy(tmp_path):
    trace = _trace()
    save_trace(trace, tmp_path / "t.npz")
    loaded = load_trace(tmp_path / "t.npz")
    assert loaded == trace and loaded is not trace
    with np.load(tmp_path / "t.npz") as z:  # the arrays of a file (format_version included) and to_arrays() build one
        assert RoutingTrace(**z) == trace == RoutingTrace(**trace.to_arrays())
        with pytest.raises(ValueError, match="this routing trace is of format 2, written by a newer moelayers"):
            RoutingTrace(**{**z, "format_version": np.int64(2)})
    other = _trace(seq_offsets=(0, 6, 20))
    assert loaded != other and (loaded == "a trace") is False


def test_a_read_only_file_is_not_replaced(tmp_path, monkeypatch):
    """``os.replace`` replaced a file made read-only to keep it (``open(path, "wb")`` would refuse)."""
    path = tmp_path / "keep.npz"
    ml.ExpertPlacement.linear(4, 2).save(path)
    before = path.read_bytes()
    os.chmod(path, 0o444)
    real_access = os.access
    if os.geteuid() == 0:  # root may write anything: as open() would for it, so pretend a user
        monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if mode == os.W_OK else real_access(p, mode, **kw))
    with pytest.raises(PermissionError, match=r"keep.npz: the file may not be written \(mode 0o444\): not replaced"):
        ml.ExpertPlacement.linear(4, 1).save(path)
    assert path.read_bytes() == before and sorted(os.listdir(tmp_path)) == ["keep.npz"]



def test_a_full_disk_or_a_cut_file_is_told_with_the_file(tmp_path):
    """A write failing with ENOSPC / EIO named no file; a member cut short said "()"."""
    import errno

    def full(f):
        f.write(b"half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(OSError, match=r"p\.npz: cannot write \(No space left on device\)"):
        atomic_write(tmp_path / "p.npz", full)
    assert os.listdir(tmp_path) == []
    with pytest.raises(FileNotFoundError, match="source.bin") as info:  # a writer's error about another file: its own
        atomic_write(tmp_path / "p.npz", lambda f: f.write(open(tmp_path / "source.bin", "rb").read()))
    assert info.value.filename == str(tmp_path / "source.bin") and os.listdir(tmp_path) == []
    save_trace(_trace(), tmp_path / "t.npz")
    data = (tmp_path / "t.npz").read_bytes()
    (tmp_path / "cut.npz").write_bytes(data[:len(data) // 2] + data[-200:])  # members cut, directory kept
    with pytest.raises(ValueError, match=r"cut\.npz: .*\((?!\)).+\)"):
        load_trace(tmp_path / "cut.npz")


def test_a_pipe_as_an_input_file_is_told_so(tmp_path):
    from recipes._common import check_input_file

    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(ValueError, match=r"trace\.path=.*fifo is not a regular file \(a pipe or a device\?\)"):
        check_input_file(str(tmp_path / "fifo"), "trace.path", "a routing trace file")
    os.symlink(tmp_path / "loop", tmp_path / "loop")
    with pytest.raises(FileNotFoundError, match="is a symbolic link that loops"):
        check_input_file(str(tmp_path / "loop"), "trace.path", "a routing trace file")
