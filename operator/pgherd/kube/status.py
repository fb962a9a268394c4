"""The PostgresCluster's ``status`` on Kubernetes: the document both platforms build
(pgherd/clusterstatus.py) with this platform's keys, and how it is written (a merge patch, skipped when
nothing but timestamps would change).

Written through the status subresource *before* any action of the decision is applied.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pgherd import clusterstatus
from pgherd.engine.conditions import Condition
from pgherd.engine.plan import Decision
from pgherd.engine.view import ClusterView
from pgherd.kube import names
from pgherd_backup.agent.wire import Status

JSON = dict[str, Any]
# The status's lists of objects: the CRD keeps their items as written (crdgen._lean_lists), so an
# unknown value is left out here, as the API server's pruning of a typed schema left it out before.
LISTS = ("conditions", "members", "certificates")


def cluster_status(
    decision: Decision,
    view: ClusterView,
    previous: Mapping[str, Any],
    *,
    image: str,
    statuses: Mapping[str, Status | None] | None = None,
    extra: Sequence[Condition] = (),
    certificates: Sequence[Mapping[str, Any]] | None = None,
) -> JSON:
    """The shared document (pgherd/clusterstatus.py) with Kubernetes' own keys: the scale subresource's
    selector, the operator's image, and ``certificates`` (status.certificates), when known."""
    document = clusterstatus.cluster_status(decision, view, previous, statuses=statuses, extra=extra)
    selector = f"{names.LABEL_CLUSTER}={view.cluster},{names.LABEL_COMPONENT}={names.COMPONENT_POSTGRES}"
    document["selector"] = selector
    document["image"] = image
    document["certificates"] = (
        [dict(c) for c in certificates] if certificates is not None else previous.get("certificates")
    )
    for key in LISTS:
        if document.get(key) is not None:
            document[key] = [{k: v for k, v in item.items() if v is not None} for item in document[key]]
    return document


def unchanged(document: Mapping[str, Any], previous: Mapping[str, Any]) -> bool:
    """True when writing ``document`` would change nothing but condition timestamps."""
    for key, value in document.items():
        if key == "conditions":
            if not _same_conditions(value or [], previous.get(key) or []):
                return False
        elif previous.get(key) != value:
            return False
    return True


def _same_conditions(new: Sequence[Mapping[str, Any]], old: Sequence[Mapping[str, Any]]) -> bool:
    """The same conditions in the same order, lastTransitionTime aside (compared in place: at every
    tick of every cluster, copies of both lists without it cost more than the comparison)."""
    if len(new) != len(old):
        return False
    for mine, theirs in zip(new, old, strict=True):
        for key, value in mine.items():
            if key != "lastTransitionTime" and (key not in theirs or theirs[key] != value):
                return False
        for key in theirs:
            if key != "lastTransitionTime" and key not in mine:
                return False
    return True


def merge_patch(document: Mapping[str, Any], stored: Mapping[str, Any] | None) -> JSON:
    """`document` as a JSON merge patch over what is `stored`: a merge patch keeps every key it does not
    name, so a key of a nested object (the engine's memory, the operation) that `document` no longer
    holds is written as null. Top-level keys it does not name stay (others write them)."""

    def nulled(new: Any, old: Any) -> Any:
        if isinstance(new, Mapping) and isinstance(old, Mapping):
            out = {key: nulled(value, old.get(key)) for key, value in new.items()}
            out.update({key: None for key in old if key not in new})
            return out
        return new

    return {key: nulled(value, (stored or {}).get(key)) for key, value in document.items()}
