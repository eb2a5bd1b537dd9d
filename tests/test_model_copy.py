"""`rollway model init --out` and `rollway up` never serve an outdated warm start.

The warm start is built into a cache keyed by its sources and copied to the configured
model folder. A copy made before a fix (the tokenizer one, for example) must be
replaced, not served silently; a model of the user's own is never touched."""

from __future__ import annotations

import json

import msgspec

from rollway.commands.model import _copy_out
from rollway.commands.up import needs_model_init
from trainer.warm_start import MARKER, WarmStartConfig, cache_key


def _model(folder, marker: dict | None, weights: bytes):
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(weights)
    if marker is not None:
        (folder / MARKER).write_text(json.dumps(marker))
    return folder


def _current_marker(cfg: WarmStartConfig) -> dict:
    return {"config": msgspec.to_builtins(cfg), "cache_key": cache_key(cfg)}


def test_up_rebuilds_only_outdated_warm_starts(tmp_path):
    assert needs_model_init(str(tmp_path / "nothing-here"))
    current = _model(tmp_path / "current", _current_marker(WarmStartConfig()), b"w")
    assert not needs_model_init(str(current))
    # built with other settings on purpose: current for those settings, left alone
    custom = _model(tmp_path / "custom", _current_marker(WarmStartConfig(seed=3)), b"w")
    assert not needs_model_init(str(custom))
    # built from other sources (its key no longer matches its settings), or before keyed markers
    stale = _model(tmp_path / "stale", {**_current_marker(WarmStartConfig()), "cache_key": "0" * 12}, b"w")
    assert needs_model_init(str(stale))
    unkeyed = _model(tmp_path / "unkeyed", {"config": msgspec.to_builtins(WarmStartConfig())}, b"w")
    assert needs_model_init(str(unkeyed))


def test_an_outdated_warm_start_copy_is_replaced(tmp_path, capsys):
    cached = _model(tmp_path / "cache" / "warm-new", {"cache_key": "new"}, b"new weights")
    out = _model(tmp_path / "models" / "tiny", {"sft": {"steps": 600}}, b"old weights")
    (out / "leftover.bin").write_bytes(b"x")
    assert _copy_out(cached, str(out), MARKER) == 0
    assert "replaced an outdated model" in capsys.readouterr().out
    assert (out / "model.safetensors").read_bytes() == b"new weights"
    assert json.loads((out / MARKER).read_text()) == {"cache_key": "new"}
    assert not (out / "leftover.bin").exists()
    assert sorted(p.name for p in out.parent.iterdir()) == ["tiny"]  # no temp folders left
    # idempotent: the same build again changes nothing and says where it is
    assert _copy_out(cached, str(out), MARKER) == 0
    assert capsys.readouterr().out.strip() == str(out)


def test_a_users_own_model_is_left_alone(tmp_path, capsys):
    cached = _model(tmp_path / "cache" / "warm-new", {"cache_key": "new"}, b"new weights")
    mine = _model(tmp_path / "models" / "mine", None, b"my weights")
    assert not needs_model_init(str(mine))
    assert _copy_out(cached, str(mine), MARKER) == 0
    assert "leaving it" in capsys.readouterr().out
    assert (mine / "model.safetensors").read_bytes() == b"my weights"


def test_a_missing_model_folder_is_built(tmp_path):
    cached = _model(tmp_path / "cache" / "warm-new", {"cache_key": "new"}, b"new weights")
    out = tmp_path / "models" / "tiny"
    assert _copy_out(cached, str(out), MARKER) == 0
    assert (out / "model.safetensors").read_bytes() == b"new weights"
