"""torus-run: launch an MPI job through the existing launcher and relaunch it after a lost process or host.

    torus-run --hostfile hosts -n 8 --min-np 4 --max-restarts 3 -- python train.py

The supervisor owns no transport and no rendezvous: every launch is one ``mpiexec`` (MPICH's hydra) over the
hosts still usable, or one ``srun`` inside a Slurm allocation, and a host's health is asked of that same
launcher (a one-process ``true`` on it). What each module does:

- :mod:`torus.supervise.hosts`: the host list (hostfile, discovery script, Slurm allocation, this host), which
  hosts a launch may use (cooldown after two failed launches in a row) and the rank count.
- :mod:`torus.supervise.launch`: the launcher's command lines (job and probe), running a launch while passing
  its output through and reading what failed, and deciding whether an end is worth a relaunch.
- :mod:`torus.supervise.report`: the one line per restart and the summary.
- :mod:`torus.supervise.cli`: the command line and the launch loop.

What the ranks see: ``TORUS_JOB_ID`` (one id per torus-run invocation) and ``TORUS_RESTART`` (0 for the first
launch, then 1, 2, ...). A rank that resumes from a snapshot may print ``torus-run: resumed at step S
(snapshot step S0)``; the summary then counts the steps redone. docs/clusters.md, "Recovering from a lost rank
or host: torus-run", is the user's page.
"""
