"""Layer 3, built-in backends: ``local``, written against the contract like any plugin."""
