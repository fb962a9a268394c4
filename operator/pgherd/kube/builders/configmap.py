"""`<cluster>-config`: the user's PostgreSQL parameters (`spec.parameters`) as `parameters.conf`,
mounted in every member at names.CONFIG_MOUNT and read by the agent (`--parameters-file`) again at each
start. The mount is a whole-directory ConfigMap volume (no subPath) so that the kubelet refreshes it in
place; settings PostgreSQL applies on reload take effect without a restart, and those that need one
change the spec revision, which the operator rolls out member by member."""

from __future__ import annotations

import re
from collections.abc import Mapping

from pgherd.kube import names
from pgherd.kube.builders.common import ClusterRef, Manifest, metadata

# What the agent's read_parameters accepts as a name (pgherd_backup.agent.options._PARAMETER).
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*$")
HEADER = "# spec.parameters of the PostgresCluster, written by pgherd: edit the PostgresCluster, not this.\n"


def render_parameters(parameters: Mapping[str, str] | None) -> str:
    """`name = 'value'` lines, sorted, every value single-quoted with quotes doubled: the syntax of
    postgresql.conf that the agent's read_parameters parses back to the same strings. The API already
    refuses the settings pgherd owns; a name or value that no postgresql.conf line could hold (a line
    break) is refused here (ValueError naming it) rather than written half."""
    lines = [HEADER]
    for name in sorted(parameters or {}):
        value = str((parameters or {})[name])
        if not _NAME.match(name):
            raise ValueError(f"parameters: {name!r} is not a PostgreSQL setting name")
        if "\n" in value or "\r" in value or "\0" in value:
            raise ValueError(f"parameters.{name}: a value cannot hold a line break or a NUL")
        quoted = value.replace("'", "''")
        lines.append(f"{name} = '{quoted}'\n")
    return "".join(lines)


def configmap(ref: ClusterRef) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(ref, names.configmap(ref.name), names.COMPONENT_POSTGRES),
        "data": {names.PARAMETERS_FILE: render_parameters(ref.spec.parameters)},
    }
