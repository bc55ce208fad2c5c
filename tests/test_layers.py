"""The import contract: layers import one way only.

envs (seeupo_gym outside agents/, algorithms/, training/ and integrations/) know nothing of the
rest; the rollout records know nothing at all; agents know the envs and the rollout records; the
pure algorithm kit knows torch and itself; only the run layer (seeupo_gym.training and
seeupo_gym.integrations) wires everything.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = {"seeupo_gym": "seeupo_gym", "agents": "seeupo_gym.agents", "algorithms": "seeupo_gym.algorithms"}
RUN_LAYERS = ("seeupo_gym.training", "seeupo_gym.integrations")
ROLLOUT = "seeupo_gym.algorithms.rollout"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    name = ".".join([FOLDERS[parts[0]], *parts[1:]])
    return name.removesuffix(".__init__")


def project_imports(source: str) -> set[str]:
    """Every seeupo_gym module `source` imports, at module level or inside functions."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if name == "seeupo_gym" or name.startswith("seeupo_gym.")}


def layer(module: str) -> str:
    if any(module == top or module.startswith(top + ".") for top in RUN_LAYERS):
        return "run"
    if module == ROLLOUT or module.startswith(ROLLOUT + "."):
        return "records"
    if module.startswith("seeupo_gym.algorithms"):
        return "kit"
    if module.startswith("seeupo_gym.agents"):
        return "agents"
    return "envs"


# What each layer may import (besides itself).
ALLOWED = {
    "records": set(),
    "envs": set(),
    "kit": {"records"},
    "agents": {"envs", "records"},
    "run": {"envs", "records", "kit", "agents"},
}

MODULES = sorted(path for top in FOLDERS for path in (ROOT / top).rglob("*.py"))


def backwards_imports(module: str, source: str) -> list[str]:
    own = layer(module)
    return sorted(name for name in project_imports(source) if layer(name) != own and layer(name) not in ALLOWED[own])


def violations(path: Path) -> list[str]:
    return backwards_imports(module_name(path), path.read_text())


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_modules_import_only_the_layers_below_them(path):
    assert violations(path) == [], f"{module_name(path)} ({layer(module_name(path))}) imports backwards"


@pytest.mark.parametrize(
    "module, source",
    [
        ("seeupo_gym.algorithms.probe", "from seeupo_gym.training.trainer import Trainer\n"),
        ("seeupo_gym.algorithms.probe", "def f():\n    from seeupo_gym.agents.scoring import response_logprobs\n"),
        ("seeupo_gym.agents.probe", "import seeupo_gym.algorithms.core\n"),
        ("seeupo_gym.agents.probe", "from seeupo_gym.training.config import load_config\n"),
        ("seeupo_gym.probe", "from seeupo_gym.agents import load_model\n"),
        ("seeupo_gym.bfcl.probe", "import seeupo_gym.integrations.openenv\n"),
    ],
)
def test_the_contract_catches_a_backwards_import(module, source):
    # Probes are checked as text: nothing is written into the source tree.
    assert backwards_imports(module, source) != []


def test_the_run_layer_lives_outside_the_pure_kit():
    assert not (ROOT / "algorithms" / "training").exists()
    assert layer("seeupo_gym.training.trainer") == "run"
    assert layer("seeupo_gym.algorithms.seeupo") == "kit"
