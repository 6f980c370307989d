"""The fuzz tests' hypothesis settings: derandomized (the same examples on every run and machine), no example
database, no deadline (the machine is shared: timing says nothing about correctness)."""
from hypothesis import HealthCheck, settings

QUICK = settings(derandomize=True, database=None, deadline=None, max_examples=250,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
LONG = settings(QUICK, max_examples=2_000)  # 15-50 s a test on a shared 2-core machine
