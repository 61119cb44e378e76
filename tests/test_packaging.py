"""The pins live in one place (constraints.txt); environment.yml, pyproject and the README agree with it."""

import re
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def _pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pins[name.lower().replace("_", "-")] = version
    return pins


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def test_every_dependency_is_pinned_exactly():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    # The vllm extra is for GPU hosts and pins its own torch; CI never installs it, so it has no pin here.
    reqs = project["dependencies"] + [r for name, extra in project["optional-dependencies"].items()
                                      for r in extra if name != "vllm"]
    pins = _pins()
    missing = [r for r in reqs if _name(r) not in pins]
    assert not missing, f"constraints.txt lacks pins for {missing}"
    assert pins["torch"] == "2.13.0", "CI's torch is 2.13.0, the CPU wheel this project's machines hold on disk"


def test_environment_yml_installs_from_the_same_pins():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    deps = env["dependencies"]
    assert "python=3.11" in deps
    pip_section = next(d["pip"] for d in deps if isinstance(d, dict))
    assert "-c constraints.txt" in pip_section
    readme = (ROOT / "README.md").read_text()
    extras = re.search(r'-e "\.(\[[a-z,]+\])"', readme).group(1)
    assert f"-e .{extras}" in pip_section, "environment.yml installs other extras than the README"


def test_readme_has_exactly_the_two_commands_ci_runs():
    readme = (ROOT / "README.md").read_text()
    assert readme.count("<!-- setup -->") == 1 and readme.count("<!-- test -->") == 1
    ci = (ROOT / ".ci" / "run").read_text()
    assert "command_after setup" in ci and "command_after test" in ci
    setup = readme.split("<!-- setup -->")[1].split("```")[1]
    assert "-c constraints.txt" in setup and "python -m workbench" in setup
