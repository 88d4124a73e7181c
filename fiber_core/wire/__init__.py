"""Layer 3, wire: serialization, authentication, framing and the message vocabulary."""
