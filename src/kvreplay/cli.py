"""The ``kvreplay`` command line: a thin click group; the work lives in the modules."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from kvreplay.core.errors import KvreplayError, exit_plainly, plain_errors
from kvreplay.core.paths import UserPath
from kvreplay.engines import MAX_WORKERS


class PlainGroup(click.Group):
    """Every refusal, from option parsing on, ends in one sentence on stderr and exit 2."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.UsageError as exc:
            exit_plainly(exc.format_message())
        except KvreplayError as exc:
            exit_plainly(str(exc))


def _parsed(parse: Callable[[Any], Any]) -> Callable[[click.Context, click.Parameter, Any], Any]:
    """A click callback that validates an option with the library's own parser."""

    def callback(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
        try:
            return parse(value)
        except KvreplayError as exc:
            raise click.BadParameter(str(exc), ctx, param) from exc

    return callback


def _dtypes(value: str) -> tuple[str, ...]:
    """Precisions some backend runs; the run's backend refuses those it does not."""
    from kvreplay.backends import precisions
    from kvreplay.model.precision import parse_dtypes

    return parse_dtypes((v.strip() for v in value.split(",") if v.strip()), precisions())


def _device(value: str) -> str:
    from kvreplay.model.precision import parse_device

    return parse_device(value)


WORKERS = click.IntRange(1, MAX_WORKERS)


def threads_option(func: Callable[..., Any]) -> Callable[..., Any]:
    """``--threads``: torch intra-op threads per worker process (default one; see
    :mod:`kvreplay.run.threads`)."""
    from kvreplay.run.threads import DEFAULT_THREADS, MAX_THREADS

    return click.option(
        "--threads", type=click.IntRange(1, MAX_THREADS), default=DEFAULT_THREADS,
        show_default=True,
        help="torch threads per worker process; a resume or audit needs the run's count.",
    )(func)  # fmt: skip


class WithBackends(click.Command):
    """A command that also takes options made from the registered backends' classes,
    last. They are made when the command is first parsed or shown: making them reads every
    installed distribution's entry points and imports every backend's class (a package's
    may load its inference library), which every other command, ``kvreplay analyze``
    among them, must not pay."""

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


@functools.cache  # every run command and check takes the same options
def backend_options() -> tuple[click.Option, ...]:
    """``--backend`` and every registered backend's settings, generated from the backend
    classes (a setting given for a backend that does not take it is refused). Asking the
    registry reads every installed distribution's entry points, so it is asked once."""
    from kvreplay.backends import backend_class, registry, setting_options

    summaries = "; ".join(f"{name}: {backend_class(name).summary}" for name in registry())
    backend = click.Option(
        ["--backend"], type=click.Choice(list(registry())), default="hf", show_default=True,
        help=f"{summaries}. See kvreplay backends.",
    )  # fmt: skip
    return (backend, *(_setting_option(key, meta) for key, meta in setting_options().items()))


def connection_options() -> tuple[click.Option, ...]:
    """A backend's connection settings (e.g. a server's --url), which a run does not
    record: given again to audit it."""
    from kvreplay.backends import setting_options

    return tuple(
        _setting_option(key, meta, f"{meta['help']} (a server run)")
        for key, meta in setting_options(connection_only=True).items()
    )


# A backend setting's CLI type, by its annotation; bounds are each backend's to check.
OPTION_TYPES = {"int": click.IntRange(min=0, max=2**20), "str": str, "float": float}


def _setting_option(key: str, meta: dict[str, Any], help: str | None = None) -> click.Option:
    default = f" [default: {meta['default']}]" if meta["default"] not in ("", None) else ""
    return click.Option(
        [meta["option"], key], type=OPTION_TYPES[meta["type"]], default=None,
        help=help or f"{', '.join(meta['backends'])}: {meta['help']}{default}",
    )  # fmt: skip


def run_options(
    func: Callable[..., Any],
    temperature: float = 0.0,
    dtypes: str = "bf16,fp32",
    n_help: str = "How many items (default: all).",
) -> Callable[..., Any]:
    """Options shared by every ``run`` experiment and ``check`` (the backends' settings
    follow them: :class:`WithBackends`); the defaults given are the command's own (an
    experiment that samples by nature declares its temperature; a check runs a few items
    in bf16)."""
    options = [
        click.option("--model", default="smollm2-135m", show_default=True,
                     help="Embedded model name, local folder, GGUF file, or cached hub id."),
        click.option("--items", "items_source", default="arith", show_default=True,
                     help="Built-in item set or a JSONL file."),
        click.option("--n", type=int, default=None, help=n_help),
        click.option("--dtypes", default=dtypes, show_default=True, callback=_parsed(_dtypes),
                     help="Comma-separated precisions: fp32, bf16, fp16 "
                     "(llamacpp: KV-cache types, also q8_0)."),
        click.option("--plan", default="instruct", show_default=True,
                     help="Built-in stage plan (instruct, reasoning, short) or a plan .json."),
        click.option("--extractor", default="integer", show_default=True,
                     help="Answer extractor: integer, choice or boxed."),
        click.option("--device", default="cpu", show_default=True, callback=_parsed(_device),
                     help="cpu, cuda or cuda:N."),
        click.option("--temperature", type=float, default=temperature, show_default=True,
                     help="0 is greedy; above 0 samples with --seed (several samples an item "
                          "take seeds --seed, --seed+1, ...)."),
        click.option("--top-p", type=float, default=1.0, show_default=True),
        click.option("--seed", type=int, default=0, show_default=True),
        click.option("--chat/--no-chat", default=None,
                     help="Force the chat template on or off (default: use it if present)."),
        click.option("--attn", default="sdpa", show_default=True,
                     help="Attention implementation passed to transformers."),
        click.option("--trust-remote-code", is_flag=True, default=False),
        click.option("--save-snapshots", is_flag=True, default=False,
                     help="Also save boundary states as safetensors (large for big models)."),
        click.option("--engine", type=click.Choice(["local", "ray"]), default="local",
                     show_default=True),
        click.option("--workers", type=WORKERS, default=1, show_default=True,
                     help="Worker processes (local: spawned on this machine; ray: actors)."),
        click.option("--gpus-per-worker", type=click.FloatRange(min=0), default=0.0,
                     show_default=True),
        click.option("--ray-address", default=None, help="Join this Ray cluster."),
        threads_option,
    ]  # fmt: skip
    for option in reversed(options):
        func = option(func)
    return func


def own_option(key: str, meta: dict[str, Any]) -> Callable[..., Any]:
    """The CLI option of one field of an experiment's options dataclass (its metadata:
    :func:`kvreplay.experiments.declaration.option`). Its default stays None, so that the
    run's ``extra`` holds only what was given; the field's default is shown."""
    kind = meta["type"].removesuffix(" | None")
    if kind == "bool":
        return click.option(meta["option"], key, is_flag=True, default=False, help=meta["help"])
    default = f" [default: {meta['default']}]" if meta["default"] is not None else ""
    if meta["choices"]:
        kind_type: Any = click.Choice(list(meta["choices"]))
    elif meta["minimum"] is not None:
        kind_type = click.IntRange(min=meta["minimum"])
    else:
        kind_type = {"int": int, "str": str, "float": float}[kind]  # the experiment checks it
    return click.option(
        meta["option"], key, type=kind_type, default=None, help=meta["help"] + default
    )


def own_options(declaration: Any) -> list[Callable[..., Any]]:
    """An experiment's own options, from its declaration: ``--from`` where it reads
    another run, then each field of its options dataclass."""
    options = [
        click.option(
            "--prefix-from", "--from", "prefix_from", type=UserPath(path_type=Path),
            default=None, help=declaration.source,
        )
    ] if declaration.source else []  # fmt: skip
    return options + [own_option(key, meta) for key, meta in declaration.option_fields().items()]


def build_request(experiment: str, out: Path, kwargs: dict[str, Any]) -> Any:
    """The run request of ``kvreplay run EXPERIMENT``: the shared options, and every
    option of the experiment's own as its ``extra``."""
    from kvreplay.backends import make_backend, setting_options
    from kvreplay.core.sampler import Sampler
    from kvreplay.run.runner import RunRequest

    options = dict(kwargs)
    take = options.pop
    return RunRequest(
        experiment=experiment,
        out=out,
        model=take("model"),
        items=take("items_source"),
        n=take("n"),
        dtypes=take("dtypes"),
        plan=take("plan"),
        extractor=take("extractor"),
        device=take("device"),
        sampler=Sampler(take("temperature"), take("top_p"), take("seed")),
        chat=take("chat"),
        attn_implementation=take("attn"),
        trust_remote_code=take("trust_remote_code"),
        save_snapshots=take("save_snapshots"),
        prefix_from=take("prefix_from", None),
        engine=take("engine"),
        workers=take("workers"),
        gpus_per_worker=take("gpus_per_worker"),
        ray_address=take("ray_address"),
        threads=take("threads"),
        backend=make_backend(
            take("backend"),
            **{k: v for k in setting_options() if (v := take(k)) is not None},
        ),
        extra={k: v for k, v in options.items() if v is not None and v is not False},
    )


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


def _run_command(declaration: Any) -> None:
    """``kvreplay run EXPERIMENT``: the shared options (defined once) and its own, from
    its declaration (:class:`kvreplay.experiments.declaration.Declaration`)."""
    experiment = declaration.name

    def command(out: Path, **kwargs: Any) -> None:
        from kvreplay.run.runner import run

        run(build_request(experiment, out, kwargs))
        click.echo(f"Ledger: {out}")

    command.__doc__ = declaration.summary
    func: Callable[..., Any] = plain_errors(command)
    for option in reversed(own_options(declaration)):
        func = option(func)
    n_help = f"How many items (default: {declaration.default_n})."
    func = run_options(func, declaration.temperature, n_help=n_help)
    func = click.option(
        "--out", type=UserPath(path_type=Path), required=True, help="Run directory."
    )(func)
    run_group.command(experiment, cls=WithBackends, backends=backend_options)(func)


def _run_commands() -> None:
    """One ``run`` subcommand per declared experiment (importing the declarations loads
    no torch: ``--help`` and ``analyze`` stay light)."""
    from kvreplay.experiments.registry import declared

    for declaration in declared().values():
        _run_command(declaration)


_run_commands()


def command_line(ctx: click.Context) -> list[str]:
    """The command a context ran, as the arguments that differ from its defaults (what a
    repro pack gives back as the command that reproduces it)."""
    words = ["kvreplay", *ctx.command_path.split()[1:]]
    for param in ctx.command.params:
        value = ctx.params.get(param.name)
        if not isinstance(param, click.Option) or value is None or value == param.default:
            continue
        if param.is_flag and param.secondary_opts:
            words.append(param.opts[0] if value else param.secondary_opts[0])
        elif param.is_flag:
            words += [param.opts[0]] if value else []
        elif isinstance(value, tuple):
            if ",".join(value) != param.default:
                words += [param.opts[0], ",".join(value)]
        else:
            words += [param.opts[0], str(value)]
    return words


def _greedy_options() -> list[Callable[..., Any]]:
    """``--select`` and ``--screen``: the own options of the experiment a greedy check
    runs."""
    from kvreplay.experiments.registry import declared
    from kvreplay.verify.check import GREEDY

    return [own_option(k, m) for k, m in declared()[GREEDY].option_fields().items()]


CHECK_OPTIONS = [
    click.option("--out", type=UserPath(path_type=Path), default=None,
                 help="Run folder of the check (default: kvreplay-check/<model>-<backend>-"
                      "<dtypes>-t<temperature>); rerunning resumes it, and kvreplay audit "
                      "re-executes it."),
    click.option("--expect",
                 type=click.Choice(["exact", "max-divergent", "bitwise", "faithful"]),
                 default=None,
                 help="What must hold: exact (every suffix equal: the token level; the default "
                      "when greedy), max-divergent (at most --max-divergent items differ), "
                      "bitwise (every compared step's numerics bit-equal: logits or top-k "
                      "logprobs, and K/V where the backend has them; stops at the first item "
                      "whose numerics part; what a gate on a deterministic mode such as "
                      "VLLM_BATCH_INVARIANT=1 wants), or faithful (the seeded samples' certificate "
                      "within --margin; the default at --temperature > 0). Every verdict "
                      "reports both levels."),
    click.option("--max-divergent", type=click.IntRange(min=0), default=None,
                 help="Items allowed to diverge under --expect max-divergent."),
    click.option("--max-rate", type=float, default=None,
                 help="Run as many items as a pass needs to bound the divergence rate under "
                      "this rate at 95% (e.g. 0.05: 72 items), stopping as soon as the bound "
                      "is out of reach; replaces --n."),
    click.option("--margin", type=float, default=None,
                 help="Equivalence margin of --expect faithful, in (0, 1) (default 0.05)."),
    click.option("--samples", type=click.IntRange(min=2, max=4096), default=None,
                 help="Seeded samples per item at --temperature > 0 (default 8)."),
    *_greedy_options(),
    click.option("--json", "json_path", type=UserPath(path_type=Path, dir_okay=False),
                 default=None, help="Write the verdict as JSON (schema kvreplay-check-v3)."),
    click.option("--junit", "junit_path", type=UserPath(path_type=Path, dir_okay=False),
                 default=None, help="Write JUnit XML: one test case per item."),
    click.option("--repro", type=UserPath(path_type=Path, file_okay=False), default=None,
                 help="Repro pack of the first divergent item (default: <out>.repro)."),
]  # fmt: skip


def _check_command() -> None:
    def check(**options: Any) -> None:
        """Is replay faithful on this stack? Live vs prefill (a prefix-cache hit vs a miss
        on a served backend) on a few items, with replicas. Exit 0 when the expectation
        holds, 1 when it does not, 2 on error."""
        from kvreplay.verify.check import run_check

        command = command_line(click.get_current_context())
        sys.exit(run_check(options, build_request, click.echo, command).exit_code)

    func: Callable[..., Any] = plain_errors(check)
    for option in reversed(CHECK_OPTIONS):
        func = option(func)
    command = run_options(
        func, dtypes="bf16", n_help="How many items (default 4; --max-rate sets it)."
    )
    main.command("check", cls=WithBackends, backends=backend_options)(command)


_check_command()


@main.command("demo")
@click.option("--out", type=UserPath(path_type=Path), default=Path("runs/demo"), show_default=True)
@click.option(
    "--n", type=click.IntRange(min=1), default=3, show_default=True, help="Items per experiment."
)
@click.option(
    "--workers", type=WORKERS, default=None,
    help="Local worker processes (default: one per core, at most one per row).",
)  # fmt: skip
@threads_option
@plain_errors
def demo_command(out: Path, n: int, workers: int | None, threads: int) -> None:
    """All three experiments on the embedded default model, then analysis and report."""
    from kvreplay.demo import run_demo

    run_demo(out, n, workers=workers, threads=threads)


@main.command("audit", cls=WithBackends, backends=connection_options)
@click.argument("run_dir", type=UserPath(path_type=Path))
@click.option(
    "--sample",
    type=click.IntRange(min=0),
    default=None,
    help="Re-execute a seeded sample of K rows (default: every row). The checks that need "
    "no re-execution (hashes, CSVs, labels and scores re-derived from each row's tokens, "
    "snapshots) run on every row whatever K is; --sample 0 is those checks alone: structure "
    "only, no row re-executed (see docs/audit.md).",
)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--engine", type=click.Choice(["local", "ray"]), default="local", show_default=True)
@click.option("--workers", type=WORKERS, default=1, show_default=True)
@click.option("--gpus-per-worker", type=click.FloatRange(min=0), default=0.0, show_default=True)
@click.option("--ray-address", default=None)
@click.option(
    "--trust-remote-code",
    is_flag=True,
    help="Allow re-executing a run whose model ships its own Python code.",
)
@threads_option
@plain_errors
def audit_command(run_dir: Path, sample: int | None, seed: int, **options: Any) -> None:
    """Verify a run: every row against itself and the folder, and re-execute its rows (or
    a --sample of them) to verify every token, fingerprint and hash."""
    from kvreplay.backends import setting_options
    from kvreplay.verify.audit import audit, format_audit

    connection = {key: options.pop(key) for key in setting_options(connection_only=True)}
    result = audit(
        run_dir, sample=sample, seed=seed, announce=lambda s: click.echo(s, err=True),
        connection=connection, **options,
    )  # fmt: skip
    click.echo(format_audit(result))
    sys.exit(0 if result.passed else 1)


@main.command("probe")
@click.option("--url", required=True, help="The server's base address.")
@click.option("--server", default="auto", show_default=True, help="auto, or which server.")
@click.option("--api-key-env", default="", help="Environment variable holding its API key.")
@click.option("--timeout", type=click.FloatRange(min=0.1, max=86400), default=60.0,
              show_default=True)  # fmt: skip
@plain_errors
def probe_command(url: str, server: str, api_key_env: str, timeout: float) -> None:
    """Ask a running server what it is and whether kvreplay can audit it (exit 0), or
    why not (one sentence, exit 2)."""
    from kvreplay.backends import make_backend

    backend = make_backend("http", url=url, server=server, api_key_env=api_key_env,
                           timeout=timeout)  # fmt: skip
    probe = backend.probe  # type: ignore[attr-defined]
    for name, value in probe.table():
        click.echo(f"{name:<30} {value}")
    refusal = probe.missing(url)
    if refusal is not None:
        raise KvreplayError(refusal)
    click.echo("kvreplay can audit this server: --backend http --url " + url)


@main.command("backends")
@plain_errors
def backends_command() -> None:
    """List every backend, whether this environment can run it, and its capabilities."""
    from kvreplay.backends import backend_class, registry

    for name in registry():
        cls = backend_class(name)
        backend = cls()
        state = "installed" if backend.installed() else "not installed here"
        click.echo(f"{name} ({state}): {cls.summary}")
        if not backend.installed() and cls.install_command():
            click.echo(f"  install: {cls.install_command()}")
        click.echo(f"  capabilities: {', '.join(cls.capabilities.describe())}")
        settings = [m["option"] for m in cls.settings().values() if "option" in m]
        if settings:
            click.echo(f"  settings: {', '.join(settings)}")


@main.command("env")
@click.argument("run_dir", type=UserPath(path_type=Path))
@click.option(
    "--venv",
    default=None,
    help="Build this virtual environment (a new or empty folder) with the run's "
    "environment (else print it).",
)
@plain_errors
def env_command(run_dir: Path, venv: str | None) -> None:
    """Print the environment a run was made in as a requirements file, or rebuild it."""
    from kvreplay.run.ledger import RunLedger
    from kvreplay.run.lock import rebuild, run_environment

    manifest = RunLedger.open_existing(run_dir).manifest
    if venv is None:
        click.echo(run_environment(manifest).requirements(), nl=False)
        return
    rebuild(manifest, venv, lambda line: click.echo(line, err=True))
    click.echo(f"rebuilt {venv}; re-execute the run with: {venv}/bin/kvreplay audit {run_dir}")


@main.group("items")
def items_group() -> None:
    """Make item sets (JSONL for --items)."""


@items_group.command("cut-refeed")
@click.option(
    "--model",
    default="smollm2-135m",
    show_default=True,
    help="The model whose greedy generations are cut (transformers, in process).",
)
@click.option(
    "--dtype",
    type=click.Choice(["fp32", "bf16", "fp16"]),
    default="fp32",
    show_default=True,
    help="Precision of the generations.",
)
@click.option(
    "--from",
    "items_source",
    default="arith",
    show_default=True,
    help="The items whose prompts start the generations (a built-in set or JSONL).",
)
@click.option(
    "--sources",
    type=int,
    default=4,
    show_default=True,
    help="Generations: the first N items of --from.",
)
@click.option(
    "--cuts",
    type=int,
    default=6,
    show_default=True,
    help="Seeded cut points per generation; each is one item.",
)
@click.option(
    "--tokens",
    type=int,
    default=256,
    show_default=True,
    help="The most tokens each generation runs (it ends early at EOS).",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the cut points.")
@click.option(
    "--plan",
    "run_plan",
    default="instruct",
    show_default=True,
    help="The stage plan of the runs that take the items: every cut leaves it room in the "
    "model's context window.",
)
@click.option(
    "--out",
    type=UserPath(path_type=Path),
    required=True,
    help="The JSONL file to write (it must not exist).",
)
@threads_option
@plain_errors
def cut_refeed_command(
    model: str, dtype: str, items_source: str, out: Path, threads: int, **plan: Any
) -> None:
    """Long greedy generations cut at seeded random points, written as items whose prompts
    are the token ids up to each cut (docs/experiments/items-and-plans.md)."""
    from kvreplay.model.refeed import RefeedPlan, check_out, refeed_items, write_items
    from kvreplay.run.threads import intra_op_threads

    refeed = RefeedPlan(items_source=items_source, **plan)
    refeed.check()
    check_out(out, (model, items_source))
    with intra_op_threads(threads):
        items = refeed_items(model, refeed, dtype)
    write_items(items, out)
    sources = len({item.meta["source"] for item in items})
    click.echo(f"wrote {len(items)} cut-and-refeed items from {sources} generation(s) to {out}")


def _add_analysis_commands() -> None:
    from kvreplay.report.commands import analyze, report

    main.add_command(analyze)
    main.add_command(report)


_add_analysis_commands()
