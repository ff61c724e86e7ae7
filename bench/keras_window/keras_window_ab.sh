#!/bin/sh
# The Keras gradient all-reduce through TorusComm.alloc (window) against the copy path, 2 ranks on one host:
# bench/keras_window/keras_allreduce.py (the all-reduce alone, paths alternating) then bench/keras_window/keras_scaling.py (ResNet-50
# training steps) with --window on/off alternating. About 4-5 minutes on the 2-core machine (one training run
# took 54 s at load 3.7). Appends JSON lines (with the load average) to $OUT/keras_allreduce_p2.json and
# $OUT/keras_scaling_window_p2.json.
set -e
py=${PYTHON:-.venv/bin/python}
mpi=${MPIEXEC:-.venv/bin/mpiexec}
out=${OUT:-bench/keras_window/results}
$mpi -n 2 $py bench/keras_window/keras_allreduce.py --steps 30 --rounds 3 --json "$out/keras_allreduce_p2.json"
for w in on off on off; do
  $mpi -n 2 $py bench/keras_window/keras_scaling.py --window $w --steps 8 --json "$out/keras_scaling_window_p2.json"
done
