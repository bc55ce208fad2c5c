"""Red team: config files that cost exponential time or memory are refused (or resolved) in seconds.

Before these bounds a 651-byte YAML alias bomb under `env.kwargs` and a diamond of `extends:`
each hung `--print-config` (0.9 GB at 120 s): the bomb expands to 9**9 strings in every walk of
the result, and the diamond was read once per path through it, 2**levels times.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from seeupo_gym.training import cli
from seeupo_gym.training.config import MAX_CONFIG_BYTES, MAX_EXTENDS_DEPTH, ConfigError, load_config, load_raw_config


def alias_bomb(levels: int = 9) -> str:
    """Billion laughs: each level is a list of nine aliases of the level before."""
    lines = ["extends: tiny-cpu", "env:", "  kwargs:", '    l0: &l0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for n in range(1, levels):
        lines.append(f"    l{n}: &l{n} [" + ",".join([f"*l{n - 1}"] * 9) + "]")
    return "\n".join(lines) + "\n"


def test_an_alias_bomb_under_env_kwargs_is_refused_at_once(tmp_path):
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(alias_bomb())
    assert len(bomb.read_bytes()) < 700
    started = time.monotonic()
    with pytest.raises(ConfigError, match=r"aliases \(\*l0\) are not accepted"):
        load_config(bomb)
    assert time.monotonic() - started < 5


@pytest.mark.timeout(120)
def test_print_config_of_the_alias_bomb_ends_with_one_line(tmp_path, capsys):
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(alias_bomb())
    assert cli.train_main(["--config", str(bomb), "--print-config"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "aliases" in err and "line 5, column" in err, err


def test_aliases_are_refused_in_overrides_and_merge_keys_too(tmp_path):
    with pytest.raises(ConfigError, match="aliases"):
        load_config("tiny-cpu", ["env.kwargs={a: &x [1, 2], b: *x}"])
    merge = tmp_path / "merge.yaml"
    merge.write_text("base: &base {seed: 1}\ntrain:\n  <<: *base\n")
    with pytest.raises(ConfigError, match="aliases"):
        load_raw_config(merge)


def write_diamond(folder: Path, levels: int) -> Path:
    """`levels` layers of two files, each extending both files of the layer below: 2**levels paths."""
    for level in range(levels):
        for side in "ab":
            parents = "[tiny-cpu]" if level == levels - 1 else f"[{level + 1}a.yaml, {level + 1}b.yaml]"
            (folder / f"{level}{side}.yaml").write_text(
                f"extends: {parents}\ntrain:\n  seed: {level * 2 + (side == 'b')}\nenv:\n  kwargs:\n    from_{level}{side}: 1\n"
            )
    return folder / "0a.yaml"


@pytest.mark.timeout(60)
def test_a_diamond_of_extends_is_read_once_per_file(tmp_path, monkeypatch):
    top = write_diamond(tmp_path, levels=12)  # 4,096 paths through 24 files
    reads: list[str] = []
    real_open = Path.open

    def counted_open(self, *args, **kwargs):
        if self.suffix == ".yaml":
            reads.append(self.name)
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", counted_open)
    started = time.monotonic()
    config = load_config(top)
    assert time.monotonic() - started < 5
    assert sorted(reads) == sorted({*reads}) and len(reads) == 23 + 1, reads  # each file below 0a once, and the preset
    assert config.train.seed == 0  # the top file wins over what it extends
    assert sorted(config.env.kwargs)[:3] == ["from_0a", "from_10a", "from_10b"]  # every file merged in


@pytest.mark.timeout(120)
def test_print_config_of_a_wide_diamond_ends_in_seconds(tmp_path, capsys):
    top = write_diamond(tmp_path, levels=MAX_EXTENDS_DEPTH - 1)  # 32,768 paths through 30 files and the preset
    started = time.monotonic()
    assert cli.train_main(["--config", str(top), "--print-config"]) == 0
    assert time.monotonic() - started < 20
    assert f"from_{MAX_EXTENDS_DEPTH - 2}b: 1" in capsys.readouterr().out


def test_an_extends_chain_deeper_than_the_limit_is_refused(tmp_path):
    count = MAX_EXTENDS_DEPTH + 2
    for i in range(count):
        parent = "tiny-cpu" if i == count - 1 else f"c{i + 1}.yaml"
        (tmp_path / f"c{i}.yaml").write_text(f"extends: {parent}\n")
    with pytest.raises(ConfigError, match=f"nested more than {MAX_EXTENDS_DEPTH} deep"):
        load_raw_config(tmp_path / "c0.yaml")
    load_raw_config(tmp_path / f"c{count - MAX_EXTENDS_DEPTH + 1}.yaml")  # at the limit (16 files with the preset): fine


def test_the_files_of_a_config_are_bounded_in_size(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_text("extends: tiny-cpu\n" + "#" * (MAX_CONFIG_BYTES + 1) + "\n")
    with pytest.raises(ConfigError, match=f"exceed {MAX_CONFIG_BYTES} bytes"):
        load_raw_config(big)
    # The bound is on the whole graph: two files of 60% each.
    half = "#" * int(MAX_CONFIG_BYTES * 0.6) + "\n"
    (tmp_path / "p.yaml").write_text(half)
    (tmp_path / "q.yaml").write_text("extends: p.yaml\n" + half)
    with pytest.raises(ConfigError, match="exceed"):
        load_raw_config(tmp_path / "q.yaml")


def test_deep_nesting_is_a_config_error_not_a_recursion_crash(tmp_path):
    deep = tmp_path / "deep.yaml"
    deep.write_text("env:\n  kwargs:\n    x: " + "[" * 50000 + "]" * 50000 + "\n")
    with pytest.raises(ConfigError, match="nested too deeply") as refused:
        load_raw_config(deep)
    assert "\n" not in str(refused.value)


def test_a_cycle_through_the_memo_is_still_a_cycle(tmp_path):
    (tmp_path / "x.yaml").write_text("extends: [y.yaml, z.yaml]\n")
    (tmp_path / "y.yaml").write_text("extends: z.yaml\n")
    (tmp_path / "z.yaml").write_text("extends: x.yaml\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_raw_config(tmp_path / "x.yaml")
