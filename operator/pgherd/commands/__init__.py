"""Subcommands of the `pgherd` CLI, one module each."""
