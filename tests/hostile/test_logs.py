"""Hostile log segments (journal/, batches/): bounded memory and time, one clear error."""

from __future__ import annotations

import zlib
from pathlib import Path

from ckptlab.run import framelog
from tests.hostile.conftest import refused, refused_by_api

MiB = 1 << 20


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


def frame(kind: int, step: int, payload: bytes, flags: int = 0) -> bytes:
    header = framelog.FRAME.pack(framelog.FRAME_MAGIC, kind, flags, 0, step, len(payload), zlib.crc32(payload))
    return header + payload


def test_zlib_stream_helper():
    assert zlib.decompress(zlib_zeros(3)) == bytes(3 * MiB)


def test_decompression_bomb_in_the_journal(sample_run):
    """8 MB that inflate to 8 GiB: refused at framelog.MAX_INFLATED, naming segment and step."""
    last = sorted((sample_run / "journal").glob("s*.log"))[-1]
    bomb = zlib_zeros(8 << 10)
    assert len(bomb) < 10 * MiB
    with open(last, "ab") as f:
        f.write(frame(framelog.STEP, 7777, bomb, framelog.FLAG_ZLIB | framelog.FLAG_SAFETENSORS))
    refused(sample_run, "info", "--run", sample_run, names=last.name, says="step 7777")


def test_decompression_bomb_in_a_batch(sample_run):
    seg = sorted((sample_run / "batches" / "rank0").glob("s*.log"))[-1]
    bomb = zlib_zeros(8 << 10)
    with open(seg, "ab") as f:
        f.write(frame(framelog.BATCH, 6000, bomb, framelog.FLAG_ZLIB | framelog.FLAG_SAFETENSORS))
    call = f"ckptlab.open_run({str(sample_run)!r}).batch(6000)"
    refused_by_api(sample_run, call, names=seg.name, says="step 6000")


def crafted_scan_segment(path: Path, size: int = 4 * MiB) -> None:
    """A damaged first frame, then a frame-like header every 24 bytes whose payload claims to
    run to near the end of the file (each fails its CRC), then one intact frame: checking each
    header's CRC over its own payload costs O(size^2)."""
    buf = bytearray(framelog.FILE_MAGIC)
    buf += b"XXXX" + bytes(20)  # a damaged frame header
    tail = frame(framelog.EVENT, 3, b'{"kind":"x"}')
    while len(buf) + 2 * framelog.FRAME.size + len(tail) < size:
        pos = len(buf)
        buf += framelog.FRAME.pack(framelog.FRAME_MAGIC, framelog.STEP, 0, 0, 1, size - len(tail) - pos - 25, 0)
    buf += bytes(size - len(tail) - len(buf)) + tail
    path.write_bytes(bytes(buf))


def test_quadratic_damage_scan(sample_run):
    first = sorted((sample_run / "journal").glob("s*.log"))[0]
    crafted_scan_segment(first)
    r = refused(sample_run, "info", "--run", sample_run, names=first.name, says="intact frames after it")
    assert r.seconds < 20


def test_intact_frame_search_matches_the_direct_check(tmp_path):
    """The linear search gives the same answer as checking every candidate's CRC directly."""
    import random

    def direct(data, start):
        i = data.find(framelog.FRAME_MAGIC, start)
        while i != -1 and i + framelog.FRAME.size <= len(data):
            _, kind, _, _, _, length, crc = framelog.FRAME.unpack_from(data, i)
            end = i + framelog.FRAME.size + length
            if kind in framelog.KIND_NAMES and end <= len(data) and zlib.crc32(data[i + 24 : end]) == crc:
                return True
            i = data.find(framelog.FRAME_MAGIC, i + 1)
        return False

    rng = random.Random(0)
    for _ in range(500):
        parts = []
        for _ in range(rng.randint(0, 6)):
            payload = rng.randbytes(rng.randint(0, 30))
            crc = zlib.crc32(payload) if rng.random() < 0.3 else rng.getrandbits(32)
            length = len(payload) if rng.random() < 0.7 else rng.randint(0, 80)
            parts.append(framelog.FRAME.pack(framelog.FRAME_MAGIC, rng.choice([1, 2, 3, 4, 9]), 0, 0, 1, length, crc))
            parts.append(payload + rng.randbytes(rng.randint(0, 10) if rng.random() < 0.3 else 0))
        data = b"".join(parts)
        start = rng.randint(0, 5)
        assert framelog._intact_frame_after(data, start) == direct(data, start)
