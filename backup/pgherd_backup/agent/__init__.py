"""The instance agent (`pgherd instance run`): PID 1 of every PostgreSQL container and the parent of its
PostgreSQL. It seeds the data directory only as told, restarts a crashed PostgreSQL only read-only,
shuts down cleanly on SIGTERM, hosts the WAL service, and serves HTTPS: probes for the kubelet,
`/status` and `/actions/<name>` for the operator alone.

Modules, bottom up (nothing imports upwards):
  wire        the JSON documents client and server exchange (the one place both share)
  tls, auth   the per-cluster CA and certificates; the bearer token check
  credentials the secrets read from files, and their redaction from every text that leaves
  client      AgentClient, the operator's one door to a member
  options     the agent's configuration (flags and PGHERD_* variables) and its paths
  state       what the agent remembers across its own restarts (fenced, revision, kept aside...)
  postmaster  the PostgreSQL child: start, stop, reap, crash detection
  instance    the member as the agent holds it: roles, starts gated by fences, shutdown
  seeding     initdb / pg_basebackup / snapshot into an empty data directory
  status      the /status document and the probes' answers
  actions     one function per action
  server      the HTTPS server: probes apart from the operator's endpoints
  run         `pgherd instance run`: boot, signals, SIGTERM
"""
