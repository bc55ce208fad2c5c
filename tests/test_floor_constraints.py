"""scripts/floor_constraints.py: the `==` floors `make test-floor` installs, read from pyproject.toml."""

import importlib.util
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("floor_constraints", ROOT / "scripts" / "floor_constraints.py")
floor_constraints = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(floor_constraints)


@pytest.mark.parametrize("requirement, expected", [
    ("torch>=2.6,<2.14", ("torch", "2.6")),
    ("pydantic >= 2.7, <3", ("pydantic", "2.7")),
    ("mpmath==1.3.0", ("mpmath", "1.3.0")),
    ("peft~=0.21", ("peft", "0.21")),
    ("foo[bar]>=1.2.3", ("foo", "1.2.3")),
])
def test_the_floor_is_the_lower_bound_of_the_range(requirement, expected):
    assert floor_constraints.floor(requirement) == expected


@pytest.mark.parametrize("requirement", ["pandas", "numpy<3", "x>=1; python_version<'3.12'", "y>=1,>=2"])
def test_a_requirement_without_one_lower_bound_is_refused_by_name(requirement):
    with pytest.raises(ValueError, match="lower bound|markers"):
        floor_constraints.floor(requirement)


def test_a_package_named_twice_takes_the_higher_floor(tmp_path):
    (tmp_path / "pyproject.toml").write_text(
        '[project]\ndependencies = ["transformers>=5,<6", "numpy>=1.26"]\n'
        '[project.optional-dependencies]\ntrl = ["Transformers>=5.2"]\nlow = ["numpy>=1.9"]\n')
    assert floor_constraints.floors(tmp_path / "pyproject.toml", ["trl", "low"]) == ["transformers==5.2", "numpy==1.26"]
    assert floor_constraints.floors(tmp_path / "pyproject.toml", []) == ["transformers==5", "numpy==1.26"]


def test_every_declared_dependency_and_extra_has_a_floor_make_test_floor_can_install():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for extra in project["optional-dependencies"]:
        lines = floor_constraints.floors(ROOT / "pyproject.toml", [extra])
        assert all("==" in line for line in lines), (extra, lines)
    core = floor_constraints.floors(ROOT / "pyproject.toml", ["dev"])
    assert "torch==2.6" in core and "transformers==5" in core and "pydantic==2.7" in core
