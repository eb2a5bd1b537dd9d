"""Subcommands of the ``rollway`` CLI (one module each, heavy imports deferred)."""
