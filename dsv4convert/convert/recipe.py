"""Recipes: which module of DeepSeek-V4 gets which format, and why.

A recipe is a YAML file with an ordered list of rules; for every module of the
checkpoint the first matching rule decides its target (``keep`` leaves the tensors as
the source has them). Every module must be matched, and every rule that leaves modules
unquantized says why, so a recipe documents its own ignore list. Recipes are checked
with a JSON schema (an unknown key or a bad value names its path in the file), then
against the checkpoint (a format that cannot apply to a module is an error naming
both).
"""

from __future__ import annotations

import difflib
import hashlib
import json
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

import jsonschema
import yaml

from dsv4convert import variants
from dsv4convert.engines import CHOICES, VLLM, engines_for
from dsv4convert.errors import RecipeError
from dsv4convert.formats import REGISTRY, Format, recipe_targets
from dsv4convert.models.deepseek_v4.layout import Role, TensorInfo

RECIPE_DIR = Path(__file__).resolve().parent.parent / "recipes"
SHIPPED = variants.SHIPPED_RECIPES
TARGETS = ("keep", *(fmt.value for fmt in recipe_targets()))
MAX_RECIPE_BYTES = 1024 * 1024

_ROLE_NAMES = [r.value for r in Role]


def _params_of(target: str) -> dict[str, dict]:
    return {} if target == "keep" else REGISTRY[Format(target)].recipe_params


SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "rules"],
    "properties": {
        "name": {"type": "string", "pattern": r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"},
        "description": {"type": "string"},
        "engine": {"enum": list(CHOICES)},
        "rules": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": ["match", "format"],
                "properties": {
                    "match": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "role": {"oneOf": [
                                {"enum": _ROLE_NAMES},
                                {"type": "array", "items": {"enum": _ROLE_NAMES}, "minItems": 1, "uniqueItems": True},
                            ]},
                            "mtp": {"type": "boolean"},
                            "module": {"type": "string", "minLength": 1},
                            "engine": {"oneOf": [
                                {"enum": list(CHOICES)},
                                {"type": "array", "items": {"enum": list(CHOICES)}, "minItems": 1,
                                 "uniqueItems": True},
                            ]},
                        },
                    },
                    "format": {"enum": list(TARGETS)},
                    "params": {"type": "object"},
                    "reason": {"type": "string", "minLength": 3},
                },
                "allOf": [
                    {"if": {"properties": {"format": {"enum": ["keep", "bf16"]}}},
                     "then": {"required": ["reason"]}},
                    # Each format takes the params its spec names (formats/specs.py), keep none.
                    *({"if": {"properties": {"format": {"const": target}}},
                       "then": {"properties": {"params": {"additionalProperties": False,
                                                          "properties": _params_of(target)}}}}
                      for target in TARGETS),
                ],
            },
        },
    },
}


@dataclass(frozen=True)
class Target:
    """What one module becomes: ``format`` None means keep the source tensors."""

    format: Format | None
    params: dict = field(default_factory=dict)
    reason: str | None = None
    rule: int = -1


@dataclass(frozen=True)
class Rule:
    roles: frozenset[Role] | None
    mtp: bool | None
    module: re.Pattern | None
    target: Target
    engines: frozenset[str] | None = None  # engine choices (sglang/vllm/both) the rule applies to
    comment: str | None = None             # written above the rule (a recipe built in code says why)

    def as_data(self) -> dict:
        """The rule as the recipe language writes it (what the schema validates)."""
        match: dict = {}
        if self.roles is not None:
            roles = sorted(r.value for r in self.roles)
            match["role"] = roles[0] if len(roles) == 1 else roles
        if self.mtp is not None:
            match["mtp"] = self.mtp
        if self.module is not None:
            match["module"] = self.module.pattern
        if self.engines is not None:
            choices = sorted(self.engines)
            match["engine"] = choices[0] if len(choices) == 1 else choices
        data: dict = {"match": match, "format": self.target.format.value if self.target.format else "keep"}
        given = {k: v for k, v in self.target.params.items()
                 if self.target.format is None or REGISTRY[self.target.format].recipe_defaults.get(k) != v}
        if given:
            data["params"] = given
        if self.target.reason:
            data["reason"] = self.target.reason
        return data

    def matches(self, info: TensorInfo, engine: str) -> bool:
        return (
            (self.roles is None or info.role in self.roles)
            and (self.mtp is None or info.is_mtp == self.mtp)
            and (self.module is None or self.module.fullmatch(info.module) is not None)
            and (self.engines is None or engine in self.engines)
        )


@dataclass(frozen=True)
class Recipe:
    name: str
    description: str
    rules: tuple[Rule, ...]
    source: str
    text: str
    engine: str | None = None  # the recipe's `engine:` key (None: not stated)

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()

    def target_for(self, info: TensorInfo, engine: str = "both") -> Target:
        """The first matching rule's target when converting for ``engine`` (sglang/vllm/both)."""
        for rule in self.rules:
            if rule.matches(info, engine):
                target = rule.target
                if target.format and "scale_dtype" in REGISTRY[target.format].recipe_params \
                        and "scale_dtype" not in target.params:   # left to the engines
                    target = replace(target, params={**target.params,
                                                     "scale_dtype": _fp8_scale_dtype(info, engine)})
                return target
        raise RecipeError(f"no rule matches module '{info.module}' (role {info.role.value}) for --engine {engine}; "
                          "add a rule for it (recipes must cover every module)", file=self.source)


    @classmethod
    def of(cls, name: str, description: str, rules: list[Rule], *, engine: str | None = None,
           header: tuple[str, ...] = (), source: str | None = None) -> "Recipe":
        """A recipe built in code (automix's): checked by the schema like a file, its text the YAML it writes
        (each rule's comment above it, ``header`` as comments on top)."""
        data = {"name": name, "description": description, **({"engine": engine} if engine else {}),
                "rules": [rule.as_data() for rule in rules]}
        label = source or f"<recipe {name}>"
        _validate(data, label)
        numbered = tuple(replace(rule, target=replace(rule.target, rule=i)) for i, rule in enumerate(rules))
        return cls(name, description, numbered, label, _render(data, numbered, header), engine)


def rule(*, roles: tuple[Role, ...] | None = None, mtp: bool | None = None, module: str | None = None,
         fmt: Format | None = None, params: dict | None = None, reason: str | None = None,
         engines: tuple[str, ...] | None = None, comment: str | None = None) -> Rule:
    """One rule in code: match these roles / MTP side / module regex (full match) / engine choices, store as
    ``fmt`` (None: keep the source's tensors) with ``params`` over the format's defaults."""
    target_params = {**(REGISTRY[fmt].recipe_defaults if fmt is not None else {}), **(params or {})}
    return Rule(frozenset(roles) if roles else None, mtp, re.compile(module) if module else None,
                Target(fmt, target_params, reason), frozenset(engines) if engines else None, comment)


def _yaml_scalar(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(_yaml_scalar(v) for v in value) + "]"
    text = str(value)
    plain = re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.+-]*", text) and text not in ("true", "false", "null", "yes", "no")
    return text if plain else "'" + text.replace("'", "''") + "'"


def _render(data: dict, rules: tuple[Rule, ...], header: tuple[str, ...]) -> str:
    """The recipe as YAML text, one flow-style match per rule, comments where the rules carry them."""
    out = [f"# {line}" for line in header]
    out += [f"name: {data['name']}", "description: >", f"  {data['description']}"]
    if "engine" in data:
        out.append(f"engine: {data['engine']}")
    out.append("rules:")
    for rule_, raw in zip(rules, data["rules"]):
        if rule_.comment:
            out.append(f"  # {rule_.comment}")
        match = ", ".join(f"{k}: {_yaml_scalar(v)}" for k, v in raw["match"].items())
        out.append(f"  - match: {{{match}}}")
        out.append(f"    format: {raw['format']}")
        if "params" in raw:
            out.append("    params: {" + ", ".join(f"{k}: {_yaml_scalar(v)}" for k, v in raw["params"].items()) + "}")
        if "reason" in raw:
            out.append(f"    reason: {_yaml_scalar(raw['reason'])}")
    return "\n".join(out) + "\n"


def _fp8_scale_dtype(info: TensorInfo, engine: str) -> str:
    """The FP8 block scales the engines read: float32 for routed experts vLLM loads
    (engines/vllm/quant_config.py::vllm_problem), E8M0 (the release's form) otherwise."""
    return "float32" if info.role is Role.ROUTED_EXPERT and VLLM in engines_for(engine) else "e8m0"


def _format_path(path) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


class _RecipeLoader(yaml.SafeLoader):
    """Safe YAML without aliases: ``*name`` lets a few hundred bytes stand for an exponentially
    large document (a "billion laughs"), which schema validation would then walk for hours."""

    def compose_node(self, parent, index):  # noqa: ANN001, ANN201 - PyYAML's signature
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(None, None, f"aliases (*{event.anchor}) are not allowed in a recipe",
                                              event.start_mark)
        return super().compose_node(parent, index)


def _load_yaml(text: str) -> object:
    return yaml.load(text, Loader=_RecipeLoader)  # noqa: S506 - a SafeLoader subclass


def _validate(data: object, source: str) -> None:
    """The schema's verdict on a recipe's data: the first error, naming its path in the recipe."""
    validator = jsonschema.Draft202012Validator(SCHEMA)
    try:
        errors = sorted(validator.iter_errors(data),
                        key=lambda e: (len(e.absolute_path), list(map(str, e.absolute_path))))
    except RecursionError:
        raise RecipeError("YAML is nested too deeply", file=source) from None
    if errors:
        # A misspelt key is the cause of the "required" error beside it: name the key, not the symptom.
        unknown = [e for e in errors if e.validator == "additionalProperties"]
        err = unknown[-1] if unknown else errors[-1] if errors[-1].validator != "oneOf" else errors[0]
        message = _unknown_keys(err) if unknown else err.message
        raise RecipeError(f"at {_format_path(err.absolute_path)}: {message}", file=source)


def _unknown_keys(err: jsonschema.ValidationError) -> str:
    """'unknown key 'reasn' (did you mean 'reason'?)': each key the schema does not know, with the closest one
    it does (difflib), or the keys it knows when none is close."""
    known = sorted(err.schema.get("properties", {}))
    parts = []
    for key in sorted(map(str, set(err.instance) - set(known))):
        close = difflib.get_close_matches(key, known, n=1)
        hint = f"did you mean '{close[0]}'?" if close else \
            f"known: {', '.join(known)}" if known else "this takes no keys"
        parts.append(f"'{key}' ({hint})")
    return f"unknown key{'s' if len(parts) > 1 else ''} " + ", ".join(parts)


def parse_recipe(text: str, source: str) -> Recipe:
    """Parse and validate recipe text; every error names ``source`` and the path inside it."""
    try:
        data = _load_yaml(text)
    except yaml.YAMLError as exc:
        raise RecipeError(f"not valid YAML ({' '.join(str(exc).split())})", file=source) from None
    except RecursionError:
        raise RecipeError("YAML is nested too deeply", file=source) from None
    _validate(data, source)
    rules = []
    for i, raw in enumerate(data["rules"]):
        match = raw.get("match", {})
        roles = match.get("role")
        if isinstance(roles, str):
            roles = [roles]
        pattern = None
        if "module" in match:
            try:
                pattern = re.compile(match["module"])
            except re.error as exc:
                raise RecipeError(f"at rules[{i}].match.module: bad regular expression ({exc})", file=source) from None
        fmt = None if raw["format"] == "keep" else Format(raw["format"])
        params = dict(raw.get("params", {}))
        if fmt is not None:
            params = {**REGISTRY[fmt].recipe_defaults, **params}
        engines = match.get("engine")
        if isinstance(engines, str):
            engines = [engines]
        rules.append(Rule(
            roles=frozenset(Role(r) for r in roles) if roles else None,
            mtp=match.get("mtp"),
            module=pattern,
            target=Target(fmt, params, raw.get("reason"), i),
            engines=frozenset(engines) if engines else None,
        ))
    return Recipe(data["name"], data.get("description", ""), tuple(rules), source, text, data.get("engine"))


def load_recipe(path_or_name: str | Path) -> Recipe:
    """The shipped recipe of that name (one of ``SHIPPED``), else a recipe file. A bare shipped name never
    reads the working directory (a folder called ``fp8`` there must not shadow ``to-fp8``'s recipe); a file
    named like one is ``./fp8``."""
    path = RECIPE_DIR / f"{path_or_name}.yaml" if str(path_or_name) in SHIPPED else Path(path_or_name)
    try:
        if path.stat().st_size > MAX_RECIPE_BYTES:
            raise RecipeError(f"recipe is larger than {MAX_RECIPE_BYTES} bytes", file=path)
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RecipeError("recipe file not found", file=path) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise RecipeError(f"cannot read recipe ({exc})", file=path) from None
    return parse_recipe(text, str(path))


def _with_params(recipe: Recipe, fmt: str, wanted: dict, label: str) -> Recipe:
    """The recipe with ``wanted`` set in the params of every ``fmt`` rule (unchanged if they all resolve to them)."""
    if all(r.target.params.get(key) == value for r in recipe.rules if r.target.format and r.target.format.value == fmt
           for key, value in wanted.items()):
        return recipe
    data = yaml.safe_load(recipe.text)
    changed = False
    for rule in data["rules"]:
        if rule["format"] != fmt:
            continue
        params = rule.setdefault("params", {})
        for key, value in wanted.items():
            if params.get(key) != value:
                params[key] = value
                changed = True
    if not changed:
        return recipe
    return parse_recipe(yaml.safe_dump(data, sort_keys=False), f"{recipe.source} ({label})")


def with_fp8_scale_dtype(recipe: Recipe, scale_dtype: str) -> Recipe:
    """The recipe with every FP8 rule's block scales in ``scale_dtype`` (``to-fp8 --scale-dtype``;
    ``auto`` leaves the recipe as it is, and the engines choose)."""
    if scale_dtype == "auto":
        return recipe
    return _with_params(recipe, "fp8", {"scale_dtype": scale_dtype}, f"scale_dtype {scale_dtype}")


def with_int4_params(recipe: Recipe, *, group_size: int | None = None, scale_rule: str | None = None) -> Recipe:
    """The recipe with every INT4 rule's ``group_size`` / ``scale_rule`` overridden where given
    (``to-w4a16 --group-size / --scale-rule``)."""
    wanted = {key: value for key, value in (("group_size", group_size), ("scale_rule", scale_rule))
              if value is not None}
    return _with_params(recipe, "int4", wanted, ", ".join(f"{k} {v}" for k, v in wanted.items()))


def with_mtp_experts(recipe: Recipe, fmt: str) -> Recipe:
    """The recipe with the MTP draft's routed experts stored as ``fmt`` (fp8, bf16 or keep) for every
    engine (``to-nvfp4 --mtp-experts``): its MTP routed-expert rules are replaced by one rule."""
    data = yaml.safe_load(recipe.text)
    reasons = {"keep": "MXFP4 draft experts kept as released (--mtp-experts mxfp4)",
               "bf16": "BF16 draft experts, exact from MXFP4 (--mtp-experts bf16)"}
    rule = {"match": {"role": "routed_expert", "mtp": True}, "format": fmt}
    if fmt in reasons:
        rule["reason"] = reasons[fmt]
    kept, placed = [], False
    for raw in data["rules"]:
        match = raw.get("match", {})
        if match.get("role") == "routed_expert" and match.get("mtp") is True:
            if not placed:
                kept.append(rule)
                placed = True
            continue
        kept.append(raw)
    if not placed:
        raise RecipeError("the recipe has no rule for the MTP draft's routed experts (match role routed_expert, "
                          "mtp true) to replace", file=recipe.source)
    data["rules"] = kept
    return parse_recipe(yaml.safe_dump(data, sort_keys=False), f"{recipe.source} (MTP experts {fmt})")


def canonical(recipe: Recipe) -> str:
    """A stable text of the recipe's meaning, for resume signatures.

    The resolved parameters of every rule are part of it, so a default that changes between
    versions (the INT4 ``scale_rule``) makes a resume refuse rather than mix two numerics.
    """
    resolved = [dict(rule.target.params) for rule in recipe.rules]
    return json.dumps({"recipe": _load_yaml(recipe.text), "resolved_params": resolved}, sort_keys=True)
