"""The configuration files read, merged and schema-validated: YAML documents, deep merges, the JSON schema with its
defaults, and each scale's chain of files (its base scales first, then per paper). Nothing else of fedcore is imported
here: what a name may be (a dataset, a backbone, a paper) is handed in by the caller."""
from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import jsonschema
import yaml


CONFIG_DIR = "config"


TOP_WHERE = "the top-level config (config/config.yaml or --config)"


class ConfigError(ValueError):
    """A configuration problem, reported before any work is done."""


# libyaml's loader where PyYAML was built with it: the config files parse ~10x faster (every Snakemake start,
# and every cluster job, loads all of them at both scales)
_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


_YAML_CACHE: dict[tuple[str, int, int], Any] = {}  # (path, mtime_ns, size) -> parsed document


def paper_file(root: Path, folder: str, paper: str) -> Path:
    """A paper's file in ``config/<folder>/`` (experiments, reports)."""
    return root / CONFIG_DIR / folder / f"{paper}.yaml"


def read_yaml(path: Path) -> dict:
    """A YAML mapping (a fresh copy), with a clear error for a missing or malformed file."""
    if not path.exists():
        raise ConfigError(f"config file {path} does not exist")
    stat = path.stat()
    key = (str(path.resolve()), stat.st_mtime_ns, stat.st_size)
    if key not in _YAML_CACHE:
        _YAML_CACHE[key] = _parse_yaml(path, _YAML_LOADER)
    data = _YAML_CACHE[key]
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping, got {type(data).__name__}")
    return copy.deepcopy(data)


def check_config_file(path: Path) -> None:
    """Parse the workflow's config file as Snakemake's ``configfile:`` will (PyYAML's pure-Python loader, stricter
    about tabs than libyaml), so that a YAML mistake names the file, line and column: Snakemake's own message names
    neither; a key written twice is refused as in every config file. A missing file is left to Snakemake (a run
    may give ``--configfile`` instead)."""
    if path.exists():
        _parse_yaml(path, yaml.SafeLoader)


def _parse_yaml(path: Path, loader_class: type) -> Any:
    """The YAML document in ``path`` (a safe loader), or a ConfigError naming the file, line and column; a key
    written twice in one mapping is an error too, since YAML itself silently keeps the last one."""
    loader = loader_class(path.read_text())
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _refuse_repeated_keys(node, path)
        return loader.construct_document(node)
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from e
    finally:
        loader.dispose()


def _refuse_repeated_keys(root: yaml.Node, path: Path) -> None:
    """ConfigError for a mapping that writes one key twice (a copied experiment would silently replace the first).
    Keys a merge brings in (``<<: *anchor``) may be overridden: only the keys written in the mapping count."""
    stack, seen = [root], set()
    while stack:
        node = stack.pop()
        if id(node) in seen:  # an aliased node is walked once
            continue
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            lines: dict[tuple[str, str], int] = {}
            for key, value in node.value:
                if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                    line = key.start_mark.line + 1
                    if (key.tag, key.value) in lines:
                        raise ConfigError(f"config file {path}: key {key.value!r} is written twice in one mapping "
                                          f"(lines {lines[key.tag, key.value]} and {line}); YAML would keep only "
                                          "the second")
                    lines[key.tag, key.value] = line
                stack.extend((key, value))
        elif isinstance(node, yaml.SequenceNode):
            stack.extend(node.value)


def deep_merge(base: dict, override: dict) -> dict:
    """``base`` updated recursively by ``override`` (neither is modified)."""
    out = copy.deepcopy(base)
    for k, v in override.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def read_schema(root: Path, papers: list[str]) -> dict:
    """The JSON schema document, with the enum the code's registry owns filled in: ``papers`` (fedcore/papers.py)."""
    doc = read_yaml(root / CONFIG_DIR / "schema.yaml")
    doc["$defs"]["top"]["properties"]["papers"]["items"]["enum"] = list(papers)
    return doc


def _format_path(path) -> str:
    """'a.b[2].c' from a jsonschema error path."""
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "<top level>"


def _describe(schema: dict) -> str:
    """What one alternative of a ``oneOf`` accepts, in words: 'one of [...]', 'a non-empty list of str'."""
    if "enum" in schema:
        return f"one of {schema['enum']}"
    if schema.get("type") == "array":
        items = schema.get("items", {}).get("type")
        return ("a non-empty list" if schema.get("minItems") else "a list") + (f" of {items}" if items else "")
    if "required" in schema:
        return f"an entry with {schema['required']}"
    return f"a {schema['type']}" if "type" in schema else "a value of another shape"


def _allowed_hint(error: jsonschema.ValidationError) -> str:
    """The allowed keys for an error, when the schema says (an enum's own message lists its values); how to
    write a list where a single name was given (`--config outputs=sgpt_table1`, `papers=sgpt`)."""
    if error.validator == "additionalProperties" and "properties" in error.schema:
        return f"; allowed keys: {sorted(error.schema['properties'])}"
    alternatives = error.validator_value if error.validator == "oneOf" else []
    hint = f"; expected {' or '.join(_describe(s) for s in alternatives)}" if alternatives else ""
    wants_list = (error.validator == "type" and error.validator_value == "array"
                  or any(s.get("type") == "array" for s in alternatives))
    if wants_list and isinstance(error.instance, str):
        hint += f"; write a list, e.g. [{error.instance}]"
    return hint


def validate(instance: Any, schema_doc: dict, definition: str, where: str) -> None:
    """Validate ``instance`` against ``$defs/definition``; raise ConfigError naming the key and allowed values."""
    schema = {"$ref": f"#/$defs/{definition}", "$defs": schema_doc["$defs"]}
    errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(instance), key=lambda e: list(e.path))
    if errors:
        e = errors[0]
        raise ConfigError(f"config error in {where} at {_format_path(e.absolute_path)}: {e.message}{_allowed_hint(e)}")


def check_name(value: str, allowed, where: str, key: str) -> None:
    """A name must be one of the allowed ones."""
    if value not in allowed:
        raise ConfigError(f"config error in {where} at {key}: {value!r} is not one of {sorted(allowed)}")


def _as_yaml_scalars(value: Any) -> Any:
    """Strings inside lists and mappings read as YAML reads them ('-1' -> -1, '0.5' -> 0.5, 'true' -> True)."""
    if isinstance(value, list):
        return [_as_yaml_scalars(v) for v in value]
    if isinstance(value, dict):
        return {k: _as_yaml_scalars(v) for k, v in value.items()}
    if isinstance(value, str):
        try:
            parsed = yaml.safe_load(value)
        except yaml.YAMLError:
            return value
        return parsed if isinstance(parsed, (bool, int, float)) else value
    return value


def apply_defaults(config: dict, schema: dict) -> dict:
    """The top-level config with the schema's defaults (the one place they are written) filled in and command-line
    values typed as in a config file."""
    defaults = {k: v["default"] for k, v in schema["$defs"]["top"]["properties"].items() if "default" in v}
    # Snakemake parses `--config seeds=[0,-1]` with YAML's BaseLoader, so every scalar in a list reaches us as
    # a string (['0', '-1']); read them as a config file's YAML would, so both spellings get the same checks
    # and messages ("-1 is less than the minimum of 0", not "'-1' is not of type 'integer'").
    out = {**defaults, **{k: _as_yaml_scalars(v) if isinstance(v, (list, dict)) else v for k, v in config.items()}}
    if isinstance(out.get("seeds"), (int, str)):  # `seeds=0` reaches us as 0: one seed
        out["seeds"] = [out["seeds"]]
    return out


def check_output_dirs(top: dict) -> None:
    """``results`` and ``resources`` are directories, or do not exist yet (relative to Snakemake's working
    directory, where the pipeline writes them); this user may write ``results`` (or create it)."""
    for key in ("results", "resources"):
        path = Path(str(top[key]))
        for p in (path, *path.parents):
            if p.exists():
                if not p.is_dir():
                    raise ConfigError(f"config error in {TOP_WHERE} at {key}: {top[key]!r} must be a directory "
                                      f"(created if missing), but {str(p)!r} is a file")
                # every call writes under results (code fingerprints, logs); resources may be a site's read-only
                # copy of the datasets and weights
                if key == "results" and not os.access(p, os.W_OK | os.X_OK):
                    raise ConfigError(f"config error in {TOP_WHERE} at {key}: {top[key]!r} cannot be written: "
                                      f"this user may not write in {str(p)!r}")
                break


def _check_mappings(scale: dict, scale_file: Path, backbones: dict, datasets) -> None:
    """A scale's dataset and backbone mappings name concrete datasets and configured backbones."""
    for logical, concrete in scale.get("datasets", {}).items():
        check_name(concrete, datasets, str(scale_file), f"datasets.{logical}")
    for logical, concrete in scale.get("backbones", {}).items():
        check_name(concrete, backbones, str(scale_file), f"backbones.{logical}")


def _paper_scale(common: dict, common_file: Path, root: Path, scale: str, paper: str, schema: dict,
                 backbones: dict, datasets) -> tuple[dict, Path]:
    """The scale as one paper sees it: config/scales/<scale>/<paper>.yaml (if any) merged over the scale file;
    and the file that error messages name (the paper's own when it has one)."""
    path = root / CONFIG_DIR / "scales" / scale / f"{paper}.yaml"
    if not path.exists():
        return common, common_file
    overlay = read_yaml(path)
    validate(overlay, schema, "paper_scale_file", str(path))
    _check_mappings(overlay, path, backbones, datasets)
    return deep_merge(common, overlay), path


def scale_chain(root: Path, scale: str, schema: dict, backbones: dict, datasets) -> list[tuple[str, dict, Path]]:
    """The scale files from the first ``base`` down to ``scale``'s own: (name, document without ``base``, path),
    each validated and its mappings checked."""
    chain: list[tuple[str, dict, Path]] = []
    name: str | None = scale
    while name is not None:
        path = root / CONFIG_DIR / "scales" / f"{name}.yaml"
        if chain:
            below = chain[-1][2]
            if name in [n for n, _, _ in chain]:
                raise ConfigError(f"config error in {below} at base: {name!r} starts a cycle of scales "
                                  f"({' -> '.join([n for n, _, _ in chain] + [name])})")
            if not path.exists():
                raise ConfigError(f"config error in {below} at base: {name!r} is not a scale ({path} does not exist)")
        doc = read_yaml(path)
        validate(doc, schema, "scale_file", str(path))
        _check_mappings(doc, path, backbones, datasets)
        base = doc.pop("base", None)
        chain.append((name, doc, path))
        name = base
    return chain[::-1]


def merged(docs) -> dict:
    """The documents deep-merged in order (later ones win)."""
    out: dict = {}
    for doc in docs:
        out = deep_merge(out, doc)
    return out


def paper_scale_chain(chain: list[tuple[str, dict, Path]], root: Path, paper: str, schema: dict, backbones: dict,
                       datasets) -> tuple[dict, str]:
    """The scale as one paper sees it: for each scale of the chain (base first), its file and then its
    <scale>/<paper>.yaml, deep-merged in that order; and the file that error messages name (the top scale's paper
    file, else its scale file), with the base scale it extends."""
    layers, where = [], ""
    for name, doc, path in chain:
        layer, where = _paper_scale(doc, path, root, name, paper, schema, backbones, datasets)
        layers.append(layer)
    scale = merged(layers)
    missing = [k for k in ("datasets", "backbones") if k not in scale]
    if missing:
        raise ConfigError(f"config error in {chain[-1][2]}: {missing} are required (in it or in its base scale)")
    label = str(where) if len(chain) == 1 else f"{where} (over scale {' over '.join(n for n, _, _ in chain[-2::-1])})"
    return scale, label
