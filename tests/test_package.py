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


def test_the_three_packages_import():
    subprocess.run([sys.executable, "-c", "import seeupo_gym, agents, algorithms"], check=True)
