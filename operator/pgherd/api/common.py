"""Building blocks shared by the three kinds: the base model, quantities, targets, conditions.

Everything in `pgherd.api` is pure data: no I/O. The CRDs in crds/ are generated from these models
(`pgherd crds`), and the operator parses every spec through them, so the API server and the operator
never disagree on what a manifest means.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

GROUP = "pgherd.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
CATEGORY = "pgherd"

# Kubernetes resource.Quantity, positive only (no sign): "10Gi", "500M", "1.5Ti", "1e3".
QUANTITY_PATTERN = r"^(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[mkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
# A PostgreSQL LSN as pg_current_wal_lsn() prints it: "0/3000060".
LSN_PATTERN = r"^[0-9A-Fa-f]{1,8}/[0-9A-Fa-f]{1,8}$"
# RFC 1123 label, as used by Kubernetes object names.
NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"


def rule(expression: str, message: str, field_path: str | None = None) -> dict[str, str]:
    """One `x-kubernetes-validations` entry (a CEL rule and the message shown when it fails)."""
    entry = {"rule": expression, "message": message}
    if field_path:
        entry["fieldPath"] = field_path
    return entry


def cel(*rules: dict[str, str]) -> dict[str, Any]:
    """json_schema_extra carrying CEL rules, for a model's config or a field."""
    return {"x-kubernetes-validations": list(rules)}


class ApiModel(BaseModel):
    """Base of every API object: camelCase on the wire, unknown fields refused."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        validate_default=True,
    )

    def to_wire(self) -> dict[str, Any]:
        """The object as it is written to Kubernetes (camelCase, unset optionals left out)."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


class StatusModel(ApiModel):
    """Status objects tolerate fields written by a newer operator version."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="ignore",
    )


class ObjectRef(ApiModel):
    """A reference to an object of the same namespace, by name."""

    name: str = Field(
        min_length=1,
        max_length=63,
        pattern=NAME_PATTERN,
        description="Name of the object, in the same namespace.",
    )


class RecoveryTarget(ApiModel):
    """Where point-in-time recovery stops. At most one of time, lsn, immediate; none means the end of the
    archived WAL."""

    model_config = ConfigDict(
        json_schema_extra=cel(
            rule(
                "(has(self.time) ? 1 : 0) + (has(self.lsn) ? 1 : 0)"
                " + (has(self.immediate) && self.immediate ? 1 : 0) <= 1",
                "target: set at most one of time, lsn, immediate",
            )
        )
    )

    time: str | None = Field(
        default=None,
        description="Recover up to this instant: ISO 8601 / RFC 3339 with a zone, e.g. 2026-11-21T10:00:00Z.",
        json_schema_extra={"format": "date-time"},
    )
    lsn: str | None = Field(
        default=None, pattern=LSN_PATTERN, description="Recover up to this WAL location, e.g. 0/3000060."
    )
    immediate: bool | None = Field(
        default=None, description="Stop as soon as the snapshot is consistent (no WAL replay beyond it)."
    )


class Condition(StatusModel):
    """A standard Kubernetes condition (metav1.Condition)."""

    type: str
    status: str = Field(description="True, False or Unknown.")
    reason: str = ""
    message: str = ""
    last_transition_time: str | None = None
    observed_generation: int | None = None
