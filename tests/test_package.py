import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def project_free_python(folder: Path) -> Path:
    """This interpreter with its packages but not this project: a venv whose site-packages reads this
    one's through a .pth path line (the editable install's finder, itself started by a .pth, never runs)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True)
    python = folder / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "without-project.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


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


IMPORT_LAYERS = (
    "import sys, seeupo_gym.agents, seeupo_gym.algorithms\n"
    "assert 'agents' not in sys.modules and 'algorithms' not in sys.modules, 'a layer became a top-level name'\n"
    "print(seeupo_gym.agents.__file__, seeupo_gym.algorithms.__file__)"
)


def test_from_the_checkout_root_the_layers_import_under_seeupo_gym_without_an_install(tmp_path):
    python = project_free_python(tmp_path / "venv")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # control: this interpreter has no seeupo_gym of its own
    outside = subprocess.run([str(python), "-c", "import seeupo_gym"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert outside.returncode == 1 and "No module named 'seeupo_gym'" in outside.stderr
    inside = subprocess.run([str(python), "-c", IMPORT_LAYERS], cwd=ROOT, env=env, capture_output=True, text=True)
    assert inside.returncode == 0, inside.stderr[-2000:]
    assert inside.stdout.split() == [str(ROOT / "agents" / "__init__.py"), str(ROOT / "algorithms" / "__init__.py")]


def test_an_installed_layout_keeps_its_own_layers_beside_a_top_level_agents(tmp_path):
    # site-packages as a wheel leaves it, beside openai-agents' top-level `agents` (and a stray pyproject.toml)
    site = tmp_path / "site"
    shutil.copytree(ROOT / "seeupo_gym", site / "seeupo_gym", ignore=shutil.ignore_patterns("__pycache__"))
    for layer in ("agents", "algorithms"):
        (site / "seeupo_gym" / layer).mkdir()
        (site / "seeupo_gym" / layer / "__init__.py").write_text("")
        (site / layer).mkdir()
        (site / layer / "__init__.py").write_text("raise ImportError('the other package')")
    (site / "pyproject.toml").write_text("")
    python = project_free_python(tmp_path / "venv")
    result = subprocess.run([str(python), "-c", IMPORT_LAYERS], cwd=tmp_path, capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(site)})
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == [str(site / "seeupo_gym" / "agents" / "__init__.py"),
                                     str(site / "seeupo_gym" / "algorithms" / "__init__.py")]


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
    # no __init__.py
    data_folders = {"seeupo_gym.agents.assets.qwen2_tokenizer", "seeupo_gym.training.presets",
                    "seeupo_gym.integrations.verl.config", "seeupo_gym.integrations.verl.config.experiment"}
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
