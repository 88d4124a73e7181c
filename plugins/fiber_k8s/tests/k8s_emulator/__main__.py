"""`python -m k8s_emulator ...` or `python path/to/k8s_emulator ...`."""

from __future__ import annotations

import os
import sys

if not __package__:  # run by path: import the package from its parent directory
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    sys.path.insert(0, os.path.dirname(here))
    from k8s_emulator.server import main
else:
    from .server import main

sys.exit(main())
