"""Durable runs: the journal of a program's Pool and executor calls, its replay after a restart, and each task's stable identity and seed.

The parts: :mod:`.records` (the file format, pure), :mod:`.replay` (what a new run may
take of what was recorded, pure), :mod:`.task` (a task's identity and seed, all a
worker loads of this package), :mod:`.lease` (one master at a time) and
:mod:`.journal` (the I/O: the file, its group commits, the calls' identities).
"""
