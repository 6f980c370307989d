"""Fucina: a CPU-first training system."""
__version__ = "0.1.0"
