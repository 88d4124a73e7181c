"""Layer 4, runtime: configuration and backend selection, run identity, the hub."""
