"""Hostile log segments (journal/, batches/): bounded memory and time, one clear error."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import pytest

from ckptlab.run import framelog
from tests.hostile.conftest import refused, refused_by_api

MiB = 1 << 20
FIELDS = struct.Struct("<4sBBHqII")  # a frame header's fields as documented (run-format.md), both layouts


def raw_header(layout, kind: int, step: int, length: int, crc: int, *, header_crc_ok: bool = True) -> bytes:
    """A frame header claiming anything: v2's own CRC made to pass (or not)."""
    fields = FIELDS.pack(layout.frame_magic, kind, 0, 0, step, length, crc)
    if layout is framelog.LOG_V1:
        return fields
    return fields + struct.pack("<I", zlib.crc32(fields) ^ (0 if header_crc_ok else 1))


def zlib_zeros(n_mib: int) -> bytes:
    """A valid zlib stream of `n_mib` MiB of zeros, built without compressing them all: after
    a full flush, every further MiB of zeros compresses to the same bytes."""
    co = zlib.compressobj(9)
    first = co.compress(bytes(MiB)) + co.flush(zlib.Z_FULL_FLUSH)
    block = co.compress(bytes(MiB)) + co.flush(zlib.Z_FULL_FLUSH)
    assert co.compress(bytes(MiB)) + co.flush(zlib.Z_FULL_FLUSH) == block
    n = n_mib * MiB
    adler = (((n % 65521) << 16) | 1).to_bytes(4, "big")  # adler32 of n zero bytes
    return first + block * (n_mib - 1) + b"\x03\x00" + adler  # an empty final block, then the check


def frame(kind: int, step: int, payload: bytes, flags: int = 0, *, into: Path | None = None) -> bytes:
    """A frame in the layout of the segment `into` (default: the current one)."""
    layout = framelog.LAYOUTS[into.read_bytes()[:16]] if into is not None else framelog.LOG_V2
    return framelog.pack_frame(kind, step, payload, flags=flags, layout=layout)


def test_zlib_stream_helper():
    assert zlib.decompress(zlib_zeros(3)) == bytes(3 * MiB)


def test_decompression_bomb_in_the_journal(sample_run):
    """8 MB that inflate to 8 GiB: refused at framelog.MAX_INFLATED, naming segment and step."""
    last = sorted((sample_run / "journal").glob("s*.log"))[-1]
    bomb = zlib_zeros(8 << 10)
    assert len(bomb) < 10 * MiB
    with open(last, "ab") as f:
        f.write(frame(framelog.STEP, 7777, bomb, framelog.FLAG_ZLIB | framelog.FLAG_SAFETENSORS, into=last))
    refused(sample_run, "info", "--run", sample_run, names=last.name, says="step 7777")


def test_decompression_bomb_in_a_batch(sample_run):
    seg = sorted((sample_run / "batches" / "rank0").glob("s*.log"))[-1]
    bomb = zlib_zeros(8 << 10)
    framed = frame(framelog.BATCH, 6000, bomb, framelog.FLAG_ZLIB | framelog.FLAG_SAFETENSORS, into=seg)
    with open(seg, "ab") as f:
        f.write(framed)
    call = f"ckptlab.open_run({str(sample_run)!r}).batch(6000)"
    refused_by_api(sample_run, call, names=seg.name, says="step 6000")


def crafted_scan_segment(path: Path, size: int = 4 * MiB) -> None:
    """A damaged first frame, then a frame-like header every 28 bytes whose payload claims to
    run to near the end of the file (each passes its header CRC and fails its payload CRC),
    then one intact frame: checking each header's CRC over its own payload costs O(size^2)."""
    layout = framelog.LOG_V2
    buf = bytearray(layout.file_magic)
    buf += b"XXXX" + bytes(layout.header_size - 4)  # a damaged frame header
    tail = frame(framelog.EVENT, 3, b'{"kind":"x"}')
    while len(buf) + 2 * layout.header_size + len(tail) < size:
        pos = len(buf)
        buf += raw_header(layout, framelog.STEP, 1, size - len(tail) - pos - layout.header_size - 1, 0)
    buf += bytes(size - len(tail) - len(buf)) + tail
    path.write_bytes(bytes(buf))


def test_quadratic_damage_scan(sample_run):
    first = sorted((sample_run / "journal").glob("s*.log"))[0]
    crafted_scan_segment(first)
    r = refused(sample_run, "info", "--run", sample_run, names=first.name, says="intact frames after it")
    assert r.seconds < 20


@pytest.mark.parametrize("layout", [framelog.LOG_V1, framelog.LOG_V2], ids=["v1", "v2"])
def test_intact_frame_search_matches_the_direct_check(layout):
    """The linear search gives the same answer as checking every candidate's CRCs directly."""
    import random

    hsize = layout.header_size

    def direct(data, start):
        i = data.find(layout.frame_magic, start)
        while i != -1 and i + hsize <= len(data):
            _, kind, _, _, _, length, crc = FIELDS.unpack_from(data, i)
            end = i + hsize + length
            header_ok = layout is framelog.LOG_V1 or zlib.crc32(data[i : i + 24]) == int.from_bytes(
                data[i + 24 : i + 28], "little"
            )
            if (
                header_ok
                and kind in framelog.KIND_NAMES
                and end <= len(data)
                and zlib.crc32(data[i + hsize : end]) == crc
            ):
                return True
            i = data.find(layout.frame_magic, i + 1)
        return False

    rng = random.Random(0)
    for _ in range(500):
        parts = []
        for _ in range(rng.randint(0, 6)):
            payload = rng.randbytes(rng.randint(0, 30))
            crc = zlib.crc32(payload) if rng.random() < 0.3 else rng.getrandbits(32)
            length = len(payload) if rng.random() < 0.7 else rng.randint(0, 80)
            kind = rng.choice([1, 2, 3, 4, 9])
            parts.append(raw_header(layout, kind, 1, length, crc, header_crc_ok=rng.random() < 0.8))
            parts.append(payload + rng.randbytes(rng.randint(0, 10) if rng.random() < 0.3 else 0))
        data = b"".join(parts)
        start = rng.randint(0, 5)
        assert framelog._intact_frame_after(data, start, layout) == direct(data, start)


def test_a_flipped_step_is_damage_not_a_step(tmp_path):
    """The header's own CRC: a step changed on disk (one bit) is not read as another step."""
    path = tmp_path / "s000-000000000.log"
    w = framelog.FrameWriter(path)
    for n in range(3):
        w.append(framelog.STEP, n, b"x" * 10)
    w.close()
    data = bytearray(path.read_bytes())
    second = 16 + framelog.LOG_V2.header_size + 10
    data[second + 8 + 4] ^= 0x01  # bit 32 of the second frame's step: 1 -> 2**32 + 1
    path.write_bytes(bytes(data))
    scan = framelog.scan(path)
    assert [f.step for f in scan.frames] == [0]
    assert "bad frame header at byte 54, with intact frames after it" in scan.corrupt
