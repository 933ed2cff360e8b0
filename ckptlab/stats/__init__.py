"""Tensor statistics: the one place diff, report and trace compute "what does this tensor look like".

    s = tensor_stats(weight)        # TensorStats: counts, moments, extremes, norm, histogram
    s.nonfinite, s.absmax, s.l2, s.hist, s.quantiles
    p = pair_stats(a, b)            # PairStats: A, B and the change B - A
    p.rel_change, p.cosine, p.delta.unchanged, p.delta.max_index, p.w1

Big tensors stream: `StatsAccumulator` and `PairAccumulator` take a tensor piece by piece
(pieces of any size, in any order, each with its element offset) and `merge`, so a checkpoint
is never in memory whole and its pieces can be counted on several threads at once
(`ckptlab.io.stream` does that for `ckptlab diff`).

Only numpy, so that a diff of safetensors files never imports torch: pieces are numpy arrays
in their dtype's storage type (`ckptlab.dtypes`: bfloat16 and float8 as their raw bits), and a
torch tensor given instead is viewed as one without a copy. numpy releases the GIL inside each
op, so pieces counted on several threads run on several cores.

One pass, fused: each piece is walked in cache-sized chunks (`CHUNK` elements); per chunk a
handful of vectorised numpy ops produce every number (sum and sum of squares in float64, min,
max, and for pairs ||B-A||^2, max |B-A| and how many elements did not change). NaN and Inf are
counted in a slow exact pass only for a chunk whose float64 sum of squares is not finite.

Value patterns. Every element is also counted by its top 16 bits (8 for float8): the whole
value for bfloat16/float16/float8, a bfloat16 prefix (2^-8 relative resolution) for float32.
From these counts come, exactly for 16/8-bit dtypes, all the moments, NaN/Inf/zero counts and
extremes (so those dtypes need no float pass at all), and for every dtype the histogram, the
quantiles and the Wasserstein-1 distance between A and B.

Histograms use fixed signed log-scale bins (`HIST_EDGES`), so distributions from different
checkpoints (and different dtypes) are comparable bin for bin: a value v is placed at
symlog(v) = sign(v) * max(0, log10|v| + 10), i.e. 4 bins per decade from 1e-10 to 1e10, with
|v| < 1e-10 (zeros included) in the middle bin and magnitudes beyond 1e10 in the outermost.
A float32 value is binned by its bfloat16 prefix (truncated toward zero), so one within 0.4%
above a bin edge may count in the bin below. Non-finite values are counted, not binned.

Modules: `results` (TensorStats, DeltaStats, PairStats), `tensor` (StatsAccumulator,
tensor_stats), `pair` (PairAccumulator, pair_stats), `patterns` (codecs, Sketch, wasserstein1),
`histogram` (HIST_EDGES, QUANTILES, hist_bins), `kernels` (chunking, per-thread buffers, sums
and counts off the GIL).
"""
