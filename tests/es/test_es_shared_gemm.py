"""qgemm.matmul_t_groups' shared call: one BLAS call per tile over every ES member's rows gives each member the
bits of its own call (where shared_call's probe says so), so batched members keep the same-bits contract."""
import numpy as np
import pytest

from pipeline.kernels import qgemm


@pytest.mark.parametrize("shape,groups,n", [((576, 576), 8, 51), ((192, 576), 4, 51), ((96, 64), 3, 5),
                                            ((576, 1536), 2, 300), ((1536, 576), 16, 30)])
def test_groups_equal_each_group_alone(shape, groups, n):
    rng = np.random.default_rng(1)
    w = rng.standard_normal(shape, dtype=np.float32)
    x3 = rng.standard_normal((groups, n, shape[1]), dtype=np.float32)
    got = qgemm.matmul_t_groups([(qgemm.F32, w, shape)], x3)[0]
    for j in range(groups):
        np.testing.assert_array_equal(got[j], qgemm.matmul_t_many([(qgemm.F32, w, shape)], x3[j])[0])


def test_the_shared_call_is_taken_on_smollm2_shapes():
    """The SmolLM2-135M tile shapes with ~51 rows per member take the shared call (what the speed-up needs);
    a tiny product stays one call per group (OpenBLAS's small-matrix kernels sum differently)."""
    rows = qgemm.row_tile((576, 576))
    assert qgemm.shared_call(rows, 576, 51, 8)  # one x @ W.T call over 408 rows, each member's W @ x.T bits
    assert qgemm.shared_call(rows, 576, 51, 4)  # 204 rows: one W @ x.T call
    assert not qgemm.shared_call(16, 64, 3, 4)
    assert not qgemm.shared_call(rows, 576, 51, 1)


def test_head_rows_of_every_member_in_one_call_keep_each_members_bits():
    """kernels.nn.matmul_nt_each on SmolLM2's head shape (49152 x 576) with 25 rows per member: the shared
    call is taken (the probe) and each member's logits are matmul_nt's for that member alone."""
    from pipeline.kernels.nn import _tile_width, matmul_nt, matmul_nt_each
    rng = np.random.default_rng(2)
    w = rng.standard_normal((49152, 576), dtype=np.float32)
    xs = [rng.standard_normal((25, 576), dtype=np.float32) for _ in range(6)]
    assert qgemm.shared_call(_tile_width(49152), 576, 25, 6, "x_wt")
    got = matmul_nt_each(xs, w)
    for x, logits in zip(xs, got):
        np.testing.assert_array_equal(logits, matmul_nt(x, w))
