"""Jobs and signals: a stop on SIGTERM/SIGUSR1/Ctrl-C (and a SLURM requeue), a hung or dead rank ending the whole job
in one line, torchrun restarts.

Uses resume (where a stop may checkpoint), runs, logs and errors.
"""
