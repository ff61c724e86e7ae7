"""python -m tests.cluster up K [--rate 2gbit] | down | status | run [--ppn N] [--round-robin] -- MPIEXEC_ARGS... | test

``up`` leaves the cluster running (and prints the mpiexec line to use); ``down`` removes it; ``run`` launches
``mpiexec`` on the running cluster (``python -m tests.cluster run --ppn 2 -- -n 4 python x.py``); ``test`` makes
its own clusters (name ``torust``, subnet 10.231.14.0/24), runs the cluster suites (tests/cluster/suites.py) and
tears them down, ending with 'N passed, N failed, N skipped'. ``up K --slurm`` makes a Slurm cluster
(tests/cluster/slurm.py); ``srun``/``sbatch``/``salloc``/``sinfo``/``squeue``/``scontrol``/``scancel`` ``-- ARGS``
run that program against it (``python -m tests.cluster --name toruss srun -- --mpi=pmi2 -N 2 -n 4 python x.py``).
"""
from __future__ import annotations

import argparse
import subprocess
import sys

from tests.cluster import Cluster, child_env, from_state, suites, unavailable
from tests.cluster.slurm import SlurmCluster, slurm_unavailable

SLURM_PROGRAMS = ("srun", "sbatch", "salloc", "squeue", "sinfo", "scontrol", "scancel")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.cluster", description=__doc__.splitlines()[0])
    ap.add_argument("--name", default="torusc", help="cluster name (namespaces <name>1..K, bridge <name>br)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="make K hosts and leave them running")
    up.add_argument("hosts", type=int)
    up.add_argument("--rate", help="tc rate per host link, both ways (e.g. 2gbit); default unshaped")
    up.add_argument("--subnet", type=int, default=13, help="hosts at 10.231.SUBNET.1..K")
    up.add_argument("--slurm", action="store_true",
                    help="a Slurm cluster: slurmctld here, one slurmd per host (tests/cluster/slurm.py)")
    sub.add_parser("down", help="kill what runs inside, remove the namespaces and the bridge")
    sub.add_parser("status", help="hosts and the processes inside them")
    run = sub.add_parser("run", help="mpiexec on the running cluster")
    run.add_argument("--ppn", type=int, default=1, help="ranks per host, in blocks of consecutive ranks")
    run.add_argument("--round-robin", action="store_true",
                     help="ranks dealt out one per host in turn (hydra's -hosts h1,h2 without slots)")
    run.add_argument("mpiexec_args", nargs=argparse.REMAINDER)
    for program in SLURM_PROGRAMS:
        slurm = sub.add_parser(program, help=f"{program} on the running Slurm cluster (up K --slurm)")
        slurm.add_argument("slurm_args", nargs=argparse.REMAINDER)
    test = sub.add_parser("test", help="run the cluster suites on clusters of their own")
    test.add_argument("--quick", action="store_true", help="only the node-detection and fault tests")
    test.add_argument("--only", action="append", metavar="SUITE",
                      help="only this suite (repeatable): " + ", ".join(suites.SELECTABLE))
    args = ap.parse_args(argv)

    if args.cmd == "test":
        return suites.main(quick=args.quick, only=args.only)
    why = (slurm_unavailable() if args.slurm else unavailable()) if args.cmd == "up" else None
    if why:
        print(f"cannot make a cluster here: {why}")
        return 1
    if args.cmd == "up" and args.slurm:
        cluster = SlurmCluster(args.hosts, args.rate, args.name, args.subnet).up()
        print(f"Slurm nodes {', '.join(f'{cluster.node(h)} ({cluster.address(h)})' for h in range(1, args.hosts + 1))}"
              f" idle; slurm.conf {cluster.conf}; launch with:")
        print(f"python -m tests.cluster --name {cluster.name} srun -- --mpi=pmi2 -N {cluster.hosts} -n N PROGRAM")
        return 0
    if args.cmd == "up":
        cluster = Cluster(args.hosts, args.rate, args.name, args.subnet).up()
        print(f"{cluster.hosts} hosts {', '.join(cluster.addresses)} on bridge {cluster.bridge}"
              f"{', ' + cluster.rate + ' per link' if cluster.rate else ''}; launch with:")
        print(" ".join(cluster.mpiexec()) + " -n N PROGRAM")
        return 0
    try:
        cluster = from_state(args.name)
    except FileNotFoundError:
        if args.cmd == "down":
            Cluster(1, name=args.name).down()  # leftovers without a state file
            return 0
        print(f"no cluster {args.name!r} is up (python -m tests.cluster up K)")
        return 1
    if args.cmd == "down":
        cluster.down()
        return 0
    if args.cmd == "status":
        for ns, procs in cluster.processes().items():
            print(f"{ns} ({cluster.address(int(ns[len(cluster.name):]))}): {len(procs)} processes")
            for pid, cmd in procs:
                print(f"  {pid} {cmd[:160]}")
        return 0
    if args.cmd in SLURM_PROGRAMS:
        if not isinstance(cluster, SlurmCluster):
            print(f"cluster {args.name!r} runs no Slurm (python -m tests.cluster up K --slurm)")
            return 1
        extra = args.slurm_args[1:] if args.slurm_args[:1] == ["--"] else args.slurm_args
        return subprocess.run(cluster.command(args.cmd, *extra), env=cluster.job_env(), check=False).returncode
    extra = args.mpiexec_args[1:] if args.mpiexec_args[:1] == ["--"] else args.mpiexec_args
    command = cluster.mpiexec(args.ppn, round_robin=args.round_robin) + extra
    return subprocess.run(command, env=child_env(), check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
