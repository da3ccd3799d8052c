"""recir-embedding's graph transforms (one per module, named after the transform)."""
