"""Report writers (JSON, Markdown, ...), installed as ``spectr_audit.reports``; they read result objects only."""
