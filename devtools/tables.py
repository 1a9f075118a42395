"""Server-side printing (`kubectl get` tables) from a CRD's additionalPrinterColumns."""

import dataclasses
import datetime
import re
from typing import Any

# `.status.conditions[?(@.type=="Ready")].status` and `.spec.items[0].name` style paths.
_STEP = re.compile(r"\.([\w-]+)|\[(\d+)\]|\[\?\(@\.([\w-]+)\s*==\s*[\"']([^\"']*)[\"']\)\]")


@dataclasses.dataclass(frozen=True)
class PrinterColumn:
    name: str
    type: str  # string, integer, number, boolean, date
    json_path: str
    priority: int = 0
    description: str = ""

    @classmethod
    def from_crd(cls, column: dict[str, Any]) -> "PrinterColumn":
        return cls(
            name=column["name"],
            type=column.get("type", "string"),
            json_path=column["jsonPath"],
            priority=column.get("priority", 0),
            description=column.get("description", ""),
        )


def evaluate(json_path: str, obj: Any) -> Any:
    """The value at a kubectl-style JSONPath, or None where the path does not lead anywhere."""
    current = obj
    for field, index, filter_key, filter_value in _STEP.findall(json_path):
        current = _step(current, field, index, filter_key, filter_value)
        if current is None:
            return None
    return current


def _step(current: Any, field: str, index: str, filter_key: str, filter_value: str) -> Any:
    if field:
        return current.get(field) if isinstance(current, dict) else None
    if not isinstance(current, list):
        return None
    if index:
        return current[int(index)] if int(index) < len(current) else None
    found = [item for item in current if isinstance(item, dict)]
    found = [item for item in found if str(item.get(filter_key)) == filter_value]
    return found[0] if found else None


def render_table(
    columns: tuple[PrinterColumn, ...], items: list[dict[str, Any]], resource_version: str
) -> dict[str, Any]:
    """A meta.k8s.io/v1 Table, as the API server returns for `Accept: ...;as=Table`."""
    all_columns = (PrinterColumn("Name", "string", ".metadata.name"), *columns)
    if not any(column.name == "Age" for column in columns):
        all_columns += (PrinterColumn("Age", "date", ".metadata.creationTimestamp"),)
    definitions = [_definition(column) for column in all_columns]
    return {
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": {"resourceVersion": resource_version},
        "columnDefinitions": definitions,
        "rows": [_row(all_columns, item) for item in items],
    }


def _definition(column: PrinterColumn) -> dict[str, Any]:
    return {
        "name": column.name,
        "type": column.type,
        "format": "name" if column.name == "Name" else "",
        "description": column.description,
        "priority": column.priority,
    }


def _row(columns: tuple[PrinterColumn, ...], item: dict[str, Any]) -> dict[str, Any]:
    metadata = item.get("metadata", {})
    partial = {
        "kind": "PartialObjectMetadata",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": metadata,
    }
    return {"cells": [_cell(column, item) for column in columns], "object": partial}


def _cell(column: PrinterColumn, item: dict[str, Any]) -> Any:
    value = evaluate(column.json_path, item)
    if value is None:
        return "<none>" if column.type == "string" else None
    if column.type == "date":
        return _age(str(value))
    return value


def _age(timestamp: str) -> str:
    then = datetime.datetime.fromisoformat(timestamp.replace("Z", "+00:00"))
    seconds = int((datetime.datetime.now(datetime.UTC) - then).total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= 2 * size:
            return f"{seconds // size}{unit}"
    return f"{max(seconds, 0)}s"
