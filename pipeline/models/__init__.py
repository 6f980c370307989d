"""Models built from the autograd ops: the spirals MLP and the dense decoder families (registry.py)."""
