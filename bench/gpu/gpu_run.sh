#!/usr/bin/env bash
# Everything torus checks on a real GPU, in one command for a device machine (about 5 minutes on an H200):
#   run(command="bash bench/gpu/gpu_run.sh", carry=[".whl"], timeout_s=480)   (STEPS=34: only steps 3 and 4)
# The machine has no package index. Its image (2026-11) has numba-cuda 0.30.4 with numpy 2.5, which cannot
# compile kernels (numba-cuda uses np.row_stack, gone in numpy 2.5), so .whl carries numpy 2.4.6 for its
# Python 3.12 (the `pip download` line is in bench/gpu/README.md); its mpi4py is built on its Open MPI, which is
# used as is. Builds torus._ext in place with the machine's compiler, then:
#   1. bench/gpu/gpu_check.py          the CUDA kernels bit for bit against numpy and the host kernels, and their
#                                  throughput against CuPy
#   2. tests/test_cuda_kernels.py, test_executor_staged.py: the simulator tests, on the GPU
#   3. tests/mpi/test_device.py    collectives on GPU buffers, 2 ranks sharing the GPU
#   4. bench/gpu/gpu_allreduce.py      staged GPU all-reduce vs host all-reduce vs MPI_Allreduce, 2 ranks
# Output: $OUT/gpu_run.log (summary), $OUT/step{2,3}.log (full pytest output), $OUT/gpu_check.json,
# $OUT/gpu_allreduce_p2.json.
set -u
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
OUT=${OUT:-/tmp/torus-gpu}
mkdir -p "$OUT"
step() { echo; echo "== $* ($(date +%T))"; }
{
step machine
nvidia-smi -L; python3 --version
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD
python3 -c "import numba, numba_cuda, numpy; print('numba', numba.__version__, 'numba-cuda',
  numba_cuda.__version__, 'numpy', numpy.__version__)"
python3 -c "import cupy; print('cupy', cupy.__version__)"
python3 -c "import mpi4py; from mpi4py import MPI; print('mpi4py', mpi4py.__version__,
  MPI.Get_library_version().splitlines()[0])"
MPIEXEC="mpiexec"
if mpiexec --version 2>&1 | grep -q "Open MPI"; then
  MPIEXEC="mpiexec --oversubscribe -x PYTHONPATH -x NUMBA_ENABLE_CUDASIM -x OMP_NUM_THREADS"
fi
quiet() { grep -v "NumbaPerformanceWarning\|warn(errors"; }
STEPS=${STEPS:-1234}
step build torus._ext in place
python3 setup.py -q build_ext --inplace > "$OUT/build.log" 2>&1; echo "build exit $?"
python3 -c "import torus._ext._reduce; print('torus._ext imports')"
if [[ $STEPS == *1* ]]; then
  step 1 gpu_check
  timeout 150 python3 bench/gpu/gpu_check.py --out "$OUT" 2>&1 | quiet; echo "exit ${PIPESTATUS[0]}"
fi
if [[ $STEPS == *2* ]]; then
  step 2 kernel tests on the GPU
  NUMBA_ENABLE_CUDASIM=0 timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_kernels.py \
    tests/test_executor_staged.py > "$OUT/step2.log" 2>&1
  echo "exit $?"; tail -3 "$OUT/step2.log"
fi
if [[ $STEPS == *3* ]]; then
  step 3 device collectives, 2 ranks on one GPU
  NUMBA_ENABLE_CUDASIM=0 timeout 120 $MPIEXEC -n 1 python3 -m pytest -q -p no:cacheprovider \
    tests/mpi/test_device.py : -n 1 python3 -m pytest -p no:cacheprovider -p no:terminal \
    tests/mpi/test_device.py > "$OUT/step3.log" 2>&1
  echo "exit $?"; grep -a "passed\|failed" "$OUT/step3.log" | tail -3
fi
if [[ $STEPS == *4* ]]; then
  step 4 staged GPU all-reduce timing, 2 ranks
  timeout 90 $MPIEXEC -n 2 python3 bench/gpu/gpu_allreduce.py 2>&1 | quiet
fi
step done
} 2>&1 | tee "$OUT/gpu_run.log"
