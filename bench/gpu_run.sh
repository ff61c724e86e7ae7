#!/usr/bin/env bash
# Everything torus checks on a real GPU, in one command for a device machine (about 5 minutes on an H200):
#   run(command="bash bench/gpu_run.sh", carry=[".whl"], timeout_s=540)
# The machine has no package index: .whl holds the mpich and mpi4py wheels for its Python (3.12), fetched here
# with the `pip download` line of bench/README.md. Builds torus._ext in place with the machine's compiler, then:
#   1. bench/gpu_check.py          the CUDA kernels bit for bit against numpy and the host kernels, and their
#                                  throughput against CuPy
#   2. tests/test_cuda_kernels.py  the simulator's kernel tests, on the GPU (NUMBA_ENABLE_CUDASIM=0)
#   3. tests/mpi/test_device.py    collectives on GPU buffers, 2 and 3 ranks sharing the GPU
#   4. bench/gpu_allreduce.py      staged GPU all-reduce vs host all-reduce vs MPI_Allreduce, 2 ranks
# Output: $OUT/gpu_run.log, $OUT/gpu_check.json, $OUT/gpu_allreduce_p2.json.
set -u
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
OUT=${OUT:-/tmp/torus-gpu}
mkdir -p "$OUT"
step() { echo; echo "== $* ($(date +%T))"; }
{
step machine
nvidia-smi -L; python3 --version
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PATH=/tmp/site/bin:$PATH
fi
export PYTHONPATH=/tmp/site:$PWD
python3 -c "import numba, numba_cuda, numpy, ml_dtypes; print('numba', numba.__version__, 'numba-cuda', numba_cuda.__version__, 'numpy', numpy.__version__)"
python3 -c "import cupy; print('cupy', cupy.__version__)"
python3 -c "from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0])"
step build torus._ext in place
time python3 setup.py -q build_ext --inplace 2>&1 | tail -3
python3 -c "import torus._ext._reduce; print('torus._ext imports')"
step 1 gpu_check
timeout 240 python3 bench/gpu_check.py --out "$OUT"; echo "exit $?"
step 2 kernel tests on the GPU
NUMBA_ENABLE_CUDASIM=0 timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_kernels.py 2>&1 | tail -3
step 3 device collectives, 2 and 3 ranks on one GPU
for k in 2 3; do
  NUMBA_ENABLE_CUDASIM=0 timeout 150 mpiexec -n 1 python3 -m pytest -q -p no:cacheprovider tests/mpi/test_device.py \
    : -n $((k - 1)) python3 -m pytest -q -p no:cacheprovider -p no:terminal tests/mpi/test_device.py 2>&1 | tail -3
done
step 4 staged GPU all-reduce timing, 2 ranks
timeout 150 mpiexec -n 2 python3 bench/gpu_allreduce.py; echo "exit $?"
step done
} 2>&1 | tee "$OUT/gpu_run.log"
