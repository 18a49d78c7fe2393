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

import hashlib
import json
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

import jsonschema
import yaml

from dsv4convert.convert.engines import CHOICES, VLLM, engines_for
from dsv4convert.errors import RecipeError
from dsv4convert.formats.int4 import DEFAULT_SCALE_RULE, SCALE_RULES
from dsv4convert.layout import Role, TensorInfo
from dsv4convert.storage import Format

RECIPE_DIR = Path(__file__).resolve().parent.parent / "recipes"
SHIPPED = ("fp8", "nvfp4", "nvfp4-mtp-mxfp4", "w4a16", "bf16")
TARGETS = ("keep", "bf16", "fp8", "nvfp4", "int4")
MAX_RECIPE_BYTES = 1024 * 1024

_ROLE_NAMES = [r.value for r in Role]
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
                    "params": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "group_size": {"enum": [32, 128]},
                            "scale_rule": {"enum": list(SCALE_RULES)},
                            "scale_dtype": {"enum": ["e8m0", "float32"]},
                        },
                    },
                    "reason": {"type": "string", "minLength": 3},
                },
                "allOf": [
                    {"if": {"properties": {"format": {"enum": ["keep", "bf16"]}}},
                     "then": {"required": ["reason"]}},
                    {"if": {"properties": {"format": {"const": "int4"}}},
                     "then": {"properties": {"params": {"properties": {"scale_dtype": False}}}}},
                    {"if": {"properties": {"format": {"const": "fp8"}}},
                     "then": {"properties": {"params": {"properties": {"group_size": False, "scale_rule": False}}}}},
                    {"if": {"properties": {"format": {"enum": ["keep", "bf16", "nvfp4"]}}},
                     "then": {"properties": {"params": {"maxProperties": 0}}}},
                ],
            },
        },
    },
}

# SGLang 0.5.23 builds these with quant_config=None (srt/models/deepseek_v4.py, layers/attention/dsv4/
# compressor.py, indexer.py) or never quantizes them for V4; a quantized tensor there would not load.
NEVER_QUANTIZED = {
    Role.COMPRESSOR: "SGLang builds the compressor wkv/wgate with quant_config=None",
    Role.INDEXER_COMPRESSOR: "SGLang builds the indexer's compressor with quant_config=None",
    Role.INDEXER_WEIGHTS_PROJ: "SGLang builds indexer weights_proj with quant_config=None",
    Role.ROUTER: "the router gate runs in BF16/FP32 in every engine",
    Role.EMBED: "an embedding is a lookup table, not a GEMM",
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
                if target.format is Format.FP8 and "scale_dtype" not in target.params:
                    target = replace(target, params={**target.params,
                                                     "scale_dtype": _fp8_scale_dtype(info, engine)})
                return target
        raise RecipeError(f"no rule matches module '{info.module}' (role {info.role.value}) for --engine {engine}; "
                          "add a rule for it (recipes must cover every module)", file=self.source)


def _fp8_scale_dtype(info: TensorInfo, engine: str) -> str:
    """vLLM 0.33.0 reads FP8 expert scales only as float32 (engines.vllm_problem); E8M0 otherwise."""
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


def parse_recipe(text: str, source: str) -> Recipe:
    """Parse and validate recipe text; every error names ``source`` and the path inside it."""
    try:
        data = _load_yaml(text)
    except yaml.YAMLError as exc:
        raise RecipeError(f"not valid YAML ({' '.join(str(exc).split())})", file=source) from None
    except RecursionError:
        raise RecipeError("YAML is nested too deeply", file=source) from None
    validator = jsonschema.Draft202012Validator(SCHEMA)
    try:
        errors = sorted(validator.iter_errors(data),
                        key=lambda e: (len(e.absolute_path), list(map(str, e.absolute_path))))
    except RecursionError:
        raise RecipeError("YAML is nested too deeply", file=source) from None
    if errors:
        err = errors[-1] if errors[-1].validator != "oneOf" else errors[0]
        message = err.message
        if err.validator == "additionalProperties":
            message = f"unknown key: {message}"
        raise RecipeError(f"at {_format_path(err.absolute_path)}: {message}", file=source)
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
        if fmt is Format.INT4:
            params.setdefault("group_size", 128)
            params.setdefault("scale_rule", DEFAULT_SCALE_RULE)
        # An FP8 rule without scale_dtype leaves the block scales to the engines (convert.engines).
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
    """A recipe file, or the name of a shipped recipe (one of ``SHIPPED``)."""
    path = Path(path_or_name)
    if not path.exists() and str(path_or_name) in SHIPPED:
        path = RECIPE_DIR / f"{path_or_name}.yaml"
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
    """The recipe with ``wanted`` set in the params of every ``fmt`` rule (unchanged if they all have them)."""
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
    if scale_dtype == "auto" or all(r.target.params.get("scale_dtype") == scale_dtype for r in recipe.rules
                                    if r.target.format is Format.FP8):
        return recipe
    return _with_params(recipe, "fp8", {"scale_dtype": scale_dtype}, f"scale_dtype {scale_dtype}")


def with_int4_params(recipe: Recipe, *, group_size: int | None = None, scale_rule: str | None = None) -> Recipe:
    """The recipe with every INT4 rule's ``group_size`` / ``scale_rule`` overridden where given
    (``to-w4a16 --group-size / --scale-rule``)."""
    wanted = {key: value for key, value in (("group_size", group_size), ("scale_rule", scale_rule))
              if value is not None}
    if all(r.target.params.get(key) == value for r in recipe.rules if r.target.format is Format.INT4
           for key, value in wanted.items()):
        return recipe
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
