"""Everything that imports vLLM lives here; the rest of the package runs without it."""
