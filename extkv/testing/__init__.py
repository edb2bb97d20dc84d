"""Reusable pieces of the conformance harness (also used by stress runs)."""
