"""Layer 6, what processes share: queues, pool, managers, ring and the context."""
