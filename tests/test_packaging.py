"""The installed distribution: a wheel built from this checkout puts one top-level package, `flywheel`, in a
fresh environment (docs/architecture.md §9), and its command runs from there.

The wheel goes into a new venv without its dependencies; the test environment's site-packages are added to
that venv's path after the venv's own, so the server's libraries are found without a download while every
`flywheel` module comes from the wheel.
"""

from __future__ import annotations

import os
import site
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(*command: str | Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run([str(c) for c in command], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_the_wheel_installs_one_namespace_and_its_command_runs(tmp_path: Path) -> None:
    built = run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", tmp_path / "dist",
                ROOT, cwd=tmp_path)
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("flywheel_rl-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names if not name.split("/")[0].endswith((".dist-info", ".data"))}
    assert tops == {"flywheel"}, tops
    assert "flywheel/gateway/serving/ui/templates/overview.html" in names  # package data travels
    assert "flywheel/gateway/storeproc/main.py" in names and "flywheel/trainer/grpo.py" in names

    env_dir = tmp_path / "fresh"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    installed = run(python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", wheel, cwd=tmp_path)
    assert installed.returncode == 0, installed.stderr[-2000:]
    own_site = run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=tmp_path)
    (Path(own_site.stdout.strip()) / "zz_test_dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")

    probe = run(python, "-c", "import importlib.util, flywheel.gateway.serving.app as app; "
                "print([m for m in ('gateway', 'capture', 'trainer', 'judge') if importlib.util.find_spec(m)]); "
                "print(app.__file__)", cwd=tmp_path)
    assert probe.returncode == 0, probe.stderr[-2000:]
    found, app_file = probe.stdout.split("\n")[:2]
    assert found == "[]"  # no generic top-level package of ours that another distribution could shadow
    assert app_file.startswith(str(env_dir))  # the wheel's copy, not this checkout

    helped = run(env_dir / "bin" / "flywheel", "serve", "--help", cwd=tmp_path)
    assert helped.returncode == 0, helped.stderr[-2000:]
    assert "--config" in helped.stdout


def test_the_lock_pins_every_requirement_within_its_range() -> None:
    """deploy/constraints.txt (what CI installs) names a version of every requirement of every extra, and each
    version satisfies pyproject's range, so `pip install -c deploy/constraints.txt -e .[...]` resolves."""
    import tomllib

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = (ROOT / "deploy" / "constraints.txt").read_text().splitlines()
    pins = {canonicalize_name(name): version for name, _, version in
            (line.partition("==") for line in lines if line and not line.startswith("#"))}
    requirements = [Requirement(text) for text in project["dependencies"]]
    requirements += [Requirement(text) for extra in project["optional-dependencies"].values() for text in extra]
    unpinned, outside = [], []
    for requirement in requirements:
        name = canonicalize_name(requirement.name)
        if name in ("flywheel-rl", "torch"):  # the project itself; torch is the build a machine installs first
            continue
        if name not in pins:
            unpinned.append(name)
        elif not requirement.specifier.contains(pins[name], prereleases=True):
            outside.append(f"{name}=={pins[name]} not in {requirement.specifier}")
    assert not unpinned and not outside, (unpinned, outside)
