"""The scorecard's parts beyond its workload and table: Fiber's backends and the faults beyond signals.

``benchmarks/scorecard.py`` is the script; :mod:`scoring.kinds` says which fault kind applies
to which library and backend (pure), :mod:`scoring.backends` points Fiber at each backend
the test services provide and finds its workers' processes, :mod:`scoring.strike` fires a
schedule's faults: signals, partitions and packet loss on the SSH test hosts, a platform
API that goes away and comes back.
"""
