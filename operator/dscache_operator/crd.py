"""Builds the ``deepseekcachedeployments.dscache.io`` CRD from the models in :mod:`.spec`.

``python -m dscache_operator.crd`` writes the CRD to ``crds/`` and to the chart's
``charts/dscache/crds/`` (``--check`` only compares); a test asserts both files
equal :func:`render_crd_yaml`. Pydantic's JSON schema is turned into a
Kubernetes *structural* schema: ``$ref`` inlined, ``anyOf [X, null]`` collapsed to
``X``, ``int | str`` to ``x-kubernetes-int-or-string``, titles dropped, and
nested objects defaulted to their filled-in defaults, so the API server
applies inner defaults too (and CEL rules hold for the default itself).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

from dscache_operator import GROUP, KIND, PLURAL, SHORT_NAMES, SINGULAR, VERSION
from dscache_operator.spec import DeepSeekCacheDeploymentSpec, DeepSeekCacheDeploymentStatus

CRD_FILE = "deepseekcachedeployments.dscache.io.yaml"
_KEEP = {
    "type",
    "description",
    "default",
    "enum",
    "format",
    "pattern",
    "minimum",
    "maximum",
    "minLength",
    "maxLength",
    "minItems",
    "maxItems",
    "x-kubernetes-validations",
    "x-kubernetes-preserve-unknown-fields",
    "x-kubernetes-list-type",
    "x-kubernetes-list-map-keys",
    "x-kubernetes-int-or-string",
}


def _structural(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    if "$ref" in node:
        target = defs[node["$ref"].rsplit("/", 1)[-1]]
        merged = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
        return _structural(merged, defs)
    if "anyOf" in node:
        options = [o for o in node["anyOf"] if o.get("type") != "null"]
        rest = {k: v for k, v in node.items() if k != "anyOf"}
        if rest.get("default", "") is None:
            del rest["default"]
        if {o.get("type") for o in options} == {"integer", "string"}:
            return {**_keep(rest), "x-kubernetes-int-or-string": True}
        if len(options) != 1:
            raise ValueError(f"cannot express {node} in a structural schema")
        return _structural({**options[0], **rest}, defs)
    out = _keep(node)
    if "enum" in node and "type" not in node:
        out["type"] = "string"
    if "const" in node:
        out["enum"] = [node["const"]]
        out["type"] = "string"
    kind = node.get("type")
    if kind == "object" or "properties" in node:
        out["type"] = "object"
        props = node.get("properties", {})
        if props:
            out["properties"] = {k: _structural(v, defs) for k, v in props.items()}
            for name, prop in out["properties"].items():
                nested = prop.get("type") == "object" and "properties" in prop
                optional = any(o.get("type") == "null" for o in props[name].get("anyOf", []))
                required = name in node.get("required", [])
                if nested and "default" not in prop and not optional and not required:
                    # The default is the object as defaulting would fill it: the
                    # API server checks a default against the object's CEL rules.
                    prop["default"] = {
                        k: v["default"] for k, v in prop["properties"].items() if "default" in v
                    }
        if node.get("required"):
            out["required"] = list(node["required"])
        extra = node.get("additionalProperties")
        if isinstance(extra, dict):
            out["additionalProperties"] = _structural(extra, defs)
        if not props and not isinstance(extra, dict):
            out["x-kubernetes-preserve-unknown-fields"] = True
    if kind == "array":
        out["items"] = _structural(node["items"], defs)
    return out


def _keep(node: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in node.items() if k in _KEEP}


def _root_schema(model: type[Any], description: str) -> dict[str, Any]:
    schema = model.model_json_schema(by_alias=True, mode="validation")
    defs = schema.pop("$defs", {})
    out = _structural(schema, defs)
    out["description"] = description
    return out


PRINTER_COLUMNS: list[dict[str, Any]] = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Stable", "type": "string", "jsonPath": ".status.stableRevision"},
    {"name": "Canary", "type": "string", "jsonPath": ".status.canaryRevision"},
    {"name": "Weight", "type": "integer", "jsonPath": ".status.weight"},
    {"name": "HitRate", "type": "string", "jsonPath": ".status.hitRate"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def build_crd() -> dict[str, Any]:
    """The CustomResourceDefinition as a dict."""
    spec = _root_schema(
        DeepSeekCacheDeploymentSpec,
        "Desired state: the model, its cache, the session router and how new revisions roll out.",
    )
    status = _root_schema(
        DeepSeekCacheDeploymentStatus, "Observed state, written by the dscache operator."
    )
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{PLURAL}.{GROUP}",
            "labels": {"app.kubernetes.io/part-of": "dscache"},
        },
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": list(SHORT_NAMES),
                "categories": ["dscache", "all"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": "A DeepSeek-class model served with prefix KV-cache "
                            "reuse: model tracks with a KV sidecar per pod, a session-aware "
                            "router, prewarming and cache-aware canary or blue-green rollouts.",
                            "required": ["spec"],
                            "x-kubernetes-validations": [
                                {
                                    # Children are named <name>-green, <name>-prewarm-<rev>,
                                    # and Service names are DNS-1035 labels (<= 63).
                                    "rule": "self.metadata.name.size() <= 40 && "
                                    "self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')",
                                    "message": "metadata.name must be at most 40 characters, "
                                    "start with a letter and hold only a-z, 0-9 and '-'",
                                }
                            ],
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {"type": "object"},
                                "spec": spec,
                                "status": status,
                            },
                        }
                    },
                }
            ],
        },
    }


def render_crd_yaml() -> str:
    """The CRD as YAML text, exactly as committed."""
    header = (
        "# Generated by `python -m dscache_operator.crd` from operator/dscache_operator/spec.py.\n"
        "# Do not edit: change the models and regenerate.\n"
    )
    return header + yaml.safe_dump(build_crd(), sort_keys=False, width=100)


def targets(root: Path) -> list[Path]:
    """Where the CRD lives in the repository."""
    return [root / "crds" / CRD_FILE, root / "charts" / "dscache" / "crds" / CRD_FILE]


def main(argv: list[str] | None = None) -> int:
    """Writes (or with ``--check`` verifies) the CRD files."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[2])
    parser.add_argument("--check", action="store_true", help="fail if a file is out of date")
    args = parser.parse_args(argv)
    text = render_crd_yaml()
    stale = []
    for path in targets(args.root):
        if path.exists() and path.read_text() == text:
            continue
        if args.check:
            stale.append(str(path))
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path}")
    if stale:
        print("out of date: " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
