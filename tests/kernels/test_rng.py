"""The (seed -> values) mapping of pipeline/kernels/rng.py is a checkpoint contract."""
import math

import numba
import numpy as np
import pytest

from pipeline.kernels import rng
from pipeline.threads import numba_threads

# Golden values: never regenerate these; a change here breaks every checkpoint.
GOLDEN_AT = {
    0: [16294208416658607535, 7960286522194355700, 487617019471545679, 3240954710329600481],
    1: [10451216379200822465, 13757245211066428519, 17911839290282890590, 8601875543100917166],
    42: [13679457532755275413, 2949826092126892291, 5139283748462763858, 6153847732809348270],
    0xDEADBEEF: [5395234354446855067, 16021672434157553954, 153047824787635229, 14363427721557144201],
    2**64 - 1: [16490336266968443936, 16834447057089888969, 4048727598324417001, 13211581173412536330],
}
GOLDEN_INDICES = [0, 1, 2, 1000]
GOLDEN_UNIFORM = {
    0: [0.8833108082136426, 0.43152799704850997, 0.026433771592597743],
    42: [0.7415648787718233, 0.1599103928769201, 0.27860113025513866],
}
GOLDEN_GAUSSIAN = {
    1: [-0.034267321791851144, -1.2926085332373185, -2.5000674933698677, 0.9114665864092971],
    42: [0.8822489062222688, 1.388473285287707, -0.4508498757188601, 0.6707164409024291],
}


def ref_mix(z):
    m = 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return z ^ (z >> 31)


def ref_at(seed, i):
    return ref_mix((seed + (i + 1) * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF)


@pytest.mark.parametrize("seed", list(GOLDEN_AT))
def test_at_golden_and_reference(seed):
    got = [int(x) for x in rng.at_values(seed, GOLDEN_INDICES)]
    assert got == GOLDEN_AT[seed]
    assert got == [ref_at(seed, i) for i in GOLDEN_INDICES]


def test_at_is_the_sequential_stream():
    s = rng.SplitMix64(123)
    seq = [s.next() for _ in range(50)]
    assert seq == [int(x) for x in rng.at_values(123, range(50))]


@pytest.mark.parametrize("seed", list(GOLDEN_UNIFORM))
def test_uniform_golden(seed):
    got = rng.uniform(seed, (3,), dtype=np.float64)
    assert got.tolist() == GOLDEN_UNIFORM[seed]
    assert got.tolist() == [(ref_at(seed, i) >> 11) * 2.0**-53 for i in range(3)]


@pytest.mark.parametrize("seed", list(GOLDEN_GAUSSIAN))
def test_gaussian_golden(seed):
    got = rng.gaussian(seed, (4,), dtype=np.float64)
    # libm cos/log may differ by an ulp across platforms
    np.testing.assert_allclose(got, GOLDEN_GAUSSIAN[seed], rtol=1e-14)
    u = [(ref_at(seed, i) >> 11) * 2.0**-53 for i in range(4)]
    r = math.sqrt(-2 * math.log(1 - u[0])), math.sqrt(-2 * math.log(1 - u[2]))
    ref = [r[0] * math.cos(2 * math.pi * u[1]), r[0] * math.sin(2 * math.pi * u[1]),
           r[1] * math.cos(2 * math.pi * u[3]), r[1] * math.sin(2 * math.pi * u[3])]
    np.testing.assert_allclose(got, ref, rtol=1e-14)


def test_offset_gives_random_access():
    full = rng.gaussian(9, (1000,))
    part = rng.gaussian(9, (100,), offset=500)
    assert np.array_equal(full[500:600], part)


def test_gaussian_statistics():
    a = rng.gaussian(7, (200_000,), dtype=np.float64)
    assert abs(a.mean()) < 0.01 and abs(a.std() - 1) < 0.01


def test_kaiming_uniform_bound():
    w = rng.kaiming_uniform(3, (64, 100))
    assert np.abs(w).max() <= 0.1 and np.abs(w).max() > 0.09
    assert np.array_equal(w, rng.kaiming_uniform(3, (64, 100)))


def test_thread_count_independent():
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("needs 2 numba threads")
    outs = []
    for n in (1, 2):
        with numba_threads(n):
            outs.append(rng.gaussian(5, (300_001,)))
    assert np.array_equal(outs[0], outs[1])


def test_bad_out_array():
    with pytest.raises(TypeError, match="float32/float64"):
        rng.uniform_fill(1, np.zeros(3, dtype=np.int32))
    with pytest.raises(ValueError, match="fan_in"):
        rng.kaiming_uniform_fill(1, np.zeros(3, np.float32), 0)
