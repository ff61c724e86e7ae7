import numpy as np

import torus


def test_allreduce_matches_mpi(world, rng):
    tc = torus.TorusComm()
    a = rng.standard_normal(1000).astype(np.float64)
    ref = np.empty_like(a)
    world.Allreduce(a, ref)
    np.testing.assert_allclose(tc.allreduce(a, algorithm="ring"), ref, rtol=1e-12)
