"""Config files (configs/*.py through jlco.config.load_config): every field of every
section is type-checked when the dataclass is built (bools reject non-bools, floats
accept ints, numpy scalars become Python ones), errors name `section.field`, a file
that fails to run is one ConfigError naming the file and line, and storage='file'
needs a usable storage_path at load time."""

from __future__ import annotations

import dataclasses
import pathlib

import numpy as np
import pytest

from jlco.config import (
    CacheConfig,
    Config,
    ConfigError,
    EngineConfig,
    ModelConfig,
    RopeScaling,
    ServeConfig,
    load_config,
)

ROOT = pathlib.Path(__file__).resolve().parents[2]
SECTIONS = {RopeScaling: "model.rope_scaling", ModelConfig: "model", CacheConfig: "cache",
            EngineConfig: "engine", ServeConfig: "serve", Config: "config"}


def _wrong_value(annotation: str):
    """A value of the wrong type for a field annotated `annotation`."""
    kinds = {k.strip() for k in annotation.split("|")}
    if kinds & {"int", "float"} or "bool" in kinds:
        return "1"            # a str where a number or bool belongs
    return 5                  # a number where a str / dataclass belongs


@pytest.mark.parametrize("cls", list(SECTIONS), ids=lambda c: c.__name__)
def test_every_field_is_type_checked(cls):
    for f in dataclasses.fields(cls):
        bad = _wrong_value(str(f.type))
        with pytest.raises(ConfigError, match=rf"^{SECTIONS[cls]}\.{f.name}=") as err:
            cls(**{f.name: bad})
        assert "allowed" in str(err.value), str(err.value)


@pytest.mark.parametrize("make,pattern", [
    (lambda: CacheConfig(offload="no"), r"cache\.offload='no' is invalid: allowed a bool"),
    (lambda: CacheConfig(offload=1), r"cache\.offload=1 .* a bool"),
    (lambda: ModelConfig(tie_word_embeddings=0), r"model\.tie_word_embeddings=0"),
    (lambda: CacheConfig(storage="disk"), r"cache\.storage='disk' .* 'pinned_host', "
                                          r"'unpinned_host', 'file'"),
    (lambda: EngineConfig(max_batch_size=2.0), r"engine\.max_batch_size=2\.0 .* an integer"),
    (lambda: EngineConfig(seed=-1), r"engine\.seed=-1"),
    (lambda: ServeConfig(host_high_watermark=True),
     r"serve\.host_high_watermark=True .* a finite number"),
    (lambda: ServeConfig(host_low_watermark=0.97), r"serve\.host_high_watermark"),
    (lambda: ServeConfig(import_ttl_s=0.0), r"serve\.import_ttl_s"),
    (lambda: ModelConfig(rope_theta=float("inf")), r"model\.rope_theta=inf"),
    (lambda: RopeScaling(mscale=-1.0), r"model\.rope_scaling\.mscale=-1\.0"),
    (lambda: ModelConfig(routed_scaling_factor=-1.0), r"model\.routed_scaling_factor=-1\.0"),
    (lambda: ModelConfig(index_topk=4096, max_position_embeddings=2048),
     r"model\.index_topk=4096 .* max_position_embeddings \(2048\)"),
    (lambda: ModelConfig(dtype="float64"), r"model\.dtype='float64' .* 'float16'"),
    (lambda: Config(name=""), r"config\.name=''"),
    (lambda: Config(model={}), r"config\.model=\{\} .* a ModelConfig"),
])
def test_bad_values_name_the_field(make, pattern):
    with pytest.raises(ConfigError, match=pattern):
        make()


def test_numbers_accepted_in_their_natural_forms():
    c = CacheConfig(host_headroom=1)                 # an int where a float goes
    assert c.host_headroom == 1
    m = ModelConfig(hidden_size=np.int64(7168), rope_theta=np.float32(1e4),
                    norm_topk_prob=np.bool_(True), dtype="float16")
    assert type(m.hidden_size) is int and type(m.rope_theta) is float
    assert m.norm_topk_prob is True and m == ModelConfig(rope_theta=1e4, dtype="float16")


def _write(tmp_path, body: str) -> pathlib.Path:
    p = tmp_path / "cfg.py"
    p.write_text("from jlco.config import *\n" + body)
    return p


def test_load_config_failures_name_file_and_line(tmp_path):
    p = _write(tmp_path, "\nCONFIG = Config(cache=CacheConfig(offload='no'))\n")
    with pytest.raises(ConfigError, match=rf"^{p}:3: cache\.offload='no'"):
        load_config(p)
    p = _write(tmp_path, "CONFIG = Config(engine=EngineConfig(max_batch=4))\n")
    with pytest.raises(ConfigError, match=rf"^{p}:2: TypeError: .*max_batch"):
        load_config(p)
    p = _write(tmp_path, "CONFIG = Config(\n")
    with pytest.raises(ConfigError, match=rf"^{p}:2: SyntaxError"):
        load_config(p)
    p = _write(tmp_path, "CONFIG = 3\n")
    with pytest.raises(ConfigError, match="must define CONFIG"):
        load_config(p)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "none.py")


def test_storage_path_checked_at_load(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    body = "CONFIG = Config(cache=CacheConfig(storage='file', storage_path={!r}))\n"
    for bad, why in ((afile, "not a directory"), (afile / "sub", "not a writable directory")):
        with pytest.raises(ConfigError, match=rf"cache\.storage_path='{bad}' is invalid: .*{why}"):
            load_config(_write(tmp_path, body.format(str(bad))))
    for ok in (tmp_path, tmp_path / "new" / "dir"):   # existing, or creatable
        assert load_config(_write(tmp_path, body.format(str(ok)))).cache.storage_path == str(ok)
    # the dataclass itself stays pure (a config may be built on another machine)
    assert CacheConfig(storage="file", storage_path="/no/such/dir").storage == "file"
    with pytest.raises(ConfigError, match=r"cache\.storage_path=None"):
        CacheConfig(storage="file")


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.py")), ids=lambda p: p.stem)
def test_shipped_configs_load(path):
    if "DEPLOYMENT = " in path.read_text():   # a DeepSeek-V4 plan for jlco.plan, no engine
        from jlco.planning import v4
        assert isinstance(v4.load_deployment(path), v4.V4Deployment)
        with pytest.raises(ConfigError, match="jlco.plan"):
            load_config(path)
        return
    assert isinstance(load_config(path), Config)


def test_override_strings():
    from jlco.config import apply_overrides
    cfg = load_config(ROOT / "configs" / "tiny.py")
    got = apply_overrides(cfg, ["engine.max_batch_size=8", "cache.storage=pinned_host",
                                "serve.host_high_watermark=0.9"])
    assert got.engine.max_batch_size == 8 and got.serve.host_high_watermark == 0.9
    for text, want in (("false", False), ("true", True), ("False", False), ("TRUE", True)):
        assert apply_overrides(cfg, [f"cache.prefix_cache={text}"]).cache.prefix_cache is want
    for bad, needle in [("engine.max_batch_size", "section.field=value"),
                        ("engin.max_batch_size=8", "unknown section 'engin'"),
                        ("engine.batch=8", "engine has no field 'batch'"),
                        ("engine.max_batch_size=0", "engine.max_batch_size")]:
        with pytest.raises(ValueError, match=needle):
            apply_overrides(cfg, [bad])
