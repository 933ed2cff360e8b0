"""run/framelog.py: the bytes on disk, and telling a crash's torn tail from corruption."""

from __future__ import annotations

import os
import zlib

import pytest

from ckptlab.errors import CorruptFileError
from ckptlab.run import framelog, records


def write_log(path, frames):
    w = framelog.FrameWriter(path)
    for kind, step, payload, flags in frames:
        w.append(kind, step, payload, flags=flags)
    w.close()
    return path.read_bytes()


FRAMES = [(framelog.BATCH, 0, b"first", 0), (framelog.STEP, 0, b"second payload", 2), (framelog.EVENT, 1, b"{}", 0)]


def test_bytes_on_disk_are_as_documented(tmp_path):
    """The layout docs/run-format.md specifies, spelled out byte by byte."""
    data = write_log(tmp_path / "s000-000000000.log", [(framelog.STEP, 5, b"abc", framelog.FLAG_SAFETENSORS)])
    fields = (
        b"CKF2"  # frame magic
        + b"\x02"  # kind: STEP
        + b"\x02"  # flags: bit1 = safetensors payload
        + b"\x00\x00"  # rank 0 (u16)
        + (5).to_bytes(8, "little")  # step (i64)
        + (3).to_bytes(4, "little")  # payload length (u32)
        + zlib.crc32(b"abc").to_bytes(4, "little")  # crc32 of the stored payload (u32)
    )
    assert data == (
        b"ckptlab-log-v2\n\x00"  # 16-byte file header
        + fields
        + zlib.crc32(fields).to_bytes(4, "little")  # crc32 of the 24 header bytes before it (u32)
        + b"abc"
    )
    (ref,) = framelog.scan(tmp_path / "s000-000000000.log").frames
    assert (ref.offset, ref.kind, ref.step, ref.length) == (16 + 28, framelog.STEP, 5, 3)


def test_segments_of_run_format_1_are_read(tmp_path):
    """Segments written before the header CRC (file header ckptlab-log-v1, 24-byte frame
    headers) read as they did, torn tail and damage included."""
    frames = [
        framelog.pack_frame(kind, step, payload, flags=flags, layout=framelog.LOG_V1)
        for kind, step, payload, flags in FRAMES
    ]
    assert frames[0][:4] == b"CKF1" and len(frames[0]) == 24 + len(b"first")
    path = tmp_path / "old.log"
    path.write_bytes(b"ckptlab-log-v1\n\x00" + b"".join(frames) + frames[0][:10])
    scan = framelog.scan(path, verify=True)
    assert [(f.kind, f.step) for f in scan.frames] == [(k, n) for k, n, _, _ in FRAMES]
    assert (scan.torn_bytes, scan.corrupt) == (10, None)
    assert [p for _, p in framelog.iter_payloads(path)] == [p for _, _, p, _ in FRAMES]
    assert scan.frames[1].read_payload() == (b"second payload", 2)


def test_a_segment_of_a_newer_ckptlab_says_so(tmp_path):
    path = tmp_path / "new.log"
    path.write_bytes(b"ckptlab-log-v9\n\x00")
    with pytest.raises(CorruptFileError, match="newer ckptlab"):
        framelog.scan(path)


def test_every_torn_tail_is_skipped_and_counted(tmp_path):
    full = write_log(tmp_path / "full.log", FRAMES)
    ends, pos = [], 16
    for _, _, payload, _ in FRAMES:
        pos += 28 + len(payload)
        ends.append(pos)
    cut_path = tmp_path / "cut.log"
    for cut in range(len(full) + 1):  # a kill can stop a write after any byte
        cut_path.write_bytes(full[:cut])
        scan = framelog.scan(cut_path, verify=True)
        complete = [e for e in ends if e <= cut]
        assert len(scan.frames) == len(complete), cut
        assert scan.torn_bytes == cut - (complete[-1] if complete else (16 if cut >= 16 else 0))
        assert scan.corrupt is None


def test_a_full_length_last_frame_with_a_bad_crc_is_a_torn_tail(tmp_path):
    """A power loss can leave the last frame's length allocated but its bytes zero."""
    full = bytearray(write_log(tmp_path / "a.log", FRAMES))
    full[-2:] = b"\x00\x00"
    (tmp_path / "a.log").write_bytes(bytes(full))
    scan = framelog.scan(tmp_path / "a.log")
    assert len(scan.frames) == 2 and scan.torn_bytes == 28 + 2 and scan.corrupt is None


def test_damage_before_the_tail_is_corruption_not_a_torn_tail(tmp_path):
    path = tmp_path / "a.log"
    clean = write_log(path, FRAMES)
    second = 16 + 28 + len(FRAMES[0][2])  # offset of the second frame

    bad = bytearray(clean)
    bad[second + 28 + 3] ^= 0xFF  # a bit flip in the second frame's payload
    path.write_bytes(bytes(bad))
    scan = framelog.scan(path)  # headers only: the frames are all indexed ...
    assert len(scan.frames) == 3
    with pytest.raises(CorruptFileError, match=r"a\.log: frame for step 0 at byte \d+ fails its CRC"):
        scan.frames[1].read_payload()  # ... and the damaged one refuses to be read
    verified = framelog.scan(path, verify=True)
    assert len(verified.frames) == 1 and "fails its CRC" in verified.corrupt

    bad = bytearray(clean)
    bad[second] = ord("X")  # a damaged frame header, with good frames after it
    path.write_bytes(bytes(bad))
    scan = framelog.scan(path)
    assert len(scan.frames) == 1 and "bad frame header" in scan.corrupt


def test_not_a_log_segment(tmp_path):
    path = tmp_path / "s000-000000000.log"
    path.write_bytes(b"PK\x03\x04 this is a zip file, not a log")
    with pytest.raises(CorruptFileError, match="not a ckptlab log segment"):
        framelog.scan(path)
    path.write_bytes(b"ckptlab-l")  # killed while writing the file header: an empty log
    assert framelog.scan(path).frames == []


def test_a_segment_is_never_appended_to_twice(tmp_path):
    write_log(tmp_path / "a.log", FRAMES)
    with pytest.raises(FileExistsError):
        framelog.FrameWriter(tmp_path / "a.log")


def test_compression_is_used_only_where_it_pays():
    compress = records.Compressor()
    tokens = bytes(range(50)) * 400  # token ids: repetitive
    noise = os.urandom(20_000)  # float activations: incompressible
    assert compress(tokens)[1] & framelog.FLAG_ZLIB
    compress_noise = records.Compressor()
    data, flags = compress_noise(noise)
    assert not flags & framelog.FLAG_ZLIB and data == noise


def test_inflate_is_capped_and_refuses_bad_zlib(tmp_path):
    inflate = framelog.inflate
    data = zlib.compress(bytes(1000))
    assert inflate(data, path=tmp_path, step=1) == bytes(1000)
    with pytest.raises(CorruptFileError, match="step 4: compressed payload inflates to more than 999 bytes"):
        inflate(data, path=tmp_path, step=4, limit=999)
    with pytest.raises(CorruptFileError, match="not valid zlib data"):
        inflate(b"not zlib", path=tmp_path, step=4)
    with pytest.raises(CorruptFileError, match="cut short"):
        inflate(data[:-6], path=tmp_path, step=4)


def test_compressor_stores_payloads_over_the_inflate_limit_raw(monkeypatch):
    monkeypatch.setattr(records, "MAX_INFLATED", 5000)
    compress = records.Compressor()
    assert compress(bytes(5001)) == (bytes(5001), records.FLAG_SAFETENSORS)
    assert compress(bytes(5000))[1] == records.FLAG_SAFETENSORS | records.FLAG_ZLIB


def test_small_payloads_are_stored_as_is_and_the_rest_inflates_with_any_zlib_reader(tmp_path):
    compress = records.Compressor()
    for n in (1000, records.MIN_COMPRESS - 1):  # not worth zlib's time on the training thread
        small = (bytes(range(50)) * (n // 50 + 1))[:n]
        assert compress(small) == (small, records.FLAG_SAFETENSORS)
    for n in (records.MIN_COMPRESS, 5000, 40_000, 1 << 15, (1 << 15) - 1):  # small windows, and the default
        payload = (bytes(range(50)) * (n // 50 + 1))[:n]
        data, flags = compress(payload)
        assert flags & framelog.FLAG_ZLIB and len(data) < len(payload) / 5
        assert zlib.decompress(data) == payload == framelog.inflate(data, path=tmp_path, step=1)
