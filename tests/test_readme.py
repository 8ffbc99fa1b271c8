from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command_verbatim():
    ci_command = [line for line in (ROOT / ".ci/run").read_text().splitlines() if "pytest" in line]
    assert len(ci_command) == 1
    assert ci_command[0] in (ROOT / "README.md").read_text()


def test_the_readme_and_docs_name_only_documents_the_repository_holds():
    import re

    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text()
        for pattern in (r"\bSPEC\b", r"RAY_NOTES", r"PERF_NOTES", r"\b[Ii]ssues? \d+", r"\bthe spec\b"):
            assert not re.search(pattern, text), f"{path.name} names {re.search(pattern, text).group(0)!r}, which a reader of the repository cannot see"
        for document in re.findall(r"\bdocs/[\w.-]+\.md\b", text):
            assert (ROOT / document).exists(), f"{path.name} names {document}"
    assert (ROOT / "CITATION.cff").exists()
