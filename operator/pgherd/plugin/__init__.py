"""`kubectl pgherd` (console script `kubectl-pgherd`): a person's tool for pgherd clusters on
Kubernetes, on the official `kubernetes` client. It explains, it waits, it never prints a secret.

One module per concern; only ``kube`` talks to the API server, and the pure modules below it
(``document``, ``explain``, ``summary``, ``render``, ``requests``, ``manifests``, ``logs``, ``psql``)
take plain objects, so that `pgherd sandbox status` renders its status with the same code:

- ``cli``: the commands and their flags; every error is one line on stderr and a non-zero exit;
- ``kube``: the connection (kubeconfig, context, namespace) and every request, errors in words;
- ``gather``: a cluster's status document read from the API server (``document`` is its shape);
- ``explain``: the phase and the operation in words, from the engine's own rules and timeouts;
- ``summary`` and ``render``: the status document summarized, then printed;
- ``requests``: switchover, restart, pause, resume, upgrade confirm and rollback, and their refusals;
- ``manifests`` and ``follow``: Backups and Restores as a person writes them, followed to their end;
- ``psql``, ``logs``, ``report``, ``version``: a shell in a member, its logs, a support bundle, versions.
"""
