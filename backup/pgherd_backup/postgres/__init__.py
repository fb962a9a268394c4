"""Everything that touches a PostgreSQL installation or data directory, grouped by concern:
binaries (find the programs), process (run them as the unprivileged account), control
(pg_control), config (the pgherd-owned settings file), postmaster (start/stop), seed (initdb,
pg_basebackup, snapshot), rewind (rejoin an old primary)."""
