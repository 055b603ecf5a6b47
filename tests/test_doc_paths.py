"""Every file of the repository that the guides and the studies' pages name exists (issue 38
item 4 moved the studies' pages, runners and configs into research/): README.md,
results/README.md, docs/*.md and research/**/*.md, for paths under research/, docs/, tools/,
bench/ and configs/. A path with an upper-case placeholder (research/RECIPE/X.py) is a
pattern, not a file; FORMER lists the old paths the pages name on purpose, as history."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PATH = re.compile(
    r"(?<![\w/.-])((?:research|docs|tools|bench|configs)/[\w./-]*\w\.(?:md|py|toml|sh))"
)
# named as what a command used to be (research/*/README.md: "These were ...")
FORMER = {"bench/study_planner.py", "configs/study_planner_v2.toml", "configs/references.toml"}


def _pages(root: Path) -> list[Path]:
    return [
        *(p for p in (root / "README.md", root / "results" / "README.md") if p.is_file()),
        *sorted((root / "docs").glob("*.md")),
        *sorted((root / "research").rglob("*.md")),
    ]


def missing_paths(root: Path) -> list[str]:
    """'page: path' for each named path that is not a file under `root`."""
    out = []
    for page in _pages(root):
        for path in PATH.findall(page.read_text(encoding="utf-8")):
            placeholder = any(part.split(".")[0].isupper() for part in path.split("/"))
            if not placeholder and path not in FORMER and not (root / path).is_file():
                out.append(f"{page.relative_to(root)}: {path}")
    return out


def test_the_check_sees_a_missing_path(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "tools").mkdir()
    (tmp_path / "tools" / "here.py").write_text("")
    (tmp_path / "README.md").write_text(
        "Run tools/here.py, then research/study/gone.py (not bench/X.py: a pattern).\n"
    )
    assert missing_paths(tmp_path) == ["README.md: research/study/gone.py"]


def test_every_named_path_exists() -> None:
    assert missing_paths(ROOT) == []
