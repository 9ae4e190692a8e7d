"""What a run shows and logs: its first lines, the progress bar, CSV and TensorBoard logs, trackers, throughput. Uses
the store and errors only: the packages above announce themselves here (``console.Mechanism``)."""
