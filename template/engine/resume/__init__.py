"""Exact resume: which checkpoint a fit continues from, what a checkpoint holds beyond Lightning's (random states,
the place in an epoch), where a stop may write one, and how checkpoint files are written, checked and loaded. Uses
runs (where checkpoints are), strategies, logs, the store and errors."""
