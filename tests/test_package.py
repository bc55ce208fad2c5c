import subprocess
import sys


def test_importing_seeupo_gym_pulls_in_nothing_heavy():
    code = (
        "import sys, seeupo_gym\n"
        "heavy = [m for m in ('torch', 'transformers', 'bfcl_eval', 'httpx', 'accelerate') if m in sys.modules]\n"
        "print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_serving_imports_neither_torch_nor_openenvs_web_playground_and_leaves_gradio_importable():
    # A served env's process starts with these imports; openenv's gradio playground alone took 9 s.
    code = (
        "import sys, seeupo_gym.integrations.openenv_server\n"
        "heavy = [m for m in ('torch', 'transformers', 'gradio') if m in sys.modules]\n"
        "import gradio\n"
        "print(','.join(heavy) + '|' + gradio.__name__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "|gradio"


def test_the_three_layers_import_under_the_seeupo_gym_namespace():
    subprocess.run([sys.executable, "-c", "import seeupo_gym.agents, seeupo_gym.training.trainer"], check=True)


def test_pyproject_lists_every_package_folder():
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    setuptools = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    folders = {"seeupo_gym": "seeupo_gym", "agents": "seeupo_gym.agents", "algorithms": "seeupo_gym.algorithms"}
    found = {
        ".".join([folders[init.relative_to(root).parts[0]], *init.relative_to(root).parts[1:-1]])
        for top in folders
        for init in (root / top).rglob("__init__.py")
    }
    data_folders = {"seeupo_gym.agents.assets.qwen2_tokenizer", "seeupo_gym.training.presets"}  # no __init__.py
    assert found | data_folders == listed


def test_torch_is_a_range_and_the_license_ships():
    import re
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    torch = next(d for d in project["dependencies"] if re.match(r"torch\s*[<>=]", d))
    # A pin would refuse to install beside any other torch build (CUDA, a newer release).
    assert "==" not in torch and ">=" in torch and "<" in torch
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    assert "Apache License" in (root / "LICENSE").read_text() and "Version 2.0" in (root / "LICENSE").read_text()


def test_presets_ship_with_the_package_and_load_by_name():
    from seeupo_gym.training.config import load_config, presets

    assert {"tiny-cpu", "tiny-turnbandit", "demo"} <= set(presets())
    config = load_config("tiny-turnbandit")
    assert config.model.name_or_path == "tiny" and config.env.id == "seeupo/TurnBandit-v0"
