#!/bin/sh
# One rank of bench/fault_injection/fault_injection.py's job: node-local snapshots per emulated host. The namespaces share
# the machine's host name, so the host is hydra's name for it (PMI_HOSTNAME, the host's address here).
export TORUS_SNAPSHOT_DIR="${FI_SNAP_ROOT:?}/${PMI_HOSTNAME:-$(hostname)}"
exec "$@"
