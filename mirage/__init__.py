"""mirage: a virtual GPU cluster for PyTorch (see mirage.cli for the command line)."""

__version__ = "0.1.0"
