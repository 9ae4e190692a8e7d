"""A PyTorch Lightning project: one package, configured from YAML, from one device to many nodes."""

__version__ = "0.1.0"
