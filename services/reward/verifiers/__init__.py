"""Verifiers: pure functions (response, reference, metadata) -> Verdict."""
