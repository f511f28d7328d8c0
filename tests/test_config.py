"""The config layer: shipped configs, overrides, round trip, strict errors, generated docs."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from families.gpt import GPTModelSection as ModelConfig
from training.config import (
    PRECISION_LEVELS,
    Config,
    ConfigError,
    ParallelConfig,
    apply_overrides,
    config_from_dict,
    config_reference_markdown,
    config_to_dict,
    load_config,
    parse_yaml,
)

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted((ROOT / "configs").glob("*.yaml"))


def _write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return str(path)


def test_configs_are_shipped():
    names = {p.name for p in SHIPPED}
    assert {"gpt_tiny.yaml", "llama_tiny.yaml", "gpt_125m.yaml", "gpt_1.3b.yaml"} <= names
    assert {"gpt_7b.yaml", "gpt_13b.yaml", "gpt_175b.yaml"} <= names  # FP8-LM's three GPTs


def _family_of(path: Path) -> str | None:
    """Shipped configs are named after their model family (roberta_tiny.yaml); others
    (gpt_*, llama_*) are the default family's."""
    from families import family_names

    prefix = path.name.split("_")[0]
    return prefix if prefix in family_names() else None


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_config_loads(path: Path):
    family = _family_of(path)
    cfg = load_config(str(path), family=family)
    assert isinstance(cfg, Config)
    # Every key a shipped file sets must survive into the config (no silently ignored keys).
    raw = parse_yaml(path.read_text(), path.name) or {}
    got = config_to_dict(cfg)
    for section, body in raw.items():
        for key, value in body.items():
            assert got[section][key] == value, f"{path.name}: {section}.{key}"
    assert config_from_dict(got, family) == cfg


def test_defaults_are_gpt_tiny():
    assert config_from_dict({}) == Config()
    assert load_config(str(ROOT / "configs" / "gpt_tiny.yaml")) == Config()


def test_empty_file_means_defaults(tmp_path):
    assert load_config(_write(tmp_path, "# nothing\n")) == Config()
    assert load_config(_write(tmp_path, "model:\n")) == Config()


def test_warmup_fraction_fits_a_shortened_run_and_explicit_warmup_is_checked():
    """Only ``training.train_iters`` overridden: the shipped warm-up fraction shrinks with the
    run (20 of 300 steps, 0 of 10); an explicit warm-up that does not fit stays an error."""
    path = str(ROOT / "configs" / "gpt_tiny.yaml")
    assert load_config(path).resolved_lr_warmup_iters() == 20
    assert load_config(path, ["training.train_iters=10"]).resolved_lr_warmup_iters() == 0
    assert load_config(path, ["training.train_iters=60"]).resolved_lr_warmup_iters() == 4
    assert load_config(path, ["optimizer.lr_warmup_iters=5"]).resolved_lr_warmup_iters() == 5
    with pytest.raises(ConfigError, match="optimizer.lr_warmup_iters"):
        load_config(path, ["training.train_iters=10", "optimizer.lr_warmup_iters=20"])


def test_resolved_values():
    tiny = load_config(str(ROOT / "configs" / "llama_tiny.yaml"))
    m = tiny.model
    resolved = (m.ffn_size(), m.query_groups(), m.kv_channels_or_default(), m.max_positions())
    assert resolved == (704, 2, 64, 256)
    assert ModelConfig().ffn_size() == 1024
    wide = ModelConfig(hidden_size=2048, num_attention_heads=16, activation="swiglu")
    assert wide.ffn_size() == 5504  # int(8/3 * 2048) = 5461, up to a multiple of 64
    assert ModelConfig(make_vocab_size_divisible_by=128).padded_vocab_size(50257, tensor=2) == 50432
    cfg = Config()
    assert cfg.resolved_checkpoint_dir() == "runs/gpt_tiny/checkpoints"
    assert cfg.resolved_lr_decay_iters() == 300
    assert apply_overrides(cfg, ["checkpoint.dir=/ck"]).resolved_checkpoint_dir() == "/ck"
    assert cfg.data.split_weights() == pytest.approx((0.98, 0.02, 0.0))


def test_overrides(tmp_path):
    path = str(ROOT / "configs" / "gpt_tiny.yaml")
    cfg = load_config(path, ["training.train_iters=50", "precision.level=bf16"])
    assert (cfg.training.train_iters, cfg.precision.level) == (50, "bf16")
    cfg = load_config(
        path,
        [
            "optimizer.lr=1e-3",  # YAML 1.1 would read this as a string
            "optimizer.min_lr=0",  # int for a float field becomes a float
            "logging.tensorboard=false",
            "logging.peak_tflops=12.5",
            "model.num_query_groups=2",
            "training.exit_interval=null",
            "data.split=90,5,5",
            "logging.dir = runs/x=y",  # only the first '=' splits
        ],
    )
    assert cfg.optimizer.lr == 1e-3 and cfg.optimizer.min_lr == 0.0
    assert type(cfg.optimizer.min_lr) is float
    assert cfg.logging.tensorboard is False and cfg.logging.peak_tflops == 12.5
    assert cfg.model.num_query_groups == 2 and cfg.training.exit_interval is None
    assert cfg.data.split == "90,5,5" and cfg.logging.dir == "runs/x=y"
    # Later overrides win; apply_overrides leaves the original untouched (frozen).
    again = apply_overrides(cfg, ["training.train_iters=27", "training.train_iters=29"])
    assert again.training.train_iters == 29 and cfg.training.train_iters == 300
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.training.train_iters = 1  # type: ignore[misc]


def test_round_trip_is_exact():
    cfg = load_config(
        str(ROOT / "configs" / "llama_tiny.yaml"),
        ["logging.peak_tflops=3", "checkpoint.load=/x", "optimizer.lr_decay_iters=200"],
    )
    d = config_to_dict(cfg)
    assert config_from_dict(json.loads(json.dumps(d))) == cfg
    assert config_from_dict(yaml.safe_load(yaml.safe_dump(d))) == cfg
    assert config_to_dict(config_from_dict(d)) == d
    assert set(d) == {
        "model",
        "data",
        "training",
        "optimizer",
        "precision",
        "parallel",
        "logging",
        "checkpoint",
    }


# (YAML text or None, overrides, substring the one-line message must contain)
BAD = [
    ("trainig:\n  train_iters: 3\n", [], "unknown key 'trainig' (did you mean 'training'?)"),
    (
        "training:\n  trian_iters: 3\n",
        [],
        "unknown key 'training.trian_iters' (did you mean 'training.train_iters'?)",
    ),
    ("training:\n  lr: 0.1\n", [], "unknown key 'training.lr' (did you mean 'optimizer.lr'?)"),
    ("training:\n  micro_batch_size: eight\n", [], "training.micro_batch_size must be an int"),
    ("model:\n  num_layers: true\n", [], "model.num_layers must be an int, got true"),
    ("model:\n  num_layers: 2.0\n", [], "model.num_layers must be an int, got 2.0"),
    ("model:\n  add_bias_linear: 1\n", [], "model.add_bias_linear must be true or false"),
    ("optimizer:\n  lr: fast\n", [], "optimizer.lr must be a number, got 'fast'"),
    ("model:\n  hidden_size: null\n", [], "model.hidden_size must be an int, got null"),
    (
        "precision:\n  level: fp9\n",
        [],
        "precision.level must be one of fp32, bf16, fp16, te, O1, O2, O3, got 'fp9'",
    ),
    ("precision:\n  level: o2\n", [], "(did you mean 'O2'?)"),
    ("model:\n  num_layers: -2\n", [], "model.num_layers must be >= 1, got -2"),
    ("model:\n  hidden_dropout: 1.0\n", [], "model.hidden_dropout must be < 1"),
    ("model:\n  hidden_size: 250\n", [], "model.hidden_size (250) must be divisible by model.num"),
    ("model:\n  num_query_groups: 3\n", [], "model.num_attention_heads (4) must be divisible"),
    ("model:\n  max_position_embeddings: 128\n", [], "model.max_position_embeddings (128)"),
    ("training:\n  global_batch_size: 10\n", [], "training.global_batch_size (10) must be"),
    ("optimizer:\n  lr_warmup_iters: 300\n", [], "optimizer.lr_warmup_iters (300) must be less"),
    ("parallel:\n  sequence_parallel: true\n", [], "parallel.sequence_parallel requires"),
    ("parallel:\n  tensor: 3\n", [], "model.num_attention_heads (4) must be divisible by paral"),
    ("parallel:\n  pipeline: 3\n", [], "model.num_layers (4) must be divisible by parallel.pip"),
    ("parallel:\n  virtual_pipeline: 2\n", [], "parallel.virtual_pipeline requires parallel.pi"),
    ("data:\n  split: 98,2\n", [], "data.split must be three comma-separated"),
    ("data:\n  split: a,b,c\n", [], "data.split must be three comma-separated"),
    ("data:\n  split: 0,0,0\n", [], "data.split must be three comma-separated"),
    ("data:\n  corpus: prefix\n", [], "data.data_prefix is required when data.corpus"),
    ("data:\n  cache_dir: ''\n", [], "data.cache_dir must be a non-empty string"),
    ("optimizer:\n  lr: 1.0e-5\n", [], "optimizer.lr (1e-05) must be >= optimizer.min_lr"),
    (
        "optimizer:\n  lr_warmup_iters: 50\n  lr_decay_iters: 40\n",
        [],
        "optimizer.lr_warmup_iters (50) must be <= optimizer.lr_decay_iters (40)",
    ),
    ("precision:\n  initial_loss_scale: 0.5\n", [], "precision.initial_loss_scale (0.5)"),
    ("optimizer:\n  adam_eps: .inf\n", [], "optimizer.adam_eps must be a finite number"),
    ("training: 5\n", [], "training must be a mapping of keys, got 5"),
    ("- 1\n- 2\n", [], "must hold a mapping of sections"),
    ("training:\n  seed: 1\n  seed: 2\n", [], "duplicate key 'seed'"),
    ("training:\n  seed: [1\n", [], "cannot parse"),
    ("", ["training.train_iters"], "override 'training.train_iters' must look like"),
    ("", ["training.trian_iters=5"], "unknown key 'training.trian_iters' (did you mean 'tr"),
    ("", ["nosuch.x=5"], "unknown key 'nosuch.x'"),
    ("", ["training=5"], "override 'training=5' must name a key"),
    ("", ["training.train_iters=[1"], "cannot parse override 'training.train_iters=[1'"),
    ("", ["training.micro_batch_size=eight"], "training.micro_batch_size must be an int, got"),
    ("", ["training.exit_interval=0"], "training.exit_interval must be >= 1, got 0"),
]


@pytest.mark.parametrize("text,overrides,expected", BAD, ids=[b[2][:40] for b in BAD])
def test_malformed_config_is_one_line_error(tmp_path, text, overrides, expected):
    with pytest.raises(ConfigError) as info:
        load_config(_write(tmp_path, text), overrides)
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("config: ")
    assert expected in msg


def test_missing_file():
    with pytest.raises(ConfigError, match=r"^config: cannot read config file '/no/such\.yaml'"):
        load_config("/no/such.yaml")


def test_yaml_syntax_error_names_file(tmp_path):
    path = _write(tmp_path, "model:\n  num_layers: 4\n bad indent: [\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert path in str(info.value) and "line" in str(info.value)
    assert "\n" not in str(info.value)


def test_config_error_is_value_error():
    assert issubclass(ConfigError, ValueError)
    with pytest.raises(ValueError):
        config_from_dict({"model": {"num_layers": "4"}})


def test_direct_construction_is_validated():
    with pytest.raises(ConfigError, match="model.num_attention_heads"):
        Config(
            model=ModelConfig(num_attention_heads=3, kv_channels=64),
            parallel=ParallelConfig(tensor=2),
        )
    with pytest.raises(ConfigError, match="parallel.sequence_parallel"):
        dataclasses.replace(Config().parallel, sequence_parallel=True)


@pytest.mark.parametrize("family", ["gpt", "roberta", "vit"])
def test_docs_are_in_sync(family):
    from training.config import reference_doc

    doc = (ROOT / reference_doc(family)).read_text()
    assert doc == config_reference_markdown(family), (
        f"{reference_doc(family)} is stale: .venv/bin/python -m training.config --family "
        f"{family} --reference > {reference_doc(family)}"
    )
    for section, body in config_to_dict(config_from_dict({}, family)).items():
        for key in body:
            assert f"`{section}.{key}`" in doc


def test_levels_match_the_precision_recipes():
    from fp8train.precision import LEVELS

    assert set(PRECISION_LEVELS) == set(LEVELS)


@pytest.mark.parametrize(
    ("config", "world", "needle"),
    [
        ("gpt_tiny.yaml", 2, None),
        ("gpt_tiny.yaml", 4, "training.global_batch_size"),
        ("gpt_tiny_3d.yaml", 8, None),
        ("gpt_tiny_3d.yaml", 6, "parallel.pipeline"),
        ("gpt_tiny_tp2_sp.yaml", 3, "parallel.tensor"),
    ],
)
def test_preflight_checks_the_layout_for_a_world_size(capsys, config, world, needle):
    """``make train``'s pre-flight: the layout rules that need the world size, one line each."""
    from training.config import _main

    code = _main(["--world-size", str(world), str(ROOT / "configs" / config)])
    err = capsys.readouterr().err.strip()
    if needle is None:
        assert code == 0 and not err
    else:
        assert code == 2 and err.startswith("error: ") and needle in err and "\n" not in err
