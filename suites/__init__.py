"""Built-in audit suites (TOML files), installed as ``spectr_audit.suites``; see :mod:`spectr_audit.run.suite`."""
