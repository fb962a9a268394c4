"""pgherd: the control plane of the pgherd PostgreSQL operator."""

__version__ = "0.1.0"
