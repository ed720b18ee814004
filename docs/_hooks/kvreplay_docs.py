"""MkDocs hooks that keep the docs site from drifting from the repository.

- **Repository links.** A page may link a file outside ``docs/`` (a committed figure, a
  bench script) by its relative path, so the link works when the Markdown is read in
  the repository too. The build copies each such file into the site under ``_repo/`` and
  points the link there; a link to a file that does not exist is a warning, which
  ``mkdocs build --strict`` turns into a failed build.
- **Generated blocks.** A block ``<!-- generated: SPEC -->`` ... ``<!-- /generated -->``
  must hold what kvreplay's own declarations make of it now: ``columns EXPERIMENT
  [served]`` an experiment's CSV columns (its table in
  :func:`kvreplay.experiments.registry.experiment_tables`), ``backends`` every backend's
  capabilities, ``settings BACKEND`` a backend's options (its settings class),
  ``options EXPERIMENT`` a run command's options, ``declared check|trainer|update|audit``
  the options of ``kvreplay check``, of its role gates or of ``kvreplay audit`` (their
  typed requests), ``metrics`` the mismatch metrics
  (:data:`kvreplay.experiments.rollout.metrics.METRICS`), ``faults`` the fault suite
  (:data:`kvreplay.faults.registry.FAULTS`), ``detection PATH`` the detection tables of a
  ``bench/faults.py`` results file. A block
  that differs is a warning. ``python docs/_hooks/kvreplay_docs.py --write`` makes every
  block anew; the pages stay plain Markdown that reads the same in the repository.

Run as a script, or imported by the test suite, it needs only kvreplay's declarations
(no torch, no MkDocs).
"""

from __future__ import annotations

import dataclasses
import logging
import posixpath
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

DOCS = Path(__file__).resolve().parents[1]
REPO = DOCS.parent
COPIED = "_repo"  # where the site keeps the repository files pages link
log = logging.getLogger("mkdocs.hooks.kvreplay_docs")

FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.DOTALL | re.MULTILINE)
LINK = re.compile(r"(!?\[[^\]\n]*\]\()([^)\s#]+)(#[^)\s]*)?\)")
GENERATED = re.compile(
    r"(<!-- generated: (?P<spec>[\w ./-]+?) -->\n)(?P<body>.*?)(<!-- /generated -->)", re.DOTALL
)


def _outside_fences(markdown: str) -> list[tuple[int, int]]:
    """Spans of ``markdown`` that are not fenced code (links there are text, not links)."""
    spans, start = [], 0
    for fence in FENCE.finditer(markdown):
        spans.append((start, fence.start()))
        start = fence.end()
    return [*spans, (start, len(markdown))]


def repository_links(page: str, markdown: str) -> list[tuple[re.Match[str], str]]:
    """Each link of ``page`` (a path under docs/) that leaves docs/, with the repository
    path it names."""
    found = []
    folder = posixpath.dirname(page)
    for start, end in _outside_fences(markdown):
        for match in LINK.finditer(markdown, start, end):
            target = match.group(2)
            if "://" in target or target.startswith(("mailto:", "/")):
                continue
            path = posixpath.normpath(posixpath.join("docs", folder, target))
            if not path.startswith("docs/") and not path.startswith("../"):
                found.append((match, path))
    return found


def columns_markdown(name: str, served: str = "") -> str:
    """The columns of an experiment's CSV as its table declares them (``served``: the
    table a backend without K/V access writes, as its differences from the K/V table)."""
    from kvreplay.experiments.registry import experiment_tables

    table, served_table = experiment_tables()[name]
    if not served:
        keys = ", ".join(f"`{k}`" for k in table.key)
        lines = [
            f"`{table.file}`, one line per {keys}:",
            "",
            "| column | kind | analysis | since |",
            "|---|---|---|---|",
            *(f"| `{c.name}` | {c.kind} | {c.use} | {c.since} |" for c in table.columns),
        ]
        return "\n".join(lines) + "\n"
    assert served == "served" and served_table is not None, f"{name} has no served table"
    kv = {c.name: c for c in table.columns}
    lines = [
        f"On a backend without K/V access, `{served_table.file}` differs from the table above "
        "in these columns:",
        "",
        "| column | kind | analysis | on a served row |",
        "|---|---|---|---|",
    ]
    for c in served_table.columns:
        before = kv.get(c.name)
        if before is None:
            lines.append(f"| `{c.name}` | {c.kind} | {c.use} | added |")
        elif (before.kind, before.use) != (c.kind, c.use):
            lines.append(f"| `{c.name}` | {c.kind} | {c.use} | empty: it needs K/V |")
    served_names = {c.name for c in served_table.columns}
    lines += [f"| `{n}` | | | not written |" for n in kv if n not in served_names]
    return "\n".join(lines) + "\n"


def backends_markdown(folder: str = "") -> str:
    """Every backend: its capabilities and the experiments it runs (each linked to its
    page, which lies in ``folder`` seen from the page that holds the table)."""
    from kvreplay.backends import BACKENDS
    from kvreplay.backends.base import Capabilities
    from kvreplay.experiments.registry import declared

    names = [f.name for f in dataclasses.fields(Capabilities)]
    lines = [
        "| backend | " + " | ".join(n.replace("_", " ") for n in names) + " | experiments |",
        "|---" * (len(names) + 2) + "|",
    ]
    for name, cls in BACKENDS.items():
        marks = ["yes" if getattr(cls.capabilities, n) else "" for n in names]
        runs = [e for e, declaration in declared().items() if declaration.runs_on(cls)]
        link = f"[{name}]({folder}{name}.md)"
        lines.append(f"| {link} | " + " | ".join(marks) + f" | {', '.join(runs)} |")
    return "\n".join(lines) + "\n"


def settings_markdown(name: str) -> str:
    """A backend's settings as its class declares them: flag, default, help."""
    from kvreplay.backends import backend_class

    cls = backend_class(name)
    lines = [
        f"`--dtypes` takes {', '.join(f'`{p}`' for p in cls.precisions)}.",
        "",
    ]
    settings = cls.settings()
    if not settings:
        return lines[0] + " The backend has no settings of its own.\n"
    lines += ["| option | default | what it sets |", "|---|---|---|"]
    for key, spec in settings.items():
        default = "" if spec.default in ("", None, False) else f"`{spec.text(spec.default)}`"
        connection = (
            " Not recorded: give it again to resume or audit." if (key in cls.connection) else ""
        )
        text = spec.option.help + _bounds(spec.option.minimum, spec.option.maximum)
        lines.append(f"| `{spec.flag}` | {default} | {text}{connection} |")
    return "\n".join(lines) + "\n"


def options_markdown(experiment: str) -> str:
    """The options of ``kvreplay run EXPERIMENT`` as its click command declares them:
    those only it takes, or (``shared``) those every experiment takes, with matched's
    defaults. The backends' settings are left out: each backend page lists its own."""
    from kvreplay.cli import backend_options, run_group

    backends = {option.name for option in backend_options()}
    commands = run_group.commands
    shared = set.intersection(*({p.name for p in c.params} for c in commands.values()))
    source = commands["matched" if experiment == "shared" else experiment]
    own = experiment != "shared"
    lines = ["| option | default | what it sets |", "|---|---|---|"]
    for param in source.params:
        if not isinstance(param, click.Option) or param.name in backends:
            continue
        if (param.name in shared) == own:
            continue
        flags = ", ".join(f"`{flag}`" for flag in (*param.opts, *param.secondary_opts))
        text = " ".join((param.help or "").split()).replace("|", "\\|")
        text += _bounds(getattr(param.type, "min", None), getattr(param.type, "max", None))
        lines.append(f"| {flags} | {_default(param)} | {text} |")
    return "\n".join(lines) + "\n"


def declared_markdown(command: str) -> str:
    """The options ``kvreplay check`` (beyond the run options every run command shares),
    its trainer gate (``trainer``: its own and those of its experiment it takes) or
    ``kvreplay audit`` take, as their typed requests declare them."""
    from kvreplay.audit.request import AuditRequest
    from kvreplay.core.options import every
    from kvreplay.core.registry import load
    from kvreplay.experiments.registry import declared
    from kvreplay.run.check import ROLES, CheckRequest, role_gate
    from kvreplay.run.request import RunOptions

    if command == "check":
        shared = {s.name for s in every(RunOptions)}
        specs = [s for s in every(CheckRequest) if s.name not in shared]
    elif command in ROLES:
        name, gate = role_gate(command)
        own = declared()[name].option_fields()
        specs = [own[k] for k in gate.takes] + (
            list(every(load(gate.options))) if gate.options else []
        )
    else:
        specs = list(every(AuditRequest))
    lines = ["| option | default | what it sets |", "|---|---|---|"]
    for spec in specs:
        default = "" if spec.default in (None, False, "") else f"`{spec.text(spec.default)}`"
        text = " ".join(spec.option.help.split()).replace("|", "\\|")
        text += _bounds(spec.option.minimum, spec.option.maximum)
        lines.append(f"| `{spec.flag}` | {default} | {text} |")
    return "\n".join(lines) + "\n"


def _bounds(low: float | None, high: float | None) -> str:
    """A number option's declared bounds, as its table says them."""
    if low is None or high is None:
        return ""
    low_, high_ = (f"{int(x):,}" if float(x).is_integer() else f"{x:g}" for x in (low, high))
    return f" (from {low_} to {high_})"


def _default(param: click.Option) -> str:
    if param.required:
        return "required"
    value = param.default
    if value is None or value is False or type(value).__name__ == "Sentinel":
        return ""
    return f"`{value}`"


def metrics_markdown() -> str:
    """Every mismatch metric as :data:`kvreplay.experiments.rollout.metrics.METRICS` defines it."""
    from kvreplay.experiments.rollout.metrics import METRICS

    lines = ["| metric | definition | what RL frameworks log as |", "|---|---|---|"]
    for m in METRICS:
        text = m.definition.replace("|", "\\|")
        lines.append(f"| `{m.name}` | {text} | {m.known_as or '—'} |")
    return "\n".join(lines) + "\n"


def faults_markdown() -> str:
    """The fault suite as :data:`kvreplay.faults.registry.FAULTS` declares it."""
    from kvreplay.faults.tables import fault_table

    return fault_table()


def detection_markdown(path: str) -> str:
    """The detection and false-alarm tables of a ``bench/faults.py`` results file."""
    import json

    from kvreplay.faults.tables import detection_tables

    return detection_tables(json.loads((REPO / path).read_text(encoding="utf-8")))


GENERATORS: dict[str, Callable[..., str]] = {
    "columns": columns_markdown,
    "backends": backends_markdown,
    "settings": settings_markdown,
    "options": options_markdown,
    "declared": declared_markdown,
    "metrics": metrics_markdown,
    "faults": faults_markdown,
    "detection": detection_markdown,
}


def generated(spec: str) -> str:
    """What a block ``<!-- generated: SPEC -->`` holds: the generator's name, then its
    arguments."""
    name, *args = spec.split()
    return GENERATORS[name](*args)


def stale_blocks(markdown: str) -> list[str]:
    """The generated blocks of a page that differ from what their generators make now."""
    return [m["spec"] for m in GENERATED.finditer(markdown) if m["body"] != generated(m["spec"])]


def refresh_blocks(markdown: str) -> str:
    """``markdown`` with every generated block made anew."""
    return GENERATED.sub(lambda m: m.group(1) + generated(m["spec"]) + m.group(4), markdown)


# MkDocs events


def on_files(files: Any, config: Any) -> Any:
    """Add every repository file a page links to the site, under ``_repo/``."""
    from mkdocs.structure.files import File

    wanted: set[str] = set()
    for page in list(files.documentation_pages()):
        markdown = Path(page.abs_src_path).read_text(encoding="utf-8")
        for _, path in repository_links(page.src_uri, markdown):
            if path.startswith("../") or not (REPO / path).is_file():
                log.warning(f"{page.src_uri} links {path}, which is not a file in the repository")
            elif path.endswith(".md"):
                log.warning(f"{page.src_uri} links {path}: link its docs page instead")
            else:
                wanted.add(path)
    for path in sorted(wanted):
        files.append(File.generated(config, f"{COPIED}/{path}", abs_src_path=str(REPO / path)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Point repository links at their copies; warn about stale column blocks."""
    for spec in stale_blocks(markdown):
        log.warning(
            f"{page.file.src_uri}: the block '{spec}' differs from what kvreplay declares; "
            "run python docs/_hooks/kvreplay_docs.py --write"
        )
    folder = posixpath.dirname(page.file.src_uri)
    for match, path in reversed(repository_links(page.file.src_uri, markdown)):
        copy = posixpath.relpath(f"{COPIED}/{path}", folder or ".")
        link = f"{match.group(1)}{copy}{match.group(3) or ''})"
        markdown = markdown[: match.start()] + link + markdown[match.end() :]
    return markdown


def main(argv: list[str]) -> int:
    """``--write``: make every generated block anew; else list the stale ones (exit 1)."""
    stale = 0
    for path in sorted(DOCS.rglob("*.md")):
        text = path.read_text(encoding="utf-8")
        specs = stale_blocks(text)
        if specs and "--write" in argv:
            path.write_text(refresh_blocks(text), encoding="utf-8")
            print(f"rewrote {path.relative_to(REPO)}: {', '.join(specs)}")
        elif specs:
            print(f"{path.relative_to(REPO)}: stale {', '.join(specs)}")
            stale += 1
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
