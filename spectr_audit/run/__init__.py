"""Running audits: the runner, suites as TOML files, the conformance check and the CI gate.

Modules are imported on use: the pytest plugin loads :mod:`.gate` at start-up and must not
pull torch, scipy or cvxpy with it.
"""
