"""YAML -> validated ``Config``: loading, dotted overrides, dict round trip, generated reference.

    cfg = load_config("configs/gpt_tiny.yaml", ["training.train_iters=50", "precision.level=bf16"])

Strict by design: unknown sections and keys, wrong types, bad enum values and inconsistent
combinations are all ``ConfigError`` with a one-line message that names the dotted key, so the
entry point can print it and exit 2 instead of training the wrong thing for hours.

The schema (sections, defaults, documentation, per-field checks) is in ``config_schema.py``.
Resolved values: ``cfg.model.ffn_size()``, ``kv_channels_or_default()``, ``query_groups()``,
``max_positions()``, ``padded_vocab_size(v, tp)``; ``cfg.resolved_checkpoint_dir()`` and
``cfg.resolved_lr_decay_iters()``. ``python -m training.config --reference`` prints the
reference that docs/CONFIG.md must equal (a test checks it).
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import sys
from collections.abc import Iterable, Mapping
from typing import Any

import yaml

from families import DEFAULT_FAMILY
from training.config_schema import (
    PRECISION_LEVELS,
    CheckpointConfig,
    Config,
    ConfigError,
    DataConfig,
    LoggingConfig,
    OptimizerConfig,
    ParallelConfig,
    PrecisionConfig,
    TrainingConfig,
    field_spec,
    sections_for,
    show_value,
)

__all__ = [
    "ConfigError",
    "Config",
    "DataConfig",
    "TrainingConfig",
    "OptimizerConfig",
    "PrecisionConfig",
    "ParallelConfig",
    "LoggingConfig",
    "CheckpointConfig",
    "PRECISION_LEVELS",
    "load_config",
    "config_from_dict",
    "config_to_dict",
    "apply_overrides",
    "granularity_overrides",
    "parse_yaml",
    "config_reference_markdown",
]


class _Loader(yaml.SafeLoader):
    """SafeLoader that reads 1e-3 as a float (YAML 1.1 demands a dot) and rejects duplicate keys."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _one_line(err: yaml.YAMLError) -> str:
    mark = getattr(err, "problem_mark", None)
    problem = getattr(err, "problem", None)
    if problem and mark is not None:
        return f"{problem} at line {mark.line + 1}, column {mark.column + 1}"
    return " ".join(str(err).split())


def parse_yaml(text: str, source: str) -> Any:
    """Parse YAML text with the config loader; errors become one-line ``ConfigError``."""
    try:
        return yaml.load(text, Loader=_Loader)  # _Loader derives from SafeLoader
    except yaml.YAMLError as err:
        raise ConfigError(f"config: cannot parse {source}: {_one_line(err)}") from None


def _all_keys(sections: dict[str, type]) -> list[str]:
    return [f"{s}.{f.name}" for s, cls in sections.items() for f in dataclasses.fields(cls)]


def _unknown(key: str, sections: dict[str, type]) -> ConfigError:
    """Unknown-key error with a suggestion: the same name in another section, else a near match."""
    keys = _all_keys(sections)
    leaf = key.rsplit(".", 1)[-1]
    close = [k for k in keys if k.rsplit(".", 1)[1] == leaf] or difflib.get_close_matches(
        key, keys if "." in key else list(sections), n=1, cutoff=0.6
    )
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return ConfigError(f"config: unknown key {key!r}{hint}")


def _check_keys(d: Any, sections: dict[str, type]) -> dict[str, dict[str, Any]]:
    """Validate the two-level shape and the key names; returns a plain nested dict copy."""
    if not isinstance(d, Mapping):
        raise ConfigError(
            f"config: the top level must be a mapping of sections, got {show_value(d)}"
        )
    out: dict[str, dict[str, Any]] = {}
    for section, body in d.items():
        if section not in sections:
            raise _unknown(str(section), sections)
        if body is None:  # a section whose keys are all commented out
            body = {}
        if not isinstance(body, Mapping):
            raise ConfigError(
                f"config: {section} must be a mapping of keys, got {show_value(body)}"
            )
        names = {f.name for f in dataclasses.fields(sections[section])}
        for key in body:
            if key not in names:
                raise _unknown(f"{section}.{key}", sections)
        out[section] = dict(body)
    return out


def config_from_dict(d: Mapping[str, Any], family: str | None = None) -> Config:
    """Build and validate a Config of model ``family`` (default: the default family) from
    nested mappings; missing keys take their defaults."""
    classes = sections_for(family)
    checked = _check_keys(d, classes)
    return Config(**{name: cls(**checked.get(name, {})) for name, cls in classes.items()})


def config_to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    """Plain nested dict of every key (JSON/YAML-serialisable); config_from_dict inverts it."""
    return dataclasses.asdict(cfg)


def _merge(
    d: dict[str, dict[str, Any]], overrides: Iterable[str], sections: dict[str, type]
) -> dict[str, dict[str, Any]]:
    if isinstance(overrides, str):  # a lone string would otherwise be iterated per character
        overrides = [overrides]
    for arg in overrides:
        key, sep, raw = arg.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"config: override {arg!r} must look like section.key=value")
        section, dot, name = key.partition(".")
        if section not in sections:
            raise _unknown(key, sections)
        if not dot:
            example = f"{section}.{dataclasses.fields(sections[section])[0].name}"
            raise ConfigError(f"config: override {arg!r} must name a key, e.g. {example}=...")
        if name not in {f.name for f in dataclasses.fields(sections[section])}:
            raise _unknown(key, sections)
        d.setdefault(section, {})[name] = parse_yaml(raw, f"override {arg!r}")
    return d


def apply_overrides(cfg: Config, overrides: Iterable[str]) -> Config:
    """A new Config with dotted ``section.key=value`` overrides applied (values parsed as YAML)."""
    sections = sections_for(cfg.family)
    return config_from_dict(_merge(config_to_dict(cfg), overrides, sections), cfg.family)


def granularity_overrides(level: str) -> tuple[str, list[str]]:
    """The benchmarks' and tools' short form of a level with its FP8 granularity, as overrides:
    ``"te@block"`` -> ``("te", [precision.fp8_granularity=block, fp8_recipe=current])``, a
    level with row- or block-wise FP8 scales (current scaling, which they need);
    ``"te@block+e4m3"`` also stores output gradients in E4M3 (``precision.fp8_grad_format``,
    the block recipes' choice)."""
    level, _, granularity = level.partition("@")
    granularity, _, grad_format = granularity.partition("+")
    out = []
    if granularity:
        out += [f"precision.fp8_granularity={granularity}", "precision.fp8_recipe=current"]
    if grad_format:
        out.append(f"precision.fp8_grad_format={grad_format}")
    return level, out


def load_config(path: str, overrides: Iterable[str] = (), family: str | None = None) -> Config:
    """Read a YAML config for model ``family`` (default: the default family; its ``model``
    section is the family's), apply overrides, validate; every problem is a one-line
    ConfigError. A fine-tune (``checkpoint.finetune`` with ``checkpoint.load``) takes the
    model and tokenizer keys left unset from its checkpoint (training/finetune_defaults.py)."""
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except (OSError, UnicodeDecodeError) as err:
        reason = getattr(err, "strerror", None) or str(err)
        raise ConfigError(f"config: cannot read config file {path!r}: {reason}") from None
    raw = parse_yaml(text, repr(path))
    if raw is None:  # an empty file means "all defaults"
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError(
            f"config: {path!r} must hold a mapping of sections, got {show_value(raw)}"
        )
    sections = sections_for(family)
    merged = _merge(_check_keys(raw, sections), overrides, sections)
    if merged.get("checkpoint", {}).get("finetune") is True:
        # A fine-tune's model and tokenizer default to its checkpoint's, as from_pretrained
        # does: only the keys set here are known to be the user's.
        from training.finetune_defaults import finetune_defaults

        merged = finetune_defaults(merged, family)
    return config_from_dict(merged, family)


def _type_name(cls: type, name: str) -> str:
    spec = field_spec(cls, name)
    text = " \\| ".join(spec.choices) if spec.choices else spec.kind.__name__
    return text + (" \\| null" if spec.optional else "")


def reference_doc(family: str | None = None) -> str:
    """Where a family's key reference lives: docs/CONFIG.md for the default family,
    docs/CONFIG_<family>.md for the others."""
    return "docs/CONFIG.md" if family in (None, DEFAULT_FAMILY) else f"docs/CONFIG_{family}.md"


def _reference_args(family: str | None) -> str:
    flag = "" if family in (None, DEFAULT_FAMILY) else f"--family {family} "
    return f"{flag}--reference > {reference_doc(family)}"


def config_reference_markdown(family: str | None = None) -> str:
    """The key reference for docs/CONFIG.md (the sections of a ``family`` run, default: the
    default family), generated from the schema so it cannot drift."""
    lines = [
        "# Configuration reference",
        "",
        "<!-- Generated by training.config.config_reference_markdown(); do not edit by hand.",
        f"     Regenerate: .venv/bin/python -m training.config {_reference_args(family)} -->",
        "",
        "A config is a YAML file with the sections below; every key is optional and unknown",
        "keys are errors. Override any key from the command line with `section.key=value`",
        "(the value is parsed as YAML: `true`, `3`, `1e-3`, `null`).",
        "",
    ]
    for section, cls in sections_for(family).items():
        lines += [f"## `{section}`", "", "| key | type | default | meaning |", "|---|---|---|---|"]
        for f in dataclasses.fields(cls):
            limits = [
                f"{sign} {f.metadata[op]:g}"
                for op, sign in (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<"))
                if op in f.metadata
            ]
            doc = f.metadata["doc"] + (f" ({', '.join(limits)})" if limits else "")
            default = show_value(f.default).strip("'")
            doc = doc.replace("|", "\\|")  # a bare | would end the table cell
            lines.append(
                f"| `{section}.{f.name}` | {_type_name(cls, f.name)} | `{default}` | {doc} |"
            )
        lines.append("")
    return "\n".join(lines + _RULES)


# Rules that involve more than one key; the per-key limits are in the tables above.
_RULES = [
    "## Rules across keys",
    "",
    "- `model.hidden_size` divisible by `model.num_attention_heads` unless `model.kv_channels`"
    " is set; `model.num_attention_heads` divisible by `model.num_query_groups`.",
    "- `model.max_position_embeddings` (when set) ≥ `model.seq_length`.",
    "- `model.num_attention_heads`, the query groups and the MLP width divisible by"
    " `parallel.tensor`; `model.num_layers` divisible by `parallel.pipeline` (times"
    " `parallel.virtual_pipeline` when set).",
    "- `parallel.sequence_parallel` needs `parallel.tensor` > 1; `parallel.virtual_pipeline`"
    " needs `parallel.pipeline` > 1.",
    "- `training.global_batch_size` divisible by `training.micro_batch_size` (and, at launch, by"
    " micro batch × data-parallel size).",
    "- `optimizer.lr` ≥ `optimizer.min_lr`; an explicit `optimizer.lr_warmup_iters` <"
    " the decay length (`optimizer.lr_decay_iters`, else `training.train_iters`); a null one"
    " is `optimizer.lr_warmup_fraction` of it, rounded down.",
    "- `precision.max_loss_scale` ≥ `precision.initial_loss_scale` ≥ `precision.min_loss_scale`.",
    "- `precision.fp8_granularity` row or block needs `precision.fp8_recipe: current`; row"
    " is not built for `precision.level: O3`; block with"
    " `parallel.tensor` > 1 needs the MLP, attention and key/value widths divided by it to be"
    " multiples of 128.",
    "- `precision.fp8_grad_format: e5m2` is refused at `precision.fp8_granularity: block`"
    " (cuBLASLt's block-scaled GEMM reads E4M3 operands; null picks e4m3 there).",
    "- `data.corpus: prefix` needs `data.data_prefix` and `data.tokenizer_model` (which a"
    " fine-tune, `checkpoint.finetune` with `checkpoint.load`, takes from a checkpoint that"
    " carries its tokenizer).",
    "- A fine-tune's `model` keys left unset are `checkpoint.load`'s; one set that builds"
    " another model is refused.",
    "",
    "Values the code resolves from nulls: `cfg.model.query_groups()`,"
    " `cfg.model.kv_channels_or_default()`, `cfg.model.ffn_size()`, `cfg.model.max_positions()`,"
    " `cfg.model.padded_vocab_size(vocab, tensor)`, `cfg.resolved_checkpoint_dir()`,"
    " `cfg.resolved_lr_decay_iters()`, `cfg.resolved_lr_warmup_iters()`,"
    " `cfg.data.split_weights()`.",
    "",
]


def _main(argv: list[str]) -> int:
    """``[--family NAME] --reference``: print the key reference; ``[--family NAME]
    [--world-size N] FILE [k=v ...]``: validate (with N, also the parallel layout and batch
    split for N ranks), print the resolved config. The family defaults to the default one."""
    family = None
    if argv[:1] == ["--family"] and len(argv) > 1:
        family, argv = argv[1], argv[2:]
    if argv == ["--reference"]:
        sys.stdout.write(config_reference_markdown(family))
        return 0
    world_size = None
    if argv[:1] == ["--world-size"] and len(argv) > 1 and argv[1].isdigit():
        world_size, argv = int(argv[1]), argv[2:]
    if not argv or argv[0].startswith("-"):
        print(
            "usage: python -m training.config [--family NAME] --reference | "
            "[--family NAME] [--world-size N] CONFIG.yaml [key=value ...]"
        )
        return 2
    try:
        cfg = load_config(argv[0], argv[1:], family)
        if world_size is not None:
            from training.run_plan import plan_parallel  # imports torch: only when asked

            plan_parallel(cfg, world_size)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    sys.stdout.write(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
