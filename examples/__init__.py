"""Examples run by dotted path inside Ray workers (the repository root is on their path)."""
