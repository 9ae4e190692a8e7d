"""Run folders and their record: where a run's files go, its name, its lock, how each start ended, the runs table.

Uses the store (writes), strategies (the devices a run used) and errors; light on purpose: the runs table reads these
names without importing torch.
"""

LOGS = "lightning_logs"  # under trainer.default_root_dir: one folder per run
