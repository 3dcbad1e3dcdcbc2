"""CEL validation rules (``x-kubernetes-validations``) of a CRD, as the 1.32 API server runs them.

Evaluated with cel-python (``celpy``), a maintained CEL interpreter, not the cel-go the API server
embeds. What is modeled, in the server's order:

- CRD create/update: every rule is parsed; one that does not parse (or names a variable other than
  ``self``, ``oldSelf`` or a macro's own) refuses the CRD, 422 naming
  ``spec.versions[i].schema.openAPIV3Schema.properties[...].x-kubernetes-validations[j].rule``.
- Custom resource create/update/patch, the ``/status`` subresource included (the server checks the
  whole object there too; the spec is the stored one, so a spec transition rule holds): once the
  OpenAPI checks have passed (a type, required, enum, too-long or too-many error blocks the rules,
  as ``hasBlockingErr`` does), each rule runs with ``self`` bound to the value at its schema node,
  null values skipped. At the root ``self`` carries apiVersion, kind and ``metadata`` with only
  name and generateName.
- Transition rules (those that reference ``oldSelf``) run on update only, and only where the old
  object has a value that correlates: an object's property or additionalProperties key, a
  ``x-kubernetes-list-type: map`` item by its keys; never on create, never in other lists.
- A rule that is false: a FieldValueInvalid cause at the node's path (``<nil>`` for the root, plus
  the rule's ``fieldPath``), ``Invalid value: "<schema type>": <message>`` (``failed rule: <rule>``
  without a message), or the ``reason`` it names (Forbidden, Required, Duplicate). That is 1.32's
  shape: later servers put the value itself where 1.32 puts the schema type.
- A rule that fails to evaluate (no such key, bad overload): ``<error> evaluating rule: <rule>``.
- Ratcheting (CRDValidationRatcheting, on by default since 1.30): a false rule that does not use
  ``oldSelf``, at a node whose value is unchanged from the correlated old value, is a warning
  (``Warning: spec.size: Invalid value: "integer": ...``), not an error.
- An empty rule refuses the CRD (Required); an unknown ``reason`` too.

Not modeled: type checking against the schema (cel-go refuses ``self.nosuchfield``, a non-bool
rule, a wrong overload when the CRD is created; here those surface when a rule runs, as evaluation
errors), the Kubernetes CEL libraries beyond what celpy ships (``isURL``, ``quantity``, ``format``…),
``messageExpression``, ``optionalOldSelf``, the cost budgets (per rule, per CRD, per request),
refusing ``oldSelf`` on an uncorrelatable node at CRD creation, ratcheting an item of a list that
does not correlate by way of its unchanged parent, values typed by the schema (a JSON number is a
CEL int or double as written, not as ``type: number`` says), and cel-go's exact error wording for
parse and evaluation errors (the field path and the start of the message match).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import celpy
import lark

from .schema import FieldError, subschemas

# The CEL macros whose first argument names a variable bound in the rest of the call.
_MACROS = frozenset({"all", "exists", "exists_one", "map", "filter"})
# Type names CEL lets an expression mention (``type(self) == string``).
_TYPE_NAMES = frozenset({"int", "uint", "double", "bool", "string", "bytes", "list", "map", "null_type", "type", "dyn"})
_REASONS = frozenset({"FieldValueInvalid", "FieldValueForbidden", "FieldValueRequired", "FieldValueDuplicate"})

_ENV = celpy.Environment()


@dataclass(frozen=True)
class CompiledRule:
    """One ``x-kubernetes-validations`` entry, parsed."""

    rule: str
    message: str
    reason: str
    field_path: str
    program: celpy.Runner
    uses_old_self: bool

    def failure_detail(self) -> str:
        """``ruleMessageOrDefault``: the trimmed message, or ``failed rule: <rule>``."""
        return self.message or f"failed rule: {self.rule}"

    def error_string(self) -> str:
        """``ruleErrorString``: how an evaluation error names the rule."""
        return self.message or self.rule


class RuleCompileError(ValueError):
    """A rule the API server would not compile; ``str()`` is the detail a 422 carries."""


def _identifiers(tree: lark.Tree) -> tuple[set[str], set[str]]:
    """The identifiers an expression references, and those its macros bind."""
    used: set[str] = set()
    bound: set[str] = set()
    for node in tree.iter_subtrees():
        if node.data == "ident" and node.children:
            used.add(str(node.children[0]))
        elif node.data == "member_dot_arg" and len(node.children) >= 3:
            name, args = node.children[1], node.children[2]
            if str(name) in _MACROS and isinstance(args, lark.Tree) and args.children:
                first = args.children[0]
                for sub in first.iter_subtrees() if isinstance(first, lark.Tree) else ():
                    if sub.data == "ident" and sub.children:
                        bound.add(str(sub.children[0]))
    return used, bound


def compile_rule(entry: dict[str, Any]) -> CompiledRule:
    """Parse one rule; raises RuleCompileError with the API server's detail when it cannot."""
    source = str(entry.get("rule") or "")
    if not source.strip():
        raise RuleCompileError("rule is not specified")
    try:
        tree = _ENV.compile(source)
    except celpy.CELParseError as e:
        # cel-go: "ERROR: <input>:1:9: Syntax error: mismatched input ..."; celpy names no token.
        where = f"{e.line}:{(e.column or 0) + 1}" if e.line is not None else "1:1"
        raise RuleCompileError(f"compilation failed: ERROR: <input>:{where}: Syntax error: {source!r}") from None
    used, bound = _identifiers(tree)
    undeclared = sorted(used - bound - _TYPE_NAMES - {"self", "oldSelf"})
    if undeclared:
        raise RuleCompileError(f"compilation failed: ERROR: <input>: undeclared reference to '{undeclared[0]}'")
    reason = str(entry.get("reason") or "FieldValueInvalid")
    if reason not in _REASONS:
        raise RuleCompileError(f"unsupported reason {reason!r}: supported values: {', '.join(sorted(_REASONS))}")
    return CompiledRule(
        rule=source.strip(),
        message=str(entry.get("message") or "").strip(),
        reason=reason,
        field_path=str(entry.get("fieldPath") or "").lstrip("."),
        program=_ENV.program(tree),
        uses_old_self="oldSelf" in used,
    )


def _go_repr(value: Any) -> str:
    """``%#v`` of a Go string, enough for the bad value a compile error shows."""
    return json.dumps(value, ensure_ascii=False)


def crd_rule_errors(schema: dict[str, Any], path: str) -> list[FieldError]:
    """What CRD validation says about the rules of one ``openAPIV3Schema``: every rule compiles."""
    errors: list[FieldError] = []

    def walk(node: Any, here: str) -> None:
        if not isinstance(node, dict):
            return
        for i, entry in enumerate(node.get("x-kubernetes-validations") or []):
            where = f"{here}.x-kubernetes-validations[{i}].rule"
            try:
                compile_rule(entry if isinstance(entry, dict) else {})
            except RuleCompileError as e:
                if str(e) == "rule is not specified":
                    errors.append(FieldError("FieldValueRequired", where, f"Required value: {e}"))
                    continue
                entry = entry if isinstance(entry, dict) else {}
                reason = "(nil)" if entry.get("reason") is None else "(0xc000000000)"
                optional = "(nil)" if entry.get("optionalOldSelf") is None else "(0xc000000000)"
                bad = (
                    f"apiextensions.ValidationRule{{Rule:{_go_repr(entry.get('rule', ''))}, "
                    f"Message:{_go_repr(entry.get('message', ''))}, "
                    f"MessageExpression:{_go_repr(entry.get('messageExpression', ''))}, "
                    f"Reason:(*apiextensions.FieldValueErrorReason){reason}, "
                    f"FieldPath:{_go_repr(entry.get('fieldPath', ''))}, OptionalOldSelf:(*bool){optional}}}"
                )
                errors.append(FieldError("FieldValueInvalid", where, f"Invalid value: {bad}: {e}"))
        for sub, where in subschemas(node, here):
            walk(sub, where)

    walk(schema, path)
    return errors


@dataclass
class RuleOutcome:
    errors: list[FieldError]
    warnings: list[str]


_MISSING = object()


class RuleValidator:
    """The rules of one ``openAPIV3Schema``, compiled once when the CRD is served."""

    def __init__(self, schema: dict[str, Any]) -> None:
        self.schema = schema
        self._compiled: dict[int, list[CompiledRule]] = {}
        self._index(schema)

    def _index(self, node: Any) -> None:
        if not isinstance(node, dict):
            return
        entries = node.get("x-kubernetes-validations") or []
        # The CRD was refused if a rule does not compile; an old stored one is skipped, not fatal.
        compiled = []
        for entry in entries:
            try:
                compiled.append(compile_rule(entry))
            except RuleCompileError:
                continue
        if compiled:
            self._compiled[id(node)] = compiled
        for sub in (node.get("properties") or {}).values():
            self._index(sub)
        for key in ("items", "additionalProperties"):
            self._index(node.get(key))

    @property
    def has_rules(self) -> bool:
        return bool(self._compiled)

    def validate(self, obj: dict[str, Any], old: dict[str, Any] | None) -> RuleOutcome:
        """Run every rule over ``obj`` (``old`` is the stored object on update, None on create)."""
        out = RuleOutcome([], [])
        root_new = _root_view(obj)
        root_old = _root_view(old) if old is not None else _MISSING
        self._node(self.schema, root_new, root_old, "<nil>", out, root=True)
        return out

    def _node(self, schema: dict[str, Any], value: Any, old: Any, path: str, out: RuleOutcome, root: bool) -> None:
        if value is None:
            return
        for rule in self._compiled.get(id(schema), ()):
            self._run(rule, schema, value, old, path, out)
        if isinstance(value, dict):
            props = schema.get("properties") or {}
            addl = schema.get("additionalProperties")
            for key, item in value.items():
                if root and key == "metadata":
                    continue
                sub = props.get(key) if key in props else (addl if isinstance(addl, dict) else None)
                if sub is None:
                    continue
                old_item = old.get(key, _MISSING) if isinstance(old, dict) else _MISSING
                child = key if root else f"{path}.{key}" if key in props else f"{path}[{key}]"
                self._node(sub, item, old_item, child, out, root=False)
        elif isinstance(value, list) and isinstance(schema.get("items"), dict):
            old_items = _map_list(schema, old)
            for i, item in enumerate(value):
                old_item = old_items.get(_list_key(schema, item), _MISSING) if old_items else _MISSING
                self._node(schema["items"], item, old_item, f"{path}[{i}]", out, root=False)

    def _run(
        self, rule: CompiledRule, schema: dict[str, Any], value: Any, old: Any, path: str, out: RuleOutcome
    ) -> None:
        if rule.uses_old_self and old is _MISSING:
            return  # transition rules need a value to compare with
        typ = str(schema.get("type") or ("object" if path == "<nil>" else ""))
        activation = {"self": celpy.json_to_cel(value)}
        if rule.uses_old_self:
            activation["oldSelf"] = celpy.json_to_cel(old)
        where = path if not rule.field_path else (rule.field_path if path == "<nil>" else f"{path}.{rule.field_path}")
        result: Any
        try:
            result = rule.program.evaluate(activation)
        except celpy.CELEvalError as e:
            result = e
        if isinstance(result, celpy.CELEvalError):
            detail = result.args[0] if result.args else str(result)
            out.errors.append(
                FieldError(
                    "FieldValueInvalid",
                    path,
                    f'Invalid value: "{typ}": {detail} evaluating rule: {rule.error_string()}',
                )
            )
            return
        if not isinstance(result, celpy.celtypes.BoolType):
            out.errors.append(
                FieldError(
                    "FieldValueInvalid",
                    path,
                    f'Invalid value: "{typ}": rule did not evaluate to a bool evaluating rule: {rule.error_string()}',
                )
            )
            return
        if bool(result):
            return
        error = _field_error(rule, where, typ)
        if not rule.uses_old_self and old is not _MISSING and old == value:
            out.warnings.append(f"{error.field}: {error.message}")
        else:
            out.errors.append(error)


def _field_error(rule: CompiledRule, path: str, typ: str) -> FieldError:
    """``fieldErrorForReason``: the rule's reason decides the error's type."""
    detail = rule.failure_detail()
    if rule.reason == "FieldValueForbidden":
        return FieldError(rule.reason, path, f"Forbidden: {detail}")
    if rule.reason == "FieldValueRequired":
        return FieldError(rule.reason, path, f"Required value: {detail}")
    if rule.reason == "FieldValueDuplicate":
        return FieldError(rule.reason, path, f'Duplicate value: "{typ}"')
    return FieldError("FieldValueInvalid", path, f'Invalid value: "{typ}": {detail}')


def _root_view(obj: dict[str, Any]) -> dict[str, Any]:
    """``self`` at the root: the object with metadata cut to name and generateName."""
    md = obj.get("metadata") or {}
    view = {k: v for k, v in obj.items() if k != "metadata"}
    view["metadata"] = {k: md[k] for k in ("name", "generateName") if k in md}
    return view


def _list_key(schema: dict[str, Any], item: Any) -> str:
    keys = schema.get("x-kubernetes-list-map-keys") or []
    return json.dumps([item.get(k) if isinstance(item, dict) else None for k in keys])


def _map_list(schema: dict[str, Any], old: Any) -> dict[str, Any]:
    """A ``list-type: map`` list's old items by their keys; other lists do not correlate."""
    if schema.get("x-kubernetes-list-type") != "map" or not isinstance(old, list):
        return {}
    return {_list_key(schema, item): item for item in old}
