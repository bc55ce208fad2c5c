"""The verl GPU recipe (scripts/verl_gpu_requirements.txt): exact pins that agree with verl 0.9.1's own
declared requirements, with this package's ranges, with the `vllm` extra's stated reason for differing,
and with the paper script and docs that name it; the slow test resolves it against PyPI."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import socket
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("check_verl_recipe", ROOT / "scripts" / "check_verl_recipe.py")
recipe = importlib.util.module_from_spec(spec)
spec.loader.exec_module(recipe)


def verl_requirements(extra: str | None = None) -> dict[str, Requirement]:
    """verl 0.9.1's declared requirements (its core, or one extra's), by canonical name."""
    found: dict[str, Requirement] = {}
    for line in importlib.metadata.requires("verl") or []:
        requirement = Requirement(line)
        marker = str(requirement.marker or "")
        if (extra is None and not marker) or (extra is not None and marker == f'extra == "{extra}"'):
            found[recipe.canonical(requirement.name)] = requirement
    return found


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_every_recipe_line_is_an_exact_pin_and_a_range_is_refused(tmp_path):
    pins = recipe.read_recipe()
    assert pins["verl"] == "0.9.1" and {"vllm", "torch", "transformers"} <= set(pins)
    loose = tmp_path / "loose.txt"
    loose.write_text("# comment\nverl==0.9.1\ntransformers>=5\n")
    with pytest.raises(ValueError, match=r"loose.txt:3: 'transformers>=5' is not an exact pin"):
        recipe.read_recipe(loose)
    twice = tmp_path / "twice.txt"
    twice.write_text("torch==2.11.0\nTorch==2.11.0\n")
    with pytest.raises(ValueError, match="pinned twice"):
        recipe.read_recipe(twice)


def test_the_recipe_meets_verls_declared_requirements_and_its_own_vllm_stack():
    pytest.importorskip("verl")
    assert importlib.metadata.version("verl") == recipe.read_recipe()["verl"]
    pins = recipe.read_recipe()
    for name, requirement in verl_requirements().items():
        if name in pins:  # verl's core ranges: transformers>=5.5.3,<5.11,!=5.6.0, tensordict, ...
            assert requirement.specifier.contains(pins[name], prereleases=True), (name, pins[name], requirement)
    # verl's `vllm` extra is the stack verl 0.9.1 tested: the recipe takes exactly its pins.
    stack = verl_requirements("vllm")
    for name in ("vllm", "torch", "torchvision", "torchaudio", "transformers"):
        assert str(stack[name].specifier) == f"=={pins[name]}", (name, stack[name], pins[name])


def test_the_recipe_fits_this_packages_own_ranges():
    pins = recipe.read_recipe()
    for line in recipe.project_requirements():
        requirement = Requirement(line)
        name = recipe.canonical(requirement.name)
        if name in pins:
            assert requirement.specifier.contains(pins[name], prereleases=True), (line, pins[name])
    # the resolve the check runs is this package's dependencies and its verl extra, nothing else
    assert recipe.project_requirements() == pyproject()["dependencies"] + pyproject()["optional-dependencies"]["verl"]


def test_the_vllm_extra_and_the_verl_recipe_state_why_their_vllm_differs():
    # The kit's VLLMBackend pins vLLM 0.32.0; verl 0.9.1 cannot run beside it (vLLM 0.32 needs
    # transformers>=5.16.1, verl <5.11), so the extra names the recipe and the reason.
    extra = pyproject()["optional-dependencies"]["vllm"]
    assert extra == ["vllm==0.32.0"]
    pins = recipe.read_recipe()
    verl_transformers = verl_requirements().get("transformers") if importlib.util.find_spec("verl") else None
    if verl_transformers is not None:
        assert not verl_transformers.specifier.contains("5.16.1")  # the disjointness the comment states
    text = (ROOT / "pyproject.toml").read_text()
    comment = text[:text.index('vllm = ["vllm==0.32.0"]')].rsplit("\n\n", 1)[-1]  # the extra's own comment block
    assert "scripts/verl_gpu_requirements.txt" in comment and f"vLLM {pins['vllm']}" in comment
    assert "transformers>=5.16.1" in comment and "transformers<5.11" in comment


def test_the_paper_scripts_name_the_recipe_and_no_vllm_version_of_their_own():
    for script in ("verl_seeupo_paper.sh", "gpu_check_verl_seeupo.sh"):
        text = (ROOT / "scripts" / script).read_text()
        assert not re.search(r"vllm\s*==", text, re.IGNORECASE), script  # the old script said vllm==0.11.*
    assert "scripts/verl_gpu_requirements.txt" in (ROOT / "scripts" / "verl_seeupo_paper.sh").read_text()


def test_the_install_docs_name_the_recipe_and_its_check():
    text = (ROOT / "docs" / "install.md").read_text()
    section = text[text.index("## verl on GPUs"):]
    assert "pip install -r scripts/verl_gpu_requirements.txt '.[verl]'" in section
    assert "python scripts/check_verl_recipe.py" in section
    pins = recipe.read_recipe()
    for name in ("verl", "vllm", "torch", "transformers"):
        assert f"{name}=={pins[name]}" in section, name


def test_the_platform_list_spans_manylinux_2_17_to_2_35_because_pip_takes_it_literally():
    tags = recipe.platforms()
    assert tags[0] == "manylinux_2_35_x86_64" and "manylinux_2_31_x86_64" in tags and "manylinux_2_17_x86_64" in tags
    command = recipe.pip_command(Path("r.txt"), Path("o.json"), Path("w"))
    assert command.count("--platform") == len(tags) and "--only-binary=:all:" in command and "--dry-run" in command
    assert "--isolated" in command  # no local wheel folders or constraints of the machine it runs on


def online() -> bool:
    try:
        socket.create_connection(("pypi.org", 443), timeout=5).close()
        return True
    except OSError:
        return False


@pytest.mark.slow
def test_the_verl_recipe_resolves_against_pypi_with_every_pin_kept(tmp_path):
    if not online():
        pytest.skip("no network: the resolver check needs PyPI")
    versions, seconds = recipe.resolve(tmp_path / "report.json", timeout=1200)
    pins = recipe.read_recipe()
    assert {name: versions.get(name) for name in pins} == pins
    assert "seeupo-gym" not in versions and "flash-attn" not in versions  # the package's deps, not itself
    assert Requirement("transformers>=5,<6").specifier.contains(versions["transformers"])


# What the resolver picks beside the recipe's transformers pin (scripts/check_verl_recipe.py's report).
RESOLVED_BESIDE_TRANSFORMERS = ("tokenizers==0.22.2", "huggingface-hub==1.33.0")


@pytest.mark.slow
def test_the_verl_side_runs_under_the_recipes_transformers(tmp_path):
    """The agent loop and the launcher's configs under the recipe's transformers (5.9.0, not this venv's),
    installed with `pip install --target` beside the venv's other packages."""
    if not online():
        pytest.skip("no network: installs the recipe's transformers")
    import subprocess
    import sys

    target = tmp_path / "site"
    pins = recipe.read_recipe()
    subprocess.run([sys.executable, "-m", "pip", "install", "--isolated", "--quiet", "--no-deps", "--target", str(target), f"transformers=={pins['transformers']}",
                    *RESOLVED_BESIDE_TRANSFORMERS], check=True, timeout=600)
    # `kernels` is not in the recipe; a newer one in this venv breaks transformers 5.9's hub-kernels import.
    (target / "kernels").mkdir()
    (target / "kernels" / "__init__.py").write_text("raise ImportError('kernels is not in the verl recipe')\n")
    (target / "kernels-0.0.0.dist-info").mkdir()
    (target / "kernels-0.0.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: kernels\nVersion: 0.0.0\n")
    env = {**os.environ, "PYTHONPATH": str(target)}
    version = subprocess.run([sys.executable, "-c", "import transformers; print(transformers.__version__)"],
                             capture_output=True, text=True, env=env, check=True).stdout.strip()
    assert version == pins["transformers"]
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
                             "tests/test_verl_agent_loop.py", "tests/test_verl_configs.py"], capture_output=True,
                            text=True, env=env, cwd=ROOT, timeout=1200)
    assert result.returncode == 0, result.stdout[-3000:]
