"""JSON schemas whose ``$ref`` cycles leave no finite instance, found before any token is generated.

llguidance follows such a schema lazily and cannot tell: ``{"$ref": "#"}`` accepts nothing (the
matcher stops at once and the output is ``""`` with finish reason ``stop``), and a node whose
required child is the node again forces ``{"child": {"child": ...`` until ``max_tokens``. Neither is
an answer, so such a schema is its request's error, naming the reference.

`endless_ref` computes which local references have a finite instance as a least fixed point (a
reference is finite once its schema is, with the references found finite so far). Each rule
over-approximates "has a finite instance" (``allOf`` needs every part, ``anyOf`` one, an object its
required properties, an array its first ``minItems`` items; a keyword it does not model is taken as
satisfiable), so a reference it calls endless truly is; whether the schema is otherwise satisfiable
is llguidance's to say.
"""

from __future__ import annotations

from urllib.parse import unquote

WORK_LIMIT = 200_000  # schema nodes visited at most; a bigger schema is not judged


class _TooBig(Exception):
    pass


class _Refs:
    """The fixed point over one schema's local references."""

    def __init__(self, root: object) -> None:
        self.root = root
        self.targets: dict[str, object] = {}  # every local reference met -> its schema
        self.finite: set[str] = set()
        self.work = 0
        self.endless_met: list[str] = []  # endless references `ok` met, in order

    def count(self) -> None:
        self.work += 1
        if self.work > WORK_LIMIT:
            raise _TooBig

    def resolve(self, ref: object) -> tuple[bool, object]:
        """``(found, schema)`` of a reference into this document (``#`` or ``#/json/pointer``)."""
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            return False, None  # another document or an anchor: not judged
        node = self.root
        for part in ref[2:].split("/") if ref != "#" else []:
            part = unquote(part).replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return False, None  # llguidance names a missing target itself
        return True, node

    def ok(self, node: object) -> bool:
        """Over-approximately: ``node`` has a finite instance, given the references finite so far."""
        self.count()
        if node is False:
            return False
        if not isinstance(node, dict):
            return True
        ref = node.get("$ref")
        found, target = self.resolve(ref)
        if found:
            self.targets.setdefault(ref, target)
            if ref not in self.finite:
                self.endless_met.append(ref)
                return False
        parts = node.get("allOf")
        if isinstance(parts, list) and not all(self.ok(p) for p in parts):
            return False
        for key in ("anyOf", "oneOf"):
            options = node.get(key)
            if isinstance(options, list) and options and not any(self.ok(o) for o in options):
                return False
        if "const" in node or "enum" in node:
            return True
        types = node.get("type")
        types = [types] if isinstance(types, str) else types if isinstance(types, list) and types else ["any"]
        return any(self._type_ok(node, t) for t in types)

    def _type_ok(self, node: dict, kind: object) -> bool:
        if kind == "object":
            props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
            required = node.get("required") if isinstance(node.get("required"), list) else []
            for name in required:
                if name in props:
                    if not self.ok(props[name]):
                        return False
                elif "patternProperties" not in node and not self.ok(node.get("additionalProperties", True)):
                    return False
            return True
        if kind == "array":
            least = node.get("minItems", 0)
            least = least if isinstance(least, int) else 0
            prefix = node.get("prefixItems")
            items = node.get("items", True)
            if isinstance(items, list):  # drafts before 2020-12: a list of items, then additionalItems
                prefix, items = items, node.get("additionalItems", True)
            prefix = prefix if isinstance(prefix, list) else []
            if not all(self.ok(p) for p in prefix[:least]):
                return False
            return least <= len(prefix) or self.ok(items)
        return True

    def refs_in(self, node: object) -> set[str]:
        """The local references anywhere inside ``node``."""
        found, stack = set(), [node]
        while stack:
            node = stack.pop()
            self.count()
            if isinstance(node, dict):
                if self.resolve(node.get("$ref"))[0]:
                    found.add(node["$ref"])
                stack.extend(node.values())
            elif isinstance(node, list):
                stack.extend(node)
        return found

    def on_cycle(self, ref: str) -> bool:
        """``ref``'s schema refers back to it, directly or through other references."""
        seen, todo = set(), [ref]
        while todo:
            for r in self.refs_in(self.resolve(todo.pop())[1]):
                if r == ref:
                    return True
                if r not in seen:
                    seen.add(r)
                    todo.append(r)
        return False


def _has_nested_id(node: object, top: bool = True) -> bool:
    """A ``$id`` below the root changes what ``#`` means beneath it; such schemas are not judged."""
    if isinstance(node, dict):
        if not top and "$id" in node:
            return True
        return any(_has_nested_id(v, False) for v in node.values())
    if isinstance(node, list):
        return any(_has_nested_id(v, False) for v in node)
    return False


def endless_ref(schema: object) -> str | None:
    """The local ``$ref`` (``#/$defs/node``) on a cycle that leaves ``schema`` without a finite
    instance, or None (every instance the references allow can end, or the schema is not judged)."""
    if _has_nested_id(schema):
        return None
    refs = _Refs(schema)
    try:
        while True:
            if refs.ok(schema):
                return None
            known = len(refs.targets)
            grown = [r for r in list(refs.targets) if r not in refs.finite and refs.ok(refs.targets[r])]
            refs.finite.update(grown)
            if not grown and len(refs.targets) == known:
                break
        refs.endless_met = []
        refs.ok(schema)
        return next((r for r in dict.fromkeys(refs.endless_met) if refs.on_cycle(r)), None)
    except (_TooBig, RecursionError):
        return None
