"""Layer 5, processes: job-backed ``Process``, ``Pipe`` and the worker bootstrap."""
