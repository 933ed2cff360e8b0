"""Spike detection on a scalar series (loss, gradient norm): one rule, used online by the
Recorder and offline by info/dirty/report, so they agree on what a spike is.

A value is a spike when it is far above the recent past, robustly measured:
    z = (x - median) / (1.4826 * MAD)   over the last `window` finite, non-spike values
and it also clears a relative bar (`min_ratio` x median, counted from the median's magnitude:
a loss below zero, a log-likelihood's, rises 20% from -10 at -8), so a tiny jump on a very flat
curve (MAD ~ 0) is not an alarm. Where more than half the window is one value (a hinge or
margin loss that is exactly 0 on most batches: MAD = 0), the spread is taken from the values
that differ from it, so the usual non-zero losses are not each an infinitely large spike.
Defaults follow practice: OLMo flags 6 sigma over 128 steps;
Megatron treats 10x the running level as an explosion. The first `min_points` values only
fill the window (no baseline yet).

A spike must also rise `tail` (2) times as far above the median as the window's values rose
above their own level: each value's rise over the median of the `level` (8) values before it,
the largest of them in the window. Small-batch losses are right-skewed: at batch 8, a batch
holding one hard example is routinely 10-20x the median (an MNIST-like CNN's cross-entropy:
median 0.11, 99th percentile 1.0, highest 1.5), which the MAD, a measure of the window's middle,
cannot know: the z rule alone called 8 of every 1000 healthy steps of such a run a spike.
Against the window's largest rise they are ordinary, and a real jump still stands out. A rise
is measured from the level just before the value, so a falling curve leaves no stale bar: the
bar's first version measured from the window's highest value, which on a loss decaying from
10 to 2 (tau 25 steps, 5% noise) is one of its first values, ~7 at step 140 over a median of
~2.1, and a 3x spike there stood under a bar measured from it. On normal noise the largest
rise of 128 values is ~2.7 sigma (their highest: ~2.5 above the median), so this bar (~5.4
sigma) sits under the z bar, and a well-behaved curve gets the z rule's verdicts.
scripts/bench_spikes.py measures it (docs/performance.md):
false alarms per 1000 healthy steps, batches 4-32, 8.3 -> 0 at batch 8 (CNN), 0.7-224 -> 0-7
over every variant (CNN, MLP, 1% flipped labels; the highest as the bar: 0-6); every planted
loss 5x the window's highest caught; on decaying curves (tau 10-200 steps) every planted spike
the z rule alone catches (2x / 3x / 5x the curve's level: 123 / 219 / 253 of 255; the highest
as the bar: 107 / 205 / 249). The lowest loss flagged at batch 8 went from ~8x to ~16x the
median. A loss 5x the median is inside a batch-8 curve's healthy range: the z rule caught none
of them there either. Gradient norms take the same bar (GRAD_RULE: false alarms 0-220 -> 0-5.7
per 1000 on the same runs).
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import deque
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SpikeRule:
    window: int = 128
    z: float = 6.0
    min_ratio: float = 1.2  # and x >= min_ratio * median
    min_points: int = 16
    tail: float = 2.0  # and x - median >= tail * (the window's largest rise); 0: no such bar
    level: int = 8  # (>= 1) a value's rise: over the median of this many values before it


LOSS_RULE = SpikeRule(min_ratio=1.2)
# Gradient norms of small batches are heavy-tailed: 2-3x the median is routine (seen on the
# bundled sample: ~1 alarm per 70 healthy steps at 2x). 5x keeps real explosions (1e2..1e17x).
GRAD_RULE = SpikeRule(min_ratio=5.0)


@dataclass
class Spike:
    value: float
    median: float
    z: float

    @property
    def ratio(self) -> float:
        """How many times the median (a negative median -- a loss that is a log-likelihood's --
        counts from its magnitude: -1 -> 0 is 2x, as 1 -> 2 is)."""
        if self.median > 0:
            return self.value / self.median
        return 1 + (self.value - self.median) / -self.median if self.median < 0 else math.inf


class SpikeDetector:
    def __init__(self, rule: SpikeRule = LOSS_RULE):
        self.rule = rule
        self._window: deque[float] = deque(maxlen=rule.window)
        self._sorted: list[float] = []  # the window's values in order: its median costs nothing
        # The window's values and the `level` before its first: the values rises are measured from.
        self._recent: deque[float] = deque(maxlen=rule.window + rule.level)
        # The window's rises (a value's excess over its level), largest first, as (its number
        # among the values added, rise): each is dropped once a larger one follows it or it
        # leaves the window, so the window's largest rise is the first (a monotonic queue).
        # They are computed when a value needs the bar, for the values added since: on a
        # calm curve, whose values stop at min_ratio, almost never (`_largest_rise`).
        self._rises: deque[tuple[int, float]] = deque()
        self._added = self._risen = 0  # values added; values whose rise is in _rises
        self._before: list[float] = []

    @classmethod
    def resumed(cls, rule: SpikeRule, last: list[float], accepted: int) -> SpikeDetector:
        """A detector in the state it reaches having taken `accepted` values, the last of them
        `last` (window + level of them, none a spike; its rises are computed when needed)."""
        det = cls(rule)
        det._recent.extend(last)
        det._window.extend(last[-rule.window :])
        det._sorted = sorted(det._window)
        det._added = accepted
        return det

    def check(self, value: float) -> Spike | None:
        """Test `value` against the window, then add it (spikes are kept out of the window)."""
        if not math.isfinite(value):
            return None
        spike = None
        # The median first: most values are below min_ratio x median, and need no MAD (the
        # Recorder runs this twice a step; np.median twice per check cost ~40 us). The tail
        # bar, from the window's rises, stops a small batch's routine hard example before the
        # MAD: 9 -> 1.2 us a check on a batch-8 curve, where the z rule alone computed it often.
        if len(self._window) >= self.rule.min_points and self._clears_bars(value, self._median()):
            arr = np.fromiter(self._window, dtype=np.float64)
            med = float(np.median(arr))
            dev = np.abs(arr - med)
            mad = float(np.median(dev))
            if mad == 0 and dev.any():  # most of the window is one value: the others' spread
                mad = float(np.median(dev[dev > 0]))
            scale = 1.4826 * max(mad, 1e-3 * abs(med), 1e-12)
            z = (value - med) / scale
            if z > self.rule.z and self._clears_bars(value, med):
                spike = Spike(value, med, z)
        if spike is None:
            if len(self._window) == self._window.maxlen:
                del self._sorted[bisect.bisect_left(self._sorted, self._window[0])]
            self._window.append(value)
            bisect.insort(self._sorted, value)
            self._recent.append(value)
            self._added += 1
        return spike

    def _largest_rise(self) -> float:
        """The window's largest rise: each value's excess over the median of the `level`
        values added before it (what there is of them, for the first values of a series)."""
        rises, recent, added, k = self._rises, self._recent, self._added, self.rule.level
        start = added - len(self._window)  # the number of the window's first value
        before = self._before  # the `level` values before value number _risen, sorted
        if self._risen < start:  # values that left the window unjudged: none needs a rise
            self._risen = start
            before[:] = sorted(itertools.islice(reversed(recent), added - start, added - start + k))
        for back in range(added - self._risen, 0, -1):  # the values added since, oldest first
            value, n = recent[-back], len(before)
            rise = value - (before[n // 2] if n % 2 else (before[n // 2 - 1] + before[n // 2]) / 2) if n else 0.0
            while rises and rises[-1][1] <= rise:
                rises.pop()
            rises.append((added - back, rise))
            if n == k:
                del before[bisect.bisect_left(before, recent[-back - k])]
            bisect.insort(before, value)
        self._risen = added
        while rises[0][0] < start:
            rises.popleft()
        return rises[0][1]

    def _clears_bars(self, value: float, median: float) -> bool:
        """`value` >= min_ratio x `median`, counted from the median's magnitude (the same test
        for a positive median), and it rises `tail` times as far above the median as the
        window's largest rise (the second test runs only for the few values that pass the
        first)."""
        rise = value - median
        return rise >= (self.rule.min_ratio - 1) * abs(median) and rise >= self.rule.tail * self._largest_rise()

    def _median(self) -> float:
        """np.median of the window, from the sorted copy."""
        return sorted_median(self._sorted)


def sorted_median(s: list[float]) -> float:
    """np.median of the sorted values `s` (the same float: the middle value, or the mean of the
    two middle ones), without numpy's fixed cost; NaN when empty."""
    n = len(s)
    if not n:
        return math.nan
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def find_spikes(values, rule: SpikeRule) -> list[tuple[int, Spike]]:
    """(index, spike) for every spike in a series, scanning it as the Recorder would: the same
    spikes as feeding each value to a SpikeDetector in turn (`_scan`), found without visiting
    each value in Python on a long series.

    Where the detector's window holds the last `window` finite values (no spike among them, nor
    among the `level` before them), its median and largest rise are functions of the series
    alone, and numpy bounds them for every value at once (`_candidates`): a value that cannot
    clear the ratio and tail bars under those bounds is no spike, and it joins the window as the
    detector would take it. The detector itself judges every other value, rebuilt from the
    values before it, and every value within `window + level` of a spike (where the window is
    not the plain last values). A 10^6-step series has a few hundred candidates: 0.3-0.6 s,
    against 1.3-2.8 s value by value (docs/performance.md)."""
    x = np.asarray(values, dtype=np.float64).reshape(-1)
    if rule.min_points > rule.window:  # the window never holds enough values
        return []
    finite = np.flatnonzero(np.isfinite(x))
    f = x[finite]
    settle = rule.window + rule.level + 1  # values after a spike (or the start) judged one by one
    if len(f) < 4 * settle:
        return [(int(finite[i]), s) for i, s in _scan(f, rule)]
    cand = np.flatnonzero(_candidates(f, rule))
    out: list[tuple[int, Spike]] = []
    det = SpikeDetector(rule)
    at = 0  # det holds the state before value `at`
    exact_until = settle  # values before this are fed to det one by one
    rejected = 0  # spikes found so far (kept out of the window)
    i = 0
    n = len(f)
    while i < n:
        if i >= exact_until:  # on to the next value the bounds do not rule out
            c = int(np.searchsorted(cand, i))
            if c == len(cand):
                break
            i = int(cand[c])
            if i - at > settle:  # rebuild det from the values before i (none of them a spike)
                det = SpikeDetector.resumed(rule, f[i - settle + 1 : i].tolist(), accepted=i - rejected)
            else:
                for v in f[at:i]:
                    det.check(float(v))
            at = i
        spike = det.check(float(f[i]))
        at = i = i + 1
        if spike is not None:
            out.append((int(finite[i - 1]), spike))
            rejected += 1
            exact_until = i - 1 + settle
    return out


def _scan(values, rule: SpikeRule) -> list[tuple[int, Spike]]:
    """find_spikes value by value: each value fed to a SpikeDetector in turn."""
    det = SpikeDetector(rule)
    out = []
    for i, v in enumerate(values):
        s = det.check(float(v))
        if s is not None:
            out.append((i, s))
    return out


def _candidates(f: np.ndarray, rule: SpikeRule) -> np.ndarray:
    """bool[len(f)]: the values that may be spikes if the detector's window holds the `window`
    values before each (and each of those its `level` before it): False only where the value
    provably fails the ratio bar or the tail bar.

    The window's median is bounded through blocks of B values: every value of block b has its
    window inside the `window + B - 1` values ending before the block's last one, so the
    median is at least that cover's lower middle order statistic and at most the one B - 1
    above its upper middle (dropping k values moves an order statistic by at most k). The
    window's largest rise is at least the largest over the values every window of the block
    holds."""
    with np.errstate(invalid="ignore"):  # inf - inf where a cover reaches past the series
        return _bounds_clear(f, rule)


def _bounds_clear(f: np.ndarray, rule: SpikeRule) -> np.ndarray:
    w, n = rule.window, len(f)
    B = max(1, min(32, w // 4))
    c = rule.min_ratio - 1
    nb = -(-n // B)
    pad = np.concatenate([np.full(w, np.nan), f, np.full(nb * B - n, np.nan)])
    cover = np.lib.stride_tricks.sliding_window_view(pad, w + B - 1)[: nb * B : B]  # block b: f[bB - w : bB + B - 1]
    lo_k, hi_k = (w - 1) // 2, w // 2 + B - 1
    part = np.partition(cover, [lo_k, hi_k], axis=1)  # NaN (a pad) orders last: the bounds stay bounds
    m_lo, m_hi = part[:, lo_k], part[:, hi_k]
    # The ratio bar, x - m >= c|m|: x >= m + c|m|, whose least over [m_lo, m_hi] is at an end or at 0.
    bar = np.minimum(m_lo + c * np.abs(m_lo), m_hi + c * np.abs(m_hi))
    bar = np.where((m_lo <= 0) & (m_hi >= 0), np.minimum(bar, 0.0), bar)
    need = np.repeat(bar, B)[:n]
    # The bars are tested as the detector does, x - m >= ..., and here as x >= m + ...: the two
    # round differently, by ~1e-16 of the operands' size. A margin of 1e-9 of it stays a bound.
    scale = np.abs(m_lo) + np.abs(m_hi)
    if rule.tail > 0:
        k = rule.level
        lv = np.sort(np.lib.stride_tricks.sliding_window_view(np.concatenate([np.full(k, np.nan), f[:-1]]), k), axis=1)
        level = lv[:, (k - 1) // 2] if k % 2 else (lv[:, k // 2 - 1] + lv[:, k // 2]) / 2  # f[t - k : t]'s
        rise = np.full(nb * B, np.nan)
        rise[k:n] = f[k:] - level[k:]  # (the first `level` values' levels are short: judged one by one)
        # Every window of block b holds f[bB + B - 1 - w : bB]: w - B + 1 values.
        held = np.concatenate([np.full(w, np.nan), rise])
        span = np.lib.stride_tricks.sliding_window_view(held, w - B + 1)[B - 1 : nb * B + B - 1 : B]
        r_lo = np.max(span, axis=1)  # NaN (a short level) where no value relies on it: no bar
        # x - m >= tail * R with m >= m_lo and R >= r_lo: x >= m_lo + tail * r_lo is needed.
        need = np.maximum(need, np.repeat(m_lo + rule.tail * r_lo, B)[:n])
        scale = scale + rule.tail * np.abs(r_lo)
    tol = 1e-9 * (np.abs(f) + np.abs(need) + np.repeat(scale, B)[:n])
    return ~(f < need - tol)
