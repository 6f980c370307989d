"""Models built from the autograd ops: the spirals MLP (and, later, the Qwen3 family)."""
