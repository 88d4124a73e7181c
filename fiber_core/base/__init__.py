"""Layer 1, base: errors, option types, logging and socket helpers. Imports nothing of Fiber."""
