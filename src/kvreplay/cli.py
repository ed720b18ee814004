"""The ``kvreplay`` command line: a thin click group; the work lives in the modules.

No option is written here. Each is a field of a typed request or setting whose metadata
names its flag and help (:mod:`kvreplay.core.options`): the shared run options
(:class:`~kvreplay.run.request.RunOptions`), where units run
(:class:`~kvreplay.engines.placement.Placement`), each backend's settings, each
experiment's own options, a check's (:class:`~kvreplay.run.check.CheckRequest`) and an
audit's (:class:`~kvreplay.audit.request.AuditRequest`). This module turns those fields
into click options and the parsed values back into the typed request.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any

import click

from kvreplay.core.errors import KvreplayError, exit_plainly, plain_errors
from kvreplay.core.options import Declared, build, every
from kvreplay.report.commands import OutputPath, UserPath
from kvreplay.run.supervise import supervise, watched

KEEP = object()  # an option's default is its field's


class PlainGroup(click.Group):
    """Every refusal, from option parsing on, ends in one sentence on stderr and exit 2;
    so does a registry's refusal of an entry while the commands were made (an
    experiment declared without a schema), for every command, and an engine that takes
    the process down (the command line's engine commands run in a watched child,
    :mod:`kvreplay.run.supervise`)."""

    refusal: str | None = None

    def main(self, args: Any = None, *more: Any, **options: Any) -> Any:
        if args is None and watched(sys.argv[1:]):
            code, sentence = supervise(sys.argv[1:])
            if sentence:
                if sys.stderr.isatty():
                    sys.stderr.write("\r\033[K")  # over the progress bar the child left
                exit_plainly(sentence)
            sys.exit(code)
        return super().main(args, *more, **options)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            if self.refusal is not None:
                raise KvreplayError(self.refusal)
            return super().invoke(ctx)
        except click.UsageError as exc:
            exit_plainly(exc.format_message())
        except KvreplayError as exc:
            exit_plainly(str(exc))


def _parsed(parse: Callable[[Any], Any]) -> Callable[[click.Context, click.Parameter, Any], Any]:
    """A click callback that validates an option with the library's own parser."""

    def callback(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
        try:
            return None if value is None else parse(value)
        except KvreplayError as exc:
            raise click.BadParameter(str(exc), ctx, param) from exc

    return callback


def _click_type(spec: Declared) -> Any:
    """The click type of a declared option's values (a number within its declared bounds;
    NaN, which no range excludes, is refused as the request is built)."""
    o = spec.option
    if spec.kind == "path":
        return OutputPath(o.output) if o.output else UserPath(path_type=Path)
    if o.choices:
        return click.Choice(list(o.choices))
    if spec.kind == "int":
        return click.IntRange(o.minimum, o.maximum)  # type: ignore[arg-type]
    if spec.kind == "float":
        return click.FloatRange(o.minimum, o.maximum)
    return str


def click_option(
    spec: Declared,
    default: Any = KEEP,
    help: str | None = None,
    given_only: bool = False,
) -> click.Option:
    """The click option of one declared field. Its default is the field's (or
    ``default``); ``given_only`` keeps it None unless given (an experiment's own options,
    a backend's settings: a run records only what was asked) and shows the field's
    default in the help instead."""
    o, text = spec.option, help or spec.option.help
    value = spec.default if default is KEEP else default
    if spec.kind == "bool":
        if o.negative:
            return click.Option([f"{o.flag}/{o.negative}", spec.name], default=None, help=text)
        return click.Option([o.flag, spec.name], is_flag=True, default=False, help=text)
    if given_only and value not in (None, ""):
        text += f" [default: {spec.text(value)}]"
    shown = None if given_only or value is None else spec.text(value)
    return click.Option(
        [o.flag, spec.name],
        type=_click_type(spec),
        default=shown if spec.kind == "parsed" else (None if given_only else value),
        show_default=shown not in (None, ""),
        callback=_parsed(o.parse) if o.parse else None,
        help=text,
    )


class WithBackends(click.Command):
    """A command that also takes options made from the registered backends' classes,
    last. They are made when the command is first parsed or shown: making them imports
    every backend's class and reads every installed distribution's entry points, which
    every other command, ``kvreplay analyze`` among them, must not pay.

    Where the command takes ``--backend``, its help is scoped (design: options declared
    once): the shared options, then the chosen backend's own settings (``--backend NAME
    --help``), or, with none chosen, which settings each backend takes. A setting of
    another backend is still parsed, to be refused in one sentence."""

    def __init__(
        self, *args: Any, backends: Callable[[], tuple[click.Option, ...]], **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.backends: Callable[[], tuple[click.Option, ...]] | None = backends

    def get_params(self, ctx: click.Context) -> list[click.Parameter]:
        if self.backends is not None:
            self.params += self.backends()
            self.backends = None
        return super().get_params(ctx)

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        ctx.meta[CHOSEN] = chosen_backend(args)
        return super().parse_args(ctx, args)

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        params = self.get_params(ctx)
        if not any(p.name == "backend" for p in params):
            return super().format_options(ctx, formatter)
        from kvreplay.backends import setting_options

        takers = {key: s.backends for key, s in setting_options().items()}
        chosen = ctx.meta.get(CHOSEN)
        shared = [r for p in params if p.name not in takers and (r := p.get_help_record(ctx))]
        own = [
            r
            for p in params
            if chosen in takers.get(p.name or "", ()) and (r := p.get_help_record(ctx))
        ]
        with formatter.section("Options"):
            formatter.write_dl(shared)
        if own:
            with formatter.section(f"Settings of the {chosen} backend"):
                formatter.write_dl(own)
            return
        flags = {p.name: p.opts[0] for p in params if p.name in takers}
        by_backend: dict[str, list[str]] = {}
        for key, names in takers.items():
            for name in names:
                by_backend.setdefault(name, []).append(flags[key])
        with formatter.section(f"Backend settings ({ctx.command_path} --backend NAME --help)"):
            formatter.write_dl([(name, ", ".join(f)) for name, f in by_backend.items()])


CHOSEN = "kvreplay.backend"  # the context's note of the backend a command line names


def chosen_backend(args: list[str]) -> str | None:
    """The backend a command line names (``--backend NAME`` or ``--backend=NAME``), read
    before parsing so that ``--help`` can show its settings."""
    for index, word in enumerate(args):
        if word == "--backend" and index + 1 < len(args):
            return args[index + 1]
        if word.startswith("--backend="):
            return word.partition("=")[2]
    return None


@functools.cache  # every run command and check takes the same options
def backend_options() -> tuple[click.Option, ...]:
    """``--backend`` and every registered backend's settings (a setting given for a
    backend that does not take it is refused)."""
    from kvreplay.backends import BACKENDS, DEFAULT_BACKEND, setting_options

    summaries = "; ".join(f"{name}: {cls.summary}" for name, cls in BACKENDS.items())
    backend = click.Option(
        ["--backend"], type=click.Choice(BACKENDS.names()), default=DEFAULT_BACKEND,
        show_default=True, help=f"{summaries}. See kvreplay backends.",
    )  # fmt: skip
    return (
        backend,
        *(
            click_option(
                s.declared,
                help=f"{', '.join(s.backends)}: {s.declared.option.help}",
                given_only=True,
            )
            for s in setting_options().values()
        ),
    )


def connection_options() -> tuple[click.Option, ...]:
    """A backend's connection settings (e.g. a server's --url), which a run does not
    record: given again to audit it."""
    from kvreplay.backends import setting_options

    return tuple(
        click_option(s.declared, help=f"{s.declared.option.help} (a server run)", given_only=True)
        for s in setting_options(connection_only=True).values()
    )


def _given(value: Any) -> bool:
    """Whether an option that defaults to "not given" was given (a flag left off was not;
    a 0 was)."""
    return value is not None and value is not False


def _backend(values: dict[str, Any]) -> Any:
    """The backend the options name, with the settings given for it (taken out of
    ``values``)."""
    from kvreplay.backends import make_backend, setting_options

    name = values.pop("backend")
    given = {k: v for k in setting_options() if _given(v := values.pop(k, None))}
    return make_backend(name, **given)


def shared_options(defaults: dict[str, Any], helps: dict[str, str]) -> list[click.Option]:
    """The options every run command shares (:class:`~kvreplay.run.request.RunOptions`),
    with the command's own defaults and help where it sets them otherwise."""
    from kvreplay.run.request import RunOptions

    return [
        click_option(spec, defaults.get(spec.name, KEEP), helps.get(spec.name))
        for spec in every(RunOptions)
    ]


def own_options(declaration: Any) -> list[click.Option]:
    """An experiment's own options, from its declaration: ``--from`` where it reads
    another run, then each field of its options dataclass."""
    source = [
        click.Option(
            ["--prefix-from", "--from", "prefix_from"], type=UserPath(path_type=Path),
            default=None, help=declaration.source,
        )
    ] if declaration.source else []  # fmt: skip
    return source + [click_option(s, given_only=True) for s in declaration.option_fields().values()]


def build_request(experiment: str, values: dict[str, Any]) -> Any:
    """The run request of ``kvreplay run EXPERIMENT`` from its parsed options: the
    shared ones, the backend's, and every option of the experiment's own as its
    ``extra``."""
    from kvreplay.experiments.registry import EXPERIMENTS
    from kvreplay.run.request import RunRequest

    values = dict(values)
    backend = _backend(values)
    own = EXPERIMENTS.get(experiment).option_fields()
    extra = {k: v for k in own if _given(v := values.pop(k, None))}
    return build(
        RunRequest, values, experiment=experiment, out=values.pop("out"), backend=backend,
        prefix_from=values.pop("prefix_from", None), extra=extra,
    )  # fmt: skip


@click.group(cls=PlainGroup)
@click.version_option(package_name="kvreplay")
def main() -> None:
    """Audit stage replay: does a prefix rebuilt by prefill continue like the live state?"""


class RunGroup(PlainGroup):
    """``kvreplay run EXPERIMENT``: one subcommand per experiment, refusing others plainly."""

    def resolve_command(
        self, ctx: click.Context, args: list[str]
    ) -> tuple[str | None, click.Command | None, list[str]]:
        if args and args[0] not in self.commands and not args[0].startswith("-"):
            raise KvreplayError(
                f"Unknown experiment {args[0]!r}; choose {', '.join(self.commands)}."
            )
        return super().resolve_command(ctx, args)


@main.group("run", cls=RunGroup)
def run_group() -> None:
    """Run (or resume) an experiment, one of the commands below."""


def _out(help: str, kind: str = "folder") -> click.Option:
    return click.Option(["--out", "out"], type=OutputPath(kind), required=True, help=help)


def _run_command(declaration: Any) -> None:
    """``kvreplay run EXPERIMENT``: the shared options and its own, from its declaration
    (:class:`kvreplay.harness.declaration.Declaration`)."""
    experiment = declaration.name

    def command(**values: Any) -> None:
        from kvreplay.run.runner import run

        request = build_request(experiment, values)
        run(request)
        click.echo(f"Ledger: {request.out}")

    command.__doc__ = declaration.summary
    defaults = {"temperature": declaration.temperature}
    helps = {"n": f"How many items (default: {declaration.default_n})."}
    options = [_out("Run directory."), *shared_options(defaults, helps), *own_options(declaration)]
    run_group.command(experiment, cls=WithBackends, backends=backend_options, params=options)(
        plain_errors(command)
    )


def _run_commands() -> None:
    """One ``run`` subcommand per declared experiment (importing the declarations loads
    no torch: ``--help`` and ``analyze`` stay light)."""
    from kvreplay.experiments.registry import EXPERIMENTS

    for declaration in EXPERIMENTS.values():
        _run_command(declaration)


def check_request(values: dict[str, Any], command: list[str] | None = None) -> Any:
    """The typed request of ``kvreplay check`` from its parsed options; its recorded
    command is spelled from the request itself unless given."""
    from kvreplay.run.check import CheckRequest, check_own_options

    values = dict(values)
    backend = _backend(values)
    given = {k: v for k in check_own_options() if _given(v := values.pop(k, None))}
    request = build(CheckRequest, values, backend=backend, own=given)
    return replace(request, command=command or ["kvreplay", "check", *request.words()])


def _check_options() -> list[click.Option]:
    """A check's options: the shared ones with the check's own defaults, what must hold
    and where the verdict goes, and the options of the experiment it runs greedily."""
    from kvreplay.run.check import (
        BATTERY_ITEMS,
        CHECK_DEFAULTS,
        DEFAULT_ITEMS,
        DTYPES_HELP,
        CheckRequest,
        check_own_options,
    )
    from kvreplay.run.request import RunOptions

    shared = {s.name for s in every(RunOptions)}
    helps = {"n": f"How many items (default {DEFAULT_ITEMS}; a battery {BATTERY_ITEMS}; "
                  "--max-rate sets it).",
             "dtypes": DTYPES_HELP}  # fmt: skip
    checks = [click_option(s) for s in every(CheckRequest) if s.name not in shared]
    return [
        *shared_options(CHECK_DEFAULTS, helps),
        *checks,
        *(click_option(s, given_only=True) for s in check_own_options().values()),
    ]


def _check_command() -> None:
    def check(**values: Any) -> None:
        """Is replay faithful on this stack? On a backend with a prefix cache (vllm,
        http) the default is the request-shape battery: one item's prompt served as a
        miss and as a hit after each of 13 histories (warm, block-aligned, one block,
        second hit, interloper, companion, salted, twin, batched, sampled, random cut,
        evicted, preempted), compared bit for bit at the reported log-probabilities where
        the clean engine is measured exact (vLLM at fp32), and stopping at the first
        detection. Elsewhere, and with --select: live vs prefill on a few items, with
        replicas. Exit 0 when the expectation holds, 1 when it does not, 2 on error.

        Which faults it catches (docs/benchmarks/faults.md): the default, every vLLM fault
        of the suite and the llama.cpp restore and transformers cache faults; it misses a
        numerics-only llama.cpp prefill fault, which --expect bitwise catches (a q8_0
        cache with flash attention is bit-exact there); on a server, a shape whose history
        needs the server's pool filled runs only where the pool is small (start vllm
        serve with --num-gpu-blocks-override 16); --traffic N adds background load."""
        from kvreplay.run.check import run_check

        sys.exit(run_check(check_request(values, list(sys.argv)), click.echo).exit_code)

    main.command("check", cls=WithBackends, backends=backend_options, params=_check_options())(
        plain_errors(check)
    )


def _registered_commands() -> None:
    """The commands made from the registries: one run per experiment, and the check (its
    options are the greedy experiment's and the rollout's)."""
    try:
        _run_commands()
        _check_command()
    except KvreplayError as exc:  # said by every command, not as an import's traceback
        main.refusal = str(exc)  # type: ignore[attr-defined]


_registered_commands()


def _threads_option() -> click.Option:
    """``--threads``, as a run's placement declares it."""
    from kvreplay.core.options import declared
    from kvreplay.engines.placement import Placement

    return click_option(declared(Placement)["threads"])


def _demo_options() -> list[click.Option]:
    from kvreplay.demo import DemoRequest

    return [click_option(spec) for spec in every(DemoRequest)]


@main.command("demo", params=_demo_options())
@plain_errors
def demo_command(**values: Any) -> None:
    """All three experiments on the embedded default model, then analysis and report."""
    from kvreplay.demo import DemoRequest, run_demo

    request = build(DemoRequest, values)
    run_demo(request.out, request.n, workers=request.workers, threads=request.threads)


def _audit_options() -> list[click.Option]:
    from kvreplay.audit.request import AuditRequest

    return [click_option(spec) for spec in every(AuditRequest)]


@plain_errors
def audit_command(run_dir: Path, **values: Any) -> None:
    """Verify a run: every row against itself and the folder, and re-execute its rows (or
    a --sample of them) to verify every token, fingerprint and hash."""
    from kvreplay.audit.audit import audit, format_audit
    from kvreplay.audit.request import AuditRequest
    from kvreplay.backends import setting_options

    connection = {key: values.pop(key, None) for key in setting_options(connection_only=True)}
    request = build(AuditRequest, values)
    result = audit(
        run_dir, request, announce=lambda s: click.echo(s, err=True), connection=connection
    )
    click.echo(format_audit(result))
    sys.exit(0 if result.passed else 1)


main.command(
    "audit",
    cls=WithBackends,
    backends=connection_options,
    params=[click.Argument(["run_dir"], type=UserPath(path_type=Path)), *_audit_options()],
)(audit_command)


def _probe_options() -> list[click.Option]:
    """The http backend's settings that say where its server is and how to reach it."""
    from kvreplay.backends.http import HttpBackend

    settings = HttpBackend.settings()
    url = click_option(settings["url"])
    url.required = True
    return [url, *(click_option(settings[k]) for k in ("server", "api_key_env", "timeout"))]


@main.command("probe", params=_probe_options())
@plain_errors
def probe_command(**settings: Any) -> None:
    """Ask a running server what it is and whether kvreplay can audit it (exit 0), or
    why not (one sentence, exit 2)."""
    from kvreplay.backends import make_backend

    backend: Any = make_backend("http", **settings)
    for name, value in backend.probe.table():
        click.echo(f"{name:<30} {value}")
    refusal = backend.probe.missing(backend.url)
    if refusal is not None:
        raise KvreplayError(refusal)
    click.echo("kvreplay can audit this server: --backend http --url " + backend.url)


@main.command("backends")
@plain_errors
def backends_command() -> None:
    """List every backend, whether this environment can run it, and its capabilities."""
    from kvreplay.backends import BACKENDS

    for name, cls in BACKENDS.items():
        backend = cls()
        state = "installed" if backend.installed() else "not installed here"
        click.echo(f"{name} ({state}): {cls.summary}")
        if not backend.installed() and cls.install_command():
            click.echo(f"  install: {cls.install_command()}")
        click.echo(f"  capabilities: {', '.join(cls.capabilities.describe())}")
        settings = [s.flag for s in cls.settings().values()]
        if settings:
            click.echo(f"  settings: {', '.join(settings)}")


@main.command("env")
@click.argument("run_dir", type=UserPath(path_type=Path))
@click.option(
    "--venv",
    type=OutputPath("folder", named=True),
    default=None,
    help="Build this virtual environment (a new or empty folder) with the run's "
    "environment (else print it).",
)
@plain_errors
def env_command(run_dir: Path, venv: str | None) -> None:
    """Print the environment a run was made in as a requirements file, or rebuild it."""
    from kvreplay.contract.lock import run_environment
    from kvreplay.ledger import RunLedger
    from kvreplay.run.env import rebuild

    manifest = RunLedger.open_existing(run_dir).manifest
    if venv is None:
        click.echo(run_environment(manifest).requirements(), nl=False)
        return
    rebuild(manifest, venv, lambda line: click.echo(line, err=True))
    click.echo(f"rebuilt {venv}; re-execute the run with: {venv}/bin/kvreplay audit {run_dir}")


def _mismatch_options() -> list[click.Parameter]:
    from kvreplay.run.mismatch import LoggedRequest

    logged = click.Argument(["logged"], type=UserPath(path_type=Path))
    return [logged, *(click_option(s) for s in every(LoggedRequest))]


@main.command("mismatch", params=_mismatch_options())
@plain_errors
def mismatch_command(logged: Path, **values: Any) -> None:
    """The training-inference mismatch of rollouts a framework logged (JSONL: prompt and
    response ids, rollout and trainer log-probabilities; docs/experiments/rollout.md).
    With a gate, exit 0 when it holds and 1 when not."""
    from kvreplay.engines.threads import intra_op_threads
    from kvreplay.run.mismatch import LoggedRequest, analyze_logged

    request = build(LoggedRequest, values)
    # torch (and its threads) only where a rescoring engine computes
    threads = intra_op_threads(request.threads) if request.rescore_with else nullcontext()
    with threads:
        sys.exit(analyze_logged(logged, request, click.echo))


@main.group("items")
def items_group() -> None:
    """Make item sets (JSONL for --items)."""


@plain_errors
def cut_refeed_command(out: Path, **values: Any) -> None:
    """Long greedy generations cut at seeded random points, written as items whose prompts
    are the token ids up to each cut (docs/experiments/items-and-plans.md)."""
    from kvreplay.engines.threads import intra_op_threads
    from kvreplay.run.refeed import RefeedPlan, check_out, refeed_items, write_items

    refeed = build(RefeedPlan, values)
    refeed.check()
    check_out(out, (refeed.model, refeed.items_source))
    with intra_op_threads(values["threads"]):
        items = refeed_items(refeed)
    write_items(items, out)
    sources = len({item.meta["source"] for item in items})
    click.echo(f"wrote {len(items)} cut-and-refeed items from {sources} generation(s) to {out}")


def _cut_refeed_options() -> list[click.Option]:
    from kvreplay.run.refeed import RefeedPlan

    out = _out("The JSONL file to write (it must not exist).", "file")
    return [*(click_option(s) for s in every(RefeedPlan)), out, _threads_option()]


items_group.command("cut-refeed", params=_cut_refeed_options())(cut_refeed_command)


def _add_analysis_commands() -> None:
    from kvreplay.report.commands import analyze, report

    main.add_command(analyze)
    main.add_command(report)


_add_analysis_commands()
