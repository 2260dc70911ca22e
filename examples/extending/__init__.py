"""One worked example per extension point (docs/extending.md), each run by tests/test_extending.py."""
