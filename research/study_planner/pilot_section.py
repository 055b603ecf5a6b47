"""Rewrite the study rule's "The pilot so far" section from the run directories.

At a session's end, after `park`, the section of the rule document (study_planner_v2.md)
that reports the pilot is regenerated: a heading with the time of the update, a paragraph
saying what the table is read from (the park commit the unfinished runs resume from), the
table and summary lines `status` prints, its machines, the figure, and then the session's
own reading of the rows, written by hand into a file (facts only, re-read against the
files). Everything from the section's heading to the next heading of its level or higher
(or the end) is replaced; the rest of the document is kept byte for byte.

    .venv/bin/python research/study_planner/pilot_section.py --park 5c20eb7 \\
        --when "2026-11-28 17:03" --extra /tmp/reading.md
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: `research`

HEADING = "### The pilot so far"
DOC = Path(__file__).with_name("study_planner_v2.md")
CONFIG = Path(__file__).with_name("study_planner_v2.toml")
OUT = Path("results/study_planner_v2")
FIGURE_NAME = "pilot_curves.png"


def status_parts(status: str) -> tuple[list[str], list[str], list[str]]:
    """(the pilot table's lines, the summary lines after it, the Machines section's items)
    of `study_planner.py status`'s text."""
    pilot = status.split("## Pilot", 1)[1].split("## Analysed runs", 1)[0]
    lines = [x for x in pilot.strip().splitlines()]
    table = [x for x in lines if x.startswith("|")]
    summary = [x for x in lines if x and not x.startswith("|")]
    machines = (
        status.split("## Machines", 1)[1].strip().splitlines() if "## Machines" in status else []
    )
    return table, summary, [x for x in machines if x.strip()]


def section_text(status: str, *, park: str, when: str, seed: int, figure: str, extra: str) -> str:
    """The section's markdown from `status`'s text and the session's reading `extra`."""
    table, summary, machines = status_parts(status)
    head = [
        f"{HEADING} (seed {seed}; updated {when} UTC)",
        "",
        "Every pilot job as `study_planner.py status --config research/study_planner/"
        "study_planner_v2.toml --out results/study_planner_v2` prints it from the run "
        "directories at this update: finished runs as their `study_planner: ... finished` "
        f"commits hold them, unfinished ones as the park commit {park} holds them (they resume "
        "from its checkpoint). Curve: ARC-e `acc` in percent on the 500 questions at each "
        "evaluation (round 0, then every 22 s of simulated time to B); learns: rule 6's "
        "criterion, finished runs only; client-steps: Σ participants × H; train loss: the "
        "clients' mean over the first and the last tenth of the rounds so far; compute s: the "
        "sum of the run's per-round `compute_s` over every stretch (wall time of each round's "
        "work on one core of a 2-core machine, beside other work; model loading not counted; "
        "no speed figure).",
        "",
        *table,
        "",
        " ".join(summary),
        "",
    ]
    if machines:
        head += [
            "Machines (`machine.jsonl`: which machine computed which rounds; fp32 results agree "
            "across CPU kinds in their printed accuracies, not in their bits):",
            "",
            *(m if m.startswith("- ") else f"- {m}" for m in machines),
            "",
        ]
    head += [
        f"The same runs drawn (`--figure {figure}`, written by the same command): one panel "
        "per arm, one line per step factor (a run still going dashed), with round 0, the "
        "target, the learning criterion's two levels, chance, the most-frequent label and B.",
        "",
        extra.strip(),
        "",
    ]
    return "\n".join(head)


def replace_section(doc: str, section: str) -> str:
    """`doc` with its "The pilot so far" section (its heading to the next heading of level
    1 to 3, or the end) replaced by `section`; a doc without one is refused."""
    start = doc.find(HEADING)
    if start < 0 or (start > 0 and doc[start - 1] != "\n"):
        raise ValueError(f"no line starting with {HEADING!r} in the document")
    after = re.search(r"^#{1,3} ", doc[start + len(HEADING) :], flags=re.MULTILINE)
    end = len(doc) if after is None else start + len(HEADING) + after.start()
    tail = doc[end:]
    return doc[:start] + section.rstrip("\n") + "\n" + ("\n" + tail if tail else "")


def main(argv: list[str] | None = None) -> int:
    from research.study_planner.study_figures import pilot_figure
    from research.study_planner.study_spec import load_spec
    from research.study_planner.study_status import render_status

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--park", required=True, help="the park commit the unfinished runs resume from")
    ap.add_argument("--when", required=True, help='the update\'s time, "YYYY-MM-DD HH:MM" (UTC)')
    ap.add_argument("--extra", type=Path, required=True, help="the session's reading (markdown)")
    ap.add_argument("--config", type=Path, default=CONFIG)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--doc", type=Path, default=DOC)
    args = ap.parse_args(argv)
    if not re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d", args.when):
        print(f'error: --when {args.when!r}: give "YYYY-MM-DD HH:MM"', file=sys.stderr)
        return 2
    if not args.out.is_dir():
        print(f"error: --out {str(args.out)!r}: not a study directory", file=sys.stderr)
        return 2
    for name in ("extra", "doc"):
        if not getattr(args, name).is_file():
            print(f"error: --{name} {str(getattr(args, name))!r}: no such file", file=sys.stderr)
            return 2
    spec = load_spec(args.config)
    figure = args.out / FIGURE_NAME
    pilot_figure(spec, args.out, figure)
    section = section_text(
        render_status(spec, args.out),
        park=args.park,
        when=args.when,
        seed=spec.pilot_seed,
        figure=str(figure),
        extra=args.extra.read_text(encoding="utf-8"),
    )
    try:
        text = replace_section(args.doc.read_text(encoding="utf-8"), section)
    except ValueError as e:
        print(f"error: --doc {str(args.doc)!r}: {e}", file=sys.stderr)
        return 2
    args.doc.write_text(text, encoding="utf-8")
    print(f"rewrote {args.doc}'s pilot section; figure: {figure}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
