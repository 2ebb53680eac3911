"""repro: a reproducibility kit for the empirical evaluation of parallel deep-learning frameworks."""

__version__ = "0.1.0"
