"""Verifiers kept to be caught: the broken-verifier library and the historic engine bugs."""
