from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command_verbatim():
    ci_command = [line for line in (ROOT / ".ci/run").read_text().splitlines() if "pytest" in line]
    assert len(ci_command) == 1
    assert ci_command[0] in (ROOT / "README.md").read_text()
