"""An offline admission check: what the API server does with a pgherd manifest, without an API server.

It applies the CRD schema's defaults, checks the OpenAPI structural schema (types, enums, bounds,
patterns, required fields, unknown fields as `kubectl --validate=strict` refuses them) and evaluates
every `x-kubernetes-validations` CEL rule, with `oldSelf` for transition rules on updates. It is used
by `pgherd validate`, by the sandbox before it accepts a manifest, and by the tests, so that a bad
manifest is refused the same way everywhere, with a message naming its field.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any

import celpy
from celpy.adapter import json_to_cel
from celpy.evaluation import CELEvalError

from pgherd.api.cluster import PostgresClusterStatus
from pgherd.api.crdgen import schema_for_kind, structural_schema

_MISSING = object()


@dataclass(frozen=True)
class AdmissionError:
    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


class ManifestRefused(ValueError):
    """A manifest the API server would refuse; the message lists every reason, one per line."""

    def __init__(self, kind: str, name: str, errors: list[AdmissionError]) -> None:
        self.kind = kind
        self.name = name
        self.errors = errors
        reasons = "\n".join(f"  - {e}" for e in errors)
        super().__init__(f'{kind} "{name}" is invalid:\n{reasons}')


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """Fill in schema defaults the way the API server does before validation."""
    if not isinstance(value, dict) or schema.get("type") != "object":
        if isinstance(value, list) and "items" in schema:
            return [apply_defaults(schema["items"], item) for item in value]
        return value
    result = dict(value)
    for name, prop in schema.get("properties", {}).items():
        if name not in result and "default" in prop:
            result[name] = copy.deepcopy(prop["default"])
        if name in result:
            result[name] = apply_defaults(prop, result[name])
    additional = schema.get("additionalProperties")
    if isinstance(additional, dict):
        for name in result:
            result[name] = apply_defaults(additional, result[name])
    return result


def _type_ok(expected: str, value: Any) -> bool:
    if expected == "object":
        return isinstance(value, dict)
    if expected == "array":
        return isinstance(value, list)
    if expected == "string":
        return isinstance(value, str)
    if expected == "boolean":
        return isinstance(value, bool)
    if expected == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if expected == "number":
        return isinstance(value, int | float) and not isinstance(value, bool)
    return True


def _describe(value: Any) -> str:
    if isinstance(value, dict):
        return '"object"'
    if isinstance(value, list):
        return '"array"'
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value).lower() if isinstance(value, bool) else repr(value)


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def check_schema(schema: dict[str, Any], value: Any, path: str) -> list[AdmissionError]:
    """The structural schema checks, with Kubernetes-like messages."""
    errors: list[AdmissionError] = []
    expected = schema.get("type")
    if expected and not _type_ok(expected, value):
        return [
            AdmissionError(
                path, f"Invalid value: {_describe(value)}: {path} in body must be of type {expected}"
            )
        ]
    if "enum" in schema and value not in schema["enum"]:
        allowed = ", ".join(f'"{v}"' for v in schema["enum"])
        errors.append(
            AdmissionError(path, f"Unsupported value: {_describe(value)}: supported values: {allowed}")
        )
    if isinstance(value, str):
        if "pattern" in schema and not re.search(schema["pattern"], value):
            errors.append(
                AdmissionError(
                    path,
                    f"Invalid value: {_describe(value)}: {path} in body should match '{schema['pattern']}'",
                )
            )
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            errors.append(AdmissionError(path, f"Too long: may not be more than {schema['maxLength']} bytes"))
        if "minLength" in schema and len(value) < schema["minLength"]:
            errors.append(
                AdmissionError(
                    path,
                    f"Invalid value: {_describe(value)}: {path} in body should be at least {schema['minLength']} chars long",
                )
            )
        if schema.get("format") == "date-time" and not _is_datetime(value):
            errors.append(
                AdmissionError(
                    path, f"Invalid value: {_describe(value)}: {path} in body must be of type date-time"
                )
            )
    if isinstance(value, int | float) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            errors.append(
                AdmissionError(
                    path,
                    f"Invalid value: {value}: {path} in body should be greater than or equal to {schema['minimum']}",
                )
            )
        if "maximum" in schema and value > schema["maximum"]:
            errors.append(
                AdmissionError(
                    path,
                    f"Invalid value: {value}: {path} in body should be less than or equal to {schema['maximum']}",
                )
            )
    if isinstance(value, dict):
        errors += _check_object(schema, value, path)
    if isinstance(value, list) and "items" in schema:
        for index, item in enumerate(value):
            errors += check_schema(schema["items"], item, f"{path}[{index}]")
    return errors


def _check_object(schema: dict[str, Any], value: dict[str, Any], path: str) -> list[AdmissionError]:
    errors: list[AdmissionError] = []
    for name in schema.get("required", []):
        if name not in value:
            errors.append(AdmissionError(_join(path, name), "Required value"))
    if "maxProperties" in schema and len(value) > schema["maxProperties"]:
        errors.append(
            AdmissionError(path, f"Too many: {len(value)}: must have at most {schema['maxProperties']} items")
        )
    properties = schema.get("properties")
    additional = schema.get("additionalProperties")
    preserve = schema.get("x-kubernetes-preserve-unknown-fields", False)
    for name, item in value.items():
        child = _join(path, name)
        if properties is not None and name in properties:
            errors += check_schema(properties[name], item, child)
        elif isinstance(additional, dict):
            errors += check_schema(additional, item, child)
        elif properties is not None and not preserve and path != "metadata":
            errors.append(AdmissionError(child, f'unknown field "{child}"'))
    return errors


def _is_datetime(text: str) -> bool:
    if not re.match(r"^\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})$", text):
        return False
    try:
        datetime.fromisoformat(text.replace("z", "Z").replace("Z", "+00:00"))
    except ValueError:
        return False
    return True


@lru_cache(maxsize=256)
def _program(expression: str) -> celpy.Runner:
    env = celpy.Environment()
    return env.program(env.compile(expression))


def _eval_rule(expression: str, current: Any, old: Any) -> bool | str:
    """True/False, or an error text when the rule cannot be evaluated."""
    activation: dict[str, Any] = {"self": json_to_cel(current)}
    if old is not _MISSING:
        activation["oldSelf"] = json_to_cel(old)
    try:
        result = _program(expression).evaluate(activation)
    except Exception as exc:  # celpy raises several unrelated types for evaluation errors
        return f"rule could not be evaluated: {exc}"
    if isinstance(result, CELEvalError):
        return f"rule could not be evaluated: {result}"
    return bool(result)


def check_rules(schema: dict[str, Any], value: Any, old: Any, path: str) -> list[AdmissionError]:
    """Evaluate every CEL rule of the schema tree against value (and old, for transition rules)."""
    errors: list[AdmissionError] = []
    for entry in schema.get("x-kubernetes-validations", []):
        expression = entry["rule"]
        if "oldSelf" in expression and old is _MISSING:
            continue  # transition rules only apply to updates of an existing value
        outcome = _eval_rule(expression, value, old)
        if outcome is True:
            continue
        where = path + entry.get("fieldPath", "") if entry.get("fieldPath") else path
        message = entry.get("message") or f"failed rule: {expression}"
        if isinstance(outcome, str):
            message = f"{message} ({outcome})"
        errors.append(AdmissionError(where, f"Invalid value: {message}"))
    if isinstance(value, dict):
        for name, item in value.items():
            prop = schema.get("properties", {}).get(name)
            if prop is None and isinstance(schema.get("additionalProperties"), dict):
                prop = schema["additionalProperties"]
            if prop is None:
                continue
            old_item = old.get(name, _MISSING) if isinstance(old, dict) else _MISSING
            errors += check_rules(prop, item, old_item, _join(path, name))
    elif isinstance(value, list) and "items" in schema:
        for index, item in enumerate(value):
            errors += check_rules(schema["items"], item, _MISSING, f"{path}[{index}]")
    return errors


def admit(manifest: dict[str, Any], old: dict[str, Any] | None = None) -> dict[str, Any]:
    """Admit a manifest as the API server would: returns it with defaults applied, or raises
    ManifestRefused listing every problem. `old` is the stored object for an update."""
    kind = str(manifest.get("kind", ""))
    name = str((manifest.get("metadata") or {}).get("name", ""))
    errors: list[AdmissionError] = []
    if manifest.get("apiVersion") != "pgherd.io/v1alpha1":
        errors.append(
            AdmissionError(
                "apiVersion",
                f'Unsupported value: {_describe(manifest.get("apiVersion"))}: expected "pgherd.io/v1alpha1"',
            )
        )
    try:
        schema = schema_for_kind(kind)
    except KeyError as exc:
        raise ManifestRefused(kind or "<no kind>", name, [AdmissionError("kind", str(exc))]) from None
    if not name:
        errors.append(AdmissionError("metadata.name", "Required value: name is required"))
    elif not re.match(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", name) or len(name) > 63:
        errors.append(
            AdmissionError(
                "metadata.name",
                f"Invalid value: {_describe(name)}: a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-'",
            )
        )
    body = {k: v for k, v in manifest.items() if k != "status"}
    defaulted = apply_defaults(schema, body)
    errors += check_schema(schema, defaulted, "")
    if not errors:
        old_defaulted: Any = _MISSING
        if old is not None:
            old_defaulted = apply_defaults(schema, {k: v for k, v in old.items() if k != "status"})
        spec_schema = schema["properties"]["spec"]
        old_spec = old_defaulted.get("spec", _MISSING) if isinstance(old_defaulted, dict) else _MISSING
        errors += check_rules(spec_schema, defaulted.get("spec", {}), old_spec, "spec")
    if errors:
        raise ManifestRefused(kind, name, errors)
    result: dict[str, Any] = defaulted
    return result


@lru_cache(maxsize=1)
def _full_status_schema() -> dict[str, Any]:
    return structural_schema(PostgresClusterStatus)


def status_problems(status: dict[str, Any]) -> list[AdmissionError]:
    """What is wrong with a PostgresCluster's status against its model, every field typed (the CRD keeps
    the items of the status's lists as written: crdgen._lean_lists). Unknown fields and nulls count as
    problems: a typed schema would have pruned them. Used by the tests on what the operator writes."""
    return check_schema(_full_status_schema(), status, "status")
