"""RNG fingerprints: whether the training loop drew random numbers between two recorded steps,
told cheaply. The Recorder takes one when a step ends and one before the next begins; only
when they differ does the batch record carry the states (training/state.py `capture_rng`).

Two fingerprints are equal exactly when `capture_rng()` at those moments would give states
that `rng_equal` calls equal. Each generator is read in place, without the copy and
conversion its own `getstate` makes, where its memory layout was found and checked once on a
scratch generator; where it was not (another Python, numpy or torch build), the fingerprint
is that generator's own `getstate`: slower, as exact.
"""

from __future__ import annotations

import ctypes
import random
import struct
from typing import Any

import numpy as np
import torch


def rng_fingerprint() -> tuple:
    """The RNG states as plain bytes and tuples, cheap to take and to compare: two fingerprints
    are equal exactly when `capture_rng()` at those two moments would give states that
    `rng_equal` calls equal. What the Recorder takes twice a step to tell whether the loop
    drew random numbers between two steps; the states to record come from `capture_rng`."""
    fp: tuple[Any, ...] = (_PYTHON.fingerprint(), _NUMPY.fingerprint(), _TORCH.fingerprint())
    if torch.cuda.is_initialized():  # (implies is_available, which costs more)
        fp += tuple(s.numpy().tobytes() for s in torch.cuda.get_rng_state_all())
    return fp


def _bound_to(fn, kind: type, otherwise):
    """The `kind` instance `fn` is a method of, or `otherwise`."""
    inst = getattr(fn, "__self__", None)
    return inst if type(inst) is kind else otherwise


class _PythonRandomState:
    """Python's global `random` read without `random.getstate()`, which builds a tuple of 625
    ints (~10 us, and as long to compare): the Mersenne Twister's C struct (`int index;
    uint32_t state[624]` after the object header) as bytes, and `gauss_next`. The layout is
    checked once against getstate on a scratch `random.Random`; if it does not match, the
    fingerprint is getstate's own tuple."""

    _BYTES = 4 + 624 * 4

    def __init__(self) -> None:
        self._ok: bool | None = None
        self._at: tuple[Any, memoryview] | None = None  # (the instance read, a view of its state)

    def fingerprint(self):
        if self._ok is None:
            self._ok = self._check()
        # The instance the module's functions draw from (and `capture_rng`'s getstate reads),
        # even where `random._inst` was rebound since; the module's own where getstate was
        # wrapped (no `__self__`): a wrapper reads it, presumably.
        inst = _bound_to(random.getstate, random.Random, random._inst) if self._ok else None
        if type(inst) is not random.Random:
            return random.getstate()
        if self._at is None or self._at[0] is not inst:
            self._at = (inst, _view(id(inst) + object.__basicsize__, self._BYTES))
        return self._at[1].tobytes(), inst.gauss_next

    def _check(self) -> bool:
        try:
            r = random.Random(12345)
            # (gauss's mu and sigma are given: they have no defaults in Python 3.10)
            for draw in (None, r.random, lambda: r.gauss(0.0, 1.0), lambda: r.getrandbits(20000)):
                if draw is not None:
                    draw()
                raw = ctypes.string_at(id(r) + object.__basicsize__, self._BYTES)
                index, words = struct.unpack_from("<i", raw)[0], struct.unpack_from("<624I", raw, 4)
                if (*words, index) != r.getstate()[1]:
                    return False
            return True
        except Exception:  # noqa: BLE001 - any surprise means: use getstate
            return False


class _NumpyLegacyState:
    """numpy's global RandomState read without `np.random.get_state()`, whose copy of the
    624-word key one word at a time costs ~40 us: the key and position through the MT19937
    bit generator's documented ctypes interface (`ctypes.state_address`), and the cached
    Gaussian (`has_gauss`, `gauss`, which only get_state exposes) from the RandomState
    object itself, at an offset found once and checked against get_state on a scratch
    RandomState through every transition of the cache. If any of that fails (another numpy,
    another bit generator), the fingerprint is get_state's own tuple: slower, as exact."""

    _KEY_BYTES = 624 * 4 + 4  # mt19937_state: uint32_t key[624]; int pos

    def __init__(self) -> None:
        self._offset: int | None | bool = False  # False: not looked for yet; None: not found
        # (the RandomState, its bit generator, a view of the key and position, of the cache)
        self._at: tuple[Any, Any, memoryview, memoryview] | None = None

    def fingerprint(self):
        if self._offset is False:
            self._offset = self._locate()
        # (the RandomState np.random's functions draw from, as `capture_rng`'s get_state reads)
        located = self._offset is not None
        rs = _bound_to(np.random.get_state, np.random.RandomState, np.random.mtrand._rand) if located else None
        bits = getattr(rs, "_bit_generator", None)
        at = self._at
        if at is None or at[0] is not rs or at[1] is not bits:
            if type(rs) is not np.random.RandomState or type(bits) is not np.random.MT19937:
                return _comparable(np.random.get_state())
            assert isinstance(self._offset, int), "found (else rs is None)"
            at = self._at = (
                rs,
                bits,
                _view(bits.ctypes.state_address, self._KEY_BYTES),
                _view(id(rs) + self._offset, 16),
            )
        aug = at[3].tobytes()  # int has_gauss, (padding), double gauss
        return at[2].tobytes(), aug[:4], aug[8:]

    def _locate(self) -> int | None:
        """The offset of `has_gauss` in a RandomState, or None. The RandomState holds a copy
        of its bit generator's `bitgen_t` (whose first field points at the MT19937 state) and
        then `aug_bitgen_t {bitgen_t *bit_generator; int has_gauss; double gauss}`, whose
        first field points at that copy: both pointers are searched for, then checked."""
        try:
            cls = np.random.RandomState
            rs = cls(12345)
            size = cls.__basicsize__
            state = rs._bit_generator.ctypes.state_address

            def word_at(value: int) -> int | None:
                raw = ctypes.string_at(id(rs), size)
                return next((i for i in range(0, size - 7, 8) if struct.unpack_from("<Q", raw, i)[0] == value), None)

            copy = word_at(state)
            aug = word_at(id(rs) + copy) if copy is not None else None
            if aug is None or aug + 24 > size:
                return None
            offset = aug + 8
            for draw in (None, rs.standard_normal, rs.standard_normal, rs.random_sample):  # cache: 0, 1, 0, 0
                if draw is not None:
                    draw()
                legacy = rs.get_state(legacy=True)
                if not isinstance(legacy, tuple):  # a dict: not MT19937's legacy state
                    return None
                raw = ctypes.string_at(id(rs) + offset, 16)
                key = ctypes.string_at(rs._bit_generator.ctypes.state_address, self._KEY_BYTES)
                got = (key[:-4], struct.unpack_from("<i", key, 2496)[0], *struct.unpack_from("<i4xd", raw))
                if got != (legacy[1].tobytes(), legacy[2], legacy[3], legacy[4]):
                    return None
            return offset
        except Exception:  # noqa: BLE001 - any surprise means: use get_state
            return None


def _comparable(state):
    """A numpy state (a tuple, or a dict for another bit generator) with `==` that compares
    arrays by their bytes."""
    if isinstance(state, np.ndarray):
        return state.dtype.str, state.shape, state.tobytes()
    if isinstance(state, dict):
        return tuple((k, _comparable(v)) for k, v in state.items())
    if isinstance(state, (tuple, list)):
        return tuple(_comparable(v) for v in state)
    return state


class _TorchCPUState:
    """torch's default CPU generator read without `torch.get_rng_state()`, which allocates a
    5 KB tensor through the dispatcher (~10 us warm, several times that right after a step):
    its `CPUGeneratorImpl` (found through the Python object's pointer to it) holds the
    Mersenne Twister's `mt19937_data_pod {uint64 seed; int left; bool seeded; uint32 next;
    uint32 state[624]}` and then the cached normals `optional<float>`, `optional<double>`.
    The fingerprint is those fields as bytes, leaving out padding and a cached normal's value
    while it is not engaged (`set_rng_state` writes them without changing the state). The
    offsets are found on a scratch generator with a distinctive seed and checked against its
    `get_state()` through every kind of draw; any mismatch means: use `get_rng_state`."""

    _SIZE = 2544  # the pod (2520 bytes, 8-aligned) and the two optionals

    def __init__(self) -> None:
        self._offset: int | None | bool = False  # False: not looked for yet; None: not found
        self._at: tuple[Any, memoryview] | None = None  # (the generator object, a view of its fields)

    def fingerprint(self):
        if self._offset is False:
            self._offset = self._locate()
        gen = torch.default_generator
        if self._offset is None:
            return torch.get_rng_state().numpy().tobytes()
        if self._at is None or self._at[0] is not gen:
            self._at = (gen, _view(_impl(gen) + self._offset, self._SIZE))
        b = self._at[1].tobytes()
        return b[:13], b[16:2516], b[2520:2525] if b[2524] else 0, b[2528:2537] if b[2536] else 0

    def _locate(self) -> int | None:
        try:
            g = torch.Generator()
            if type(torch.default_generator) is not type(g) or torch.default_generator.device.type != "cpu":
                return None
            seed = 0x5EED_C0FF_EE0D_DBA1  # (64 bits: found by its bytes)
            g.manual_seed(seed)
            impl = _impl(g)
            found = ctypes.string_at(impl, 256).find(struct.pack("<Q", seed))
            if found < 0 or found % 8:
                return None
            for draw in _TORCH_DRAWS:
                draw(g)
                if not _agrees(ctypes.string_at(impl + found, self._SIZE), g.get_state().numpy().tobytes()):
                    return None
            return found
        except Exception:  # noqa: BLE001 - any surprise means: use get_rng_state
            return None


def _view(address: int, size: int) -> memoryview:
    """The `size` bytes at `address` (inside an object the caller holds a reference to), read
    again at each `.tobytes()`: no ctypes call per read."""
    return memoryview((ctypes.c_char * size).from_address(address)).cast("B")


def _impl(gen) -> int:
    """The address of the C++ generator a torch.Generator holds (`THPGenerator {PyObject_HEAD;
    at::Generator cdata}`, and at::Generator is one pointer)."""
    return struct.unpack_from("<Q", ctypes.string_at(id(gen) + object.__basicsize__, 8))[0]


# Draws that move each part of the CPU generator's state: the key and position, the cached
# float normal (a small randn) and the cached double normal (a small float64 normal_).
_TORCH_DRAWS = [
    lambda g: None,
    lambda g: torch.rand(3, generator=g),
    lambda g: torch.randn(1, generator=g),
    lambda g: torch.randn(1, dtype=torch.float64, generator=g),
    lambda g: torch.randn(1, dtype=torch.float64, generator=g),
    lambda g: torch.randn(40, generator=g),
    lambda g: torch.randint(0, 10**9, (700,), generator=g),
    lambda g: g.set_state(g.get_state()),
]


def _agrees(raw: bytes, state: bytes) -> bool:
    """The fields read in place (`raw`) are those `get_state()` serialises (`state`:
    THGeneratorStateNew {uint64 seed; int left; int seeded; uint64 next; uint64 state[624];
    double normal_x, normal_y, normal_rho; int normal_is_valid; float next_float_normal_sample;
    bool is_next_float_normal_sample_valid})."""
    seed, left, seeded, nxt = struct.unpack_from("<QiiQ", state)
    words = struct.unpack_from("<624Q", state, 24)
    normal_y, double_valid, float_sample, float_valid = struct.unpack_from("<8xd8xifB", state, 5016)
    if struct.unpack_from("<Qi?3xI", raw) != (seed, left, bool(seeded), nxt):
        return False
    if struct.unpack_from("<624I", raw, 20) != words:
        return False
    if raw[2524] != float_valid or raw[2536] != double_valid:
        return False
    if float_valid and struct.unpack_from("<f", raw, 2520)[0] != float_sample:
        return False
    return not double_valid or struct.unpack_from("<d", raw, 2528)[0] == normal_y


_PYTHON = _PythonRandomState()
_NUMPY = _NumpyLegacyState()
_TORCH = _TorchCPUState()
