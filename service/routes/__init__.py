"""HTTP routes, one module per area; each module exposes ``router``."""
