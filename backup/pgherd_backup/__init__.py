"""pgherd_backup: the data plane of pgherd (snapshots, WAL archive, restore, member seeding)."""

__version__ = "0.1.0"
