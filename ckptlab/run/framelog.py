"""Append-only, CRC-framed log files: the crash-safe primitive under the batch log and journal.

A log file is a 16-byte file header, b"ckptlab-log-v2\n\x00", followed by frames. One frame
is one `os.write` of

    header (28 bytes, little endian)        payload (`length` bytes)
    magic  b"CKF2"          4s
    kind   u8   (BATCH, STEP, VALIDATION, EVENT)
    flags  u8   bit0: payload is zlib-compressed; bit1: payload is safetensors (else JSON)
    rank   u16
    step   i64
    length u32
    crc32  u32  (of the payload bytes as stored)
    hcrc   u32  (of the header's 24 bytes before it)

The header has its own CRC so that a scan, which reads headers only, trusts no step, kind or
length that was damaged. Segments written before run format 2 have the file header
b"ckptlab-log-v1\n\x00" and 24-byte frame headers without `hcrc` (magic b"CKF1"); they are
read as they are. The two layouts are `LOG_V1` and `LOG_V2` below.

Why not HDF5 for this: an HDF5 file killed before its first flush is unreadable, and a kill
during a flush can leave its metadata inconsistent; a frame log can only ever lose a torn tail,
which the CRC detects. A SIGKILL cannot lose bytes that `write` already handed to the kernel,
so no per-step fsync is needed for process crashes (`fsync` happens on segment close).

Readers never modify a log: a torn tail is skipped and reported, never truncated.
"""

from __future__ import annotations

import mmap
import os
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ckptlab.errors import CorruptFileError
from ckptlab.io.files import open_regular

_FIELDS = struct.Struct("<4sBBHqII")  # magic, kind, flags, rank, step, length, crc32: both layouts
_HCRC = struct.Struct("<I")


@dataclass(frozen=True)
class LogLayout:
    """One version of the segment format: its file header, and its frames' headers (v2 adds
    a CRC of the header after the fields v1 has)."""

    file_magic: bytes
    frame_magic: bytes
    header_size: int

    @property
    def checks_header(self) -> bool:
        return self.header_size > _FIELDS.size

    def header_ok(self, data, pos: int) -> bool:
        """Whether the frame header at `pos` passes its own CRC (v1 headers have none)."""
        if not self.checks_header:
            return True
        return zlib.crc32(data[pos : pos + _FIELDS.size]) == _HCRC.unpack_from(data, pos + _FIELDS.size)[0]


LOG_V1 = LogLayout(b"ckptlab-log-v1\n\x00", b"CKF1", _FIELDS.size)
LOG_V2 = LogLayout(b"ckptlab-log-v2\n\x00", b"CKF2", _FIELDS.size + _HCRC.size)
LAYOUTS = {layout.file_magic: layout for layout in (LOG_V1, LOG_V2)}
FILE_MAGIC = LOG_V2.file_magic  # what FrameWriter writes (16 bytes, as in every layout)

BATCH, STEP, VALIDATION, EVENT = 1, 2, 3, 4
KIND_NAMES = {BATCH: "batch", STEP: "step", VALIDATION: "validation", EVENT: "event"}

FLAG_ZLIB = 1
FLAG_SAFETENSORS = 2

MAX_FRAME = 1 << 32  # u32 length
# The most bytes a compressed payload may inflate to (256 MiB). The frame format declares no
# uncompressed size, so this global limit bounds what reading one frame can allocate (zlib
# inflates up to ~1000x: an 8 MB frame could otherwise claim 8 GiB). One rank's batch record
# is typically a few MB; the writer stores a payload larger than this uncompressed
# (records.Compressor), so every frame it writes stays readable.
MAX_INFLATED = 256 << 20


@dataclass(frozen=True)
class FrameRef:
    """Where one frame lives; the payload is read on demand."""

    path: Path
    offset: int  # of the payload
    kind: int
    flags: int
    rank: int
    step: int
    length: int
    crc: int
    header_size: int = LOG_V2.header_size

    @property
    def start(self) -> int:
        """Where the frame (its header) starts in the segment."""
        return self.offset - self.header_size

    def read_payload(self) -> tuple[bytes, int]:
        """The payload (decompressed) and its flags; raises CorruptFileError on a CRC mismatch."""
        with open_regular(self.path) as f:
            f.seek(self.offset)
            data = f.read(self.length)
        return check_payload(self, data), self.flags


def check_payload(ref: FrameRef, data: bytes) -> bytes:
    if len(data) != ref.length or zlib.crc32(data) != ref.crc:
        raise CorruptFileError(
            f"frame for step {ref.step} at byte {ref.start} fails its CRC (corrupt file)",
            path=ref.path,
        )
    return inflate(data, path=ref.path, step=ref.step) if ref.flags & FLAG_ZLIB else data


def inflate(data, *, path, step: int, limit: int | None = None) -> bytes:
    """A zlib payload decompressed, refusing (CorruptFileError) to inflate past `limit`
    (default MAX_INFLATED) bytes: memory stays bounded whatever a crafted frame claims."""
    limit = MAX_INFLATED if limit is None else limit
    d = zlib.decompressobj()
    try:
        out = d.decompress(data, limit + 1)  # max_length: zlib stops there, nothing more is allocated
    except zlib.error as e:
        raise CorruptFileError(f"frame for step {step}: payload is not valid zlib data ({e})", path=path) from None
    if len(out) > limit:
        raise CorruptFileError(
            f"frame for step {step}: compressed payload inflates to more than {limit} bytes "
            "(the limit for one frame; a decompression bomb or a corrupt file)",
            path=path,
        )
    if not d.eof:
        raise CorruptFileError(f"frame for step {step}: compressed payload is cut short", path=path)
    return out


def pack_frame(
    kind: int, step: int, payload: bytes, *, flags: int = 0, rank: int = 0, layout: LogLayout = LOG_V2
) -> bytes:
    """One frame, header and payload (FrameWriter writes LOG_V2; `layout=LOG_V1` makes one
    that belongs in an older segment)."""
    fields = _FIELDS.pack(layout.frame_magic, kind, flags, rank, step, len(payload), zlib.crc32(payload))
    if not layout.checks_header:
        return fields + payload
    return b"".join((fields, _HCRC.pack(zlib.crc32(fields)), payload))


class FrameWriter:
    """Appends frames to one segment file. Not thread-safe: one writer per file."""

    def __init__(self, path: Path):
        self.path = path
        # O_EXCL: a segment is never appended to by a second writer (a resumed session starts
        # a new segment), so a torn tail left by a crash stays where it is, harmlessly.
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
        self._write_all(FILE_MAGIC)
        self.bytes_written = len(FILE_MAGIC)

    def append(self, kind: int, step: int, payload: bytes, *, flags: int = 0, rank: int = 0) -> int:
        if len(payload) >= MAX_FRAME:
            raise ValueError(f"frame of {len(payload)} bytes is larger than 4 GiB")
        frame = pack_frame(kind, step, payload, flags=flags, rank=rank)
        self._write_all(frame)
        self.bytes_written += len(frame)
        return len(frame)

    def _write_all(self, data: bytes) -> None:
        n = os.write(self._fd, data)  # (one call: all of it, nearly always)
        if n < len(data):
            view = memoryview(data)[n:]
            while view:
                n = os.write(self._fd, view)
                view = view[n:]

    def close(self, *, fsync: bool = True) -> None:
        if self._fd < 0:
            return
        try:
            if fsync:
                os.fsync(self._fd)
        finally:
            os.close(self._fd)
            self._fd = -1


@dataclass
class ScanResult:
    frames: list[FrameRef]
    torn_bytes: int  # bytes after the last good frame (a crash's torn tail), 0 if clean
    corrupt: str | None = None  # why the scan stopped early, when a crash cannot explain it
    no_header: bool = False  # shorter than its file header (empty): killed as it was created


def scan(path: Path, *, verify: bool = False, index: bool = True) -> ScanResult:
    """Index a segment by its frame headers (checking every payload's CRC when `verify`).
    `index=False`: check only, its ScanResult without `frames` (the cost of a long journal's
    10^6 FrameRefs)."""
    with open_regular(path) as f:
        data = _map(f)
        return _scan_buffer(path, data, verify, index)


def iter_payloads(path: Path) -> Iterator[tuple[FrameRef, bytes]]:
    """Every good frame of a segment with its (decompressed) payload, CRC-checked."""
    with open_regular(path) as f:
        data = _map(f)
        for ref in _scan_buffer(path, data, False).frames:
            yield ref, check_payload(ref, data[ref.offset : ref.offset + ref.length])


def _map(f) -> bytes | mmap.mmap:
    size = os.fstat(f.fileno()).st_size
    return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""


def _scan_buffer(path: Path, data, verify: bool, index: bool = True) -> ScanResult:
    """Stop at the first frame that is incomplete or fails its CRC.

    With one appending writer, a crash can only tear the last frame: a prefix of it is on disk
    (or, after a power loss, its length with zeros). The last frame's CRC is always checked for
    that reason. A bad frame with an intact frame after it is corruption, reported in `corrupt`.
    """
    size = len(data)
    head = bytes(data[: len(FILE_MAGIC)])
    layout = LAYOUTS.get(head)
    if layout is None:
        if size < len(FILE_MAGIC) and any(magic.startswith(head) for magic in LAYOUTS):
            return ScanResult([], size, no_header=True)  # killed while writing the file header
        if head.startswith(b"ckptlab-log-v") and size >= len(FILE_MAGIC):
            raise CorruptFileError(
                f"a log segment of a newer ckptlab (file header {head.rstrip(bytes(1))!r})",
                path=path,
                hint="upgrade ckptlab",
            )
        raise CorruptFileError("not a ckptlab log segment (bad file header)", path=path)
    hsize = layout.header_size
    frames: list[FrameRef] = []
    pos = len(FILE_MAGIC)
    why = None
    view = memoryview(data)  # (CRCs of slices of it: no copy of each payload)
    try:
        while pos + hsize <= size:
            magic, kind, flags, rank, step, length, crc = _FIELDS.unpack_from(data, pos)
            end = pos + hsize + length
            if magic != layout.frame_magic or not layout.header_ok(view, pos) or kind not in KIND_NAMES:
                # (a v2 header that fails its CRC at the very end may be a torn tail: below)
                why = f"bad frame header at byte {pos}"
                break
            if end > size:
                break
            if (verify or end == size) and zlib.crc32(view[pos + hsize : end]) != crc:
                why = f"frame for step {step} at byte {pos} fails its CRC"
                break
            if index:
                frames.append(FrameRef(path, pos + hsize, kind, flags, rank, step, length, crc, hsize))
            pos = end
    finally:
        view.release()  # (an mmap cannot close while a view of it is out)
    corrupt = None
    if pos < size and _intact_frame_after(data, pos + 1, layout):
        corrupt = f"{why or f'frame at byte {pos} is cut short'}, with intact frames after it (corrupt file)"
    return ScanResult(frames, size - pos, corrupt)


def _intact_frame_after(data, start: int, layout: LogLayout) -> bool:
    """Whether a whole frame with a good CRC starts somewhere at or after `start`.

    Linear in the bytes after `start`, however many frame-like headers a crafted file holds
    (checking each candidate's CRC over its own payload would be quadratic: every header can
    claim a payload running to the end of the file). CRC-32 of any byte range follows from the
    CRCs of the file's prefixes: crc(data[a:b]) = P(b) ^ Z_{b-a}(P(a)), with P(x) the CRC of
    data[:x] and Z_n the (linear) effect of n zero bytes on a CRC. So one pass computes P at
    every candidate's start and end, and Z_n is applied to all candidates at once.
    """
    size = len(data)
    hsize = layout.header_size
    starts, ends, crcs = [], [], []
    i = data.find(layout.frame_magic, start)
    while i != -1 and i + hsize <= size:
        _, kind, _, _, _, length, crc = _FIELDS.unpack_from(data, i)
        end = i + hsize + length
        if kind in KIND_NAMES and end <= size and layout.header_ok(data, i):
            starts.append(i + hsize)
            ends.append(end)
            crcs.append(crc)
        i = data.find(layout.frame_magic, i + 1)
    if not starts:
        return False
    if len(starts) == 1:
        return zlib.crc32(data[starts[0] : ends[0]]) == crcs[0]
    import numpy as np

    prefix = {}
    crc, prev = 0, 0
    with memoryview(data) as view:
        for pos in sorted({*starts, *ends}):
            crc = zlib.crc32(view[prev:pos], crc)
            prefix[pos] = crc
            prev = pos
    at_start = np.array([prefix[a] for a in starts], dtype=np.uint32)
    at_end = np.array([prefix[b] for b in ends], dtype=np.uint32)
    lengths = np.array(ends, dtype=np.int64) - np.array(starts, dtype=np.int64)
    got = at_end ^ _zeros_shift(at_start, lengths)
    return bool((got == np.array(crcs, dtype=np.uint32)).any())


def _zeros_shift(values, lengths):
    """Z_n(v) for each value and its length n: what n zero bytes do to a CRC-32 register (the
    CRC of n zero bytes started from v, xor the one started from 0), in O(log n) table look-ups
    per value instead of O(n)."""
    import numpy as np

    values = values.copy()
    byte = np.arange(256, dtype=np.uint32)
    # columns of Z_1: the image of each single bit
    cols = np.array([zlib.crc32(b"\0", 1 << j) ^ zlib.crc32(b"\0") for j in range(32)], dtype=np.uint32)
    k = 0
    while (lengths >> k).any():
        tables = []
        for b in range(4):  # Z_{2^k} as four byte-indexed tables
            t = np.zeros(256, dtype=np.uint32)
            for bit in range(8):
                t ^= np.where((byte >> bit) & 1, cols[8 * b + bit], 0).astype(np.uint32)
            tables.append(t)

        def apply(v, tables=tables):
            return tables[0][v & 0xFF] ^ tables[1][(v >> 8) & 0xFF] ^ tables[2][(v >> 16) & 0xFF] ^ tables[3][v >> 24]

        pick = ((lengths >> k) & 1).astype(bool)
        values[pick] = apply(values[pick])
        cols = apply(cols)  # Z_{2^(k+1)} = Z_{2^k} twice
        k += 1
    return values
